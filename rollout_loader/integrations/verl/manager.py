"""``DeltasyncCheckpointManager``: verl's weight sync with every vLLM server applying each step in place.

Set as ``rollout.checkpoint_manager_class``; the actors still publish through the ``deltasync`` checkpoint engine
(:mod:`.engine`), and deltasync's vLLM weight-transfer engine in each server does the rest. Imports verl.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Mapping
from typing import Any

from verl.checkpoint_engine import CheckpointEngineManager
from verl.utils.ray_utils import auto_await

from deltasync.errors import ConfigError, DeltaSyncError, EngineError, can_retry, in_text

from .settings import BACKEND, VerlSettings, plain

__all__ = ["DeltasyncCheckpointManager"]

_ROLLOUT = "actor_rollout_ref.rollout"


def _check_replica(replica: Any) -> None:
    """A replica whose vLLM servers the deltasync engine can update in place, or a ConfigError naming why not."""
    config = replica.config
    name = getattr(config, "name", None)
    if name != "vllm":
        raise ConfigError(f"{_ROLLOUT}.name must be vllm for DeltasyncCheckpointManager (its servers apply steps "
                          f"through vLLM's weight-transfer engine), got {name!r}")
    mode = getattr(getattr(replica, "rollout_mode", None), "name", None)
    if mode == "HYBRID":
        raise ConfigError(f"{_ROLLOUT}: DeltasyncCheckpointManager updates rollout replicas of their own (standalone "
                          "or colocated); a hybrid replica shares the trainer's processes: use "
                          f"{_ROLLOUT}.checkpoint_engine.backend=naive there")
    if getattr(config, "data_parallel_size", 1) != 1:
        raise ConfigError(f"{_ROLLOUT}.data_parallel_size must be 1 for DeltasyncCheckpointManager (a server's "
                          f"collective_rpc reaches one data-parallel shard), got {config.data_parallel_size!r}")
    transfer = plain((plain(getattr(config, "engine_kwargs", None)) or {}).get("vllm") or {}).get(
        "weight_transfer_config")
    if isinstance(transfer, str):  # vLLM's command line takes it as JSON text too
        try:
            transfer = json.loads(transfer)
        except ValueError:
            pass
    if (transfer.get("backend") if isinstance(transfer, Mapping) else None) != BACKEND:
        raise ConfigError(f"{_ROLLOUT}.engine_kwargs.vllm.weight_transfer_config must be {{backend: {BACKEND}}} for "
                          f"DeltasyncCheckpointManager (vLLM's servers apply each step with deltasync's engine), "
                          f"got {transfer!r}: add +{_ROLLOUT}.engine_kwargs.vllm.weight_transfer_config.backend="
                          f"{BACKEND}")


def _reason(e: BaseException) -> tuple[str, DeltaSyncError | None]:
    """An error as one line (Ray's wrapper unwrapped), and the deltasync error the engine raised when its text
    carries one (its class, and whether retrying can help: ``deltasync.errors.in_text``)."""
    cause = getattr(e, "cause", None)
    inner = cause if isinstance(cause, BaseException) else e
    rebuilt = in_text(str(inner))
    if rebuilt is not None:
        return f"{type(rebuilt).__name__}: {rebuilt}", rebuilt
    text = str(inner).strip().splitlines()
    return f"{type(inner).__name__}: {text[-1] if text else ''}", None


class DeltasyncCheckpointManager(CheckpointEngineManager):
    """A verl checkpoint manager that makes every vLLM server apply each step in place through deltasync's engine.

    Set as ``actor_rollout_ref.rollout.checkpoint_manager_class`` (honoured by verl's ``RayPPOTrainer`` and the
    ``experimental/separation`` trainer) with ``checkpoint_engine.backend=deltasync`` and vLLM started with
    ``engine_kwargs.vllm.weight_transfer_config={backend: deltasync}``. Each ``update_weights(global_steps)``:

    1. the actor ranks publish the step through the ``deltasync`` checkpoint engine (rank 0 waits for the commit);
    2. generation is paused (verl's ``abort_all_requests``: in-flight requests are saved for partial rollout);
    3. every replica's vLLM server runs ``init_weight_transfer_engine`` (first time), ``start_weight_update``,
       ``update_weights({"step": N})`` and ``finish_weight_update`` on all its workers: each rank writes the chain
       from the step it holds to N in place, verifies it against the trainer's checksums and undoes it whole on
       any failure or mismatch (so a failed replica still holds its previous step, bit for bit);
    4. prefix and KV caches are reset, verl's version label set (``set_global_steps``), generation resumed.

    A replica holds step N once its update returned: the engine raises on every rank otherwise, and verl's server
    relays the error. When any replica fails, the error (the class the engine raised, so whether retrying can help
    is the engine's answer; ``EngineError`` when it carries none) says which replica holds which step; calling
    ``update_weights`` again converges (a replica at N is left alone). Returns the step's metrics
    (:func:`step_metrics`) plus the seconds spent publishing and applying.

    The vLLM engine's own ``weight_version`` is not set: verl's server exposes no call that reaches it
    (``set_global_steps`` is verl's label). Data parallelism inside one replica and hybrid replicas are refused.

    Raises:
        ConfigError: (at construction) the backend is not ``deltasync``, its options are bad, or a replica is not
            a vLLM replica started with deltasync's weight-transfer engine; each names the setting.
        DeltaSyncError: (``update_weights``) a replica failed to apply the step: the engine's error class, or
            ``EngineError``.
    """

    def __init__(self, config: Any, actor_wg: Any, replicas: list[Any]) -> None:
        if getattr(config, "backend", None) != BACKEND:
            raise ConfigError(f"{_ROLLOUT}.checkpoint_engine.backend must be {BACKEND} with DeltasyncCheckpointManager "
                              f"(the actor ranks publish through it), got {getattr(config, 'backend', None)!r}")
        self.settings = VerlSettings.parse(plain(config.engine_kwargs or {}).get(BACKEND))
        self._init_info = self.settings.init_info()
        super().__init__(config, actor_wg, replicas)
        for replica in self.replicas:
            _check_replica(replica)
        self.held: dict[int, int | None] = {}  # id(replica) -> the step it holds (absent: not updated by us)
        self._initialised: set[int] = set()

    def add_replicas(self, replicas: list[Any]) -> None:
        for replica in replicas:
            _check_replica(replica)
        super().add_replicas(replicas)

    def remove_replicas(self, replicas: list[Any]) -> None:
        for replica in replicas:
            self.held.pop(id(replica), None)
            self._initialised.discard(id(replica))
        super().remove_replicas(replicas)

    @auto_await
    async def update_weights(self, global_steps: int | None = None) -> dict[str, float]:
        t0 = time.perf_counter()
        refs = self.actor_wg.update_weights(global_steps=global_steps, mode=self.backend)
        metrics: dict[str, float] = {}
        for result in await asyncio.gather(*refs):
            if isinstance(result, dict):
                metrics.update(result)
        if "checkpoint_engine/deltasync_step" not in metrics:
            raise EngineError(f"no actor rank published a step (results: {metrics}): is actor rank 0's checkpoint "
                              f"engine the {BACKEND!r} backend?")
        step = int(metrics["checkpoint_engine/deltasync_step"])
        t1 = time.perf_counter()
        await self.abort_replicas()
        try:
            outcomes = await asyncio.gather(*(self._apply(r, step) for r in self.replicas), return_exceptions=True)
        finally:
            await self.resume_generation_replicas()
        failed = [(i, *_reason(o)) for i, o in enumerate(outcomes) if isinstance(o, BaseException)]
        if failed:
            raise self._failure(step, failed)
        metrics["checkpoint_engine/deltasync_publish_s"] = t1 - t0
        metrics["checkpoint_engine/deltasync_apply_s"] = time.perf_counter() - t1
        return metrics

    def _failure(self, step: int, failed: list[tuple[int, str, DeltaSyncError | None]]) -> DeltaSyncError:
        """The error to raise: of the class the engine raised where one carries its record (the first that retrying
        cannot help, else the first), so verl and whoever retries get the engine's answer; else ``EngineError``.
        Its message says which replica holds which step."""
        i, reason, error = next((f for f in failed if f[2] is not None and not can_retry(f[2])), failed[0])
        again = ("update_weights again retries the replicas behind" if error is None or can_retry(error) else
                 "retrying cannot help that replica")
        text = (f"step {step}: {len(failed)} of {len(self.replicas)} rollout replica(s) failed to apply it; "
                f"{self.describe()}; replica {i}: {reason} ({again})")
        try:
            return type(error)(text) if error is not None else EngineError(text)
        except TypeError:  # a class with other constructor arguments (none today)
            return EngineError(text)

    def describe(self) -> str:
        """Which replica holds which step, as far as this manager knows (``unknown``: not updated by it yet)."""
        return ", ".join(f"replica {i} holds step {self.held[id(r)] if self.held.get(id(r)) is not None else 'unknown'}"
                         for i, r in enumerate(self.replicas))

    async def _apply(self, replica: Any, step: int) -> None:
        """One replica to ``step``, in place, on every worker (through its node-0 server's AsyncLLM)."""
        server = replica.servers[0]
        key = id(replica)
        if key not in self._initialised:
            await server.collective_rpc.remote("init_weight_transfer_engine", kwargs={"init_info": self._init_info})
            self._initialised.add(key)
        await server.collective_rpc.remote("start_weight_update")
        # a failed update ends the session in vLLM and leaves the engine at the step it held before (undone whole)
        await server.collective_rpc.remote("update_weights", kwargs={"update_info": {"step": step}})
        await server.collective_rpc.remote("finish_weight_update")
        self.held[key] = step
        await replica.clear_kv_cache()  # prompts cached with the previous weights must not be reused
        await asyncio.gather(*(s.set_global_steps.remote(step) for s in replica.servers))
