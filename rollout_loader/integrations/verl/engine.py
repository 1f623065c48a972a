"""The ``deltasync`` checkpoint engine in verl's registry: actor rank 0 publishes, rollout workers follow.

verl builds one per actor rank and one per rollout worker from ``checkpoint_engine.engine_kwargs.deltasync``;
the store joins the two sides (no process group). Importing this module registers ``"deltasync"`` with
``CheckpointEngineRegistry`` (and imports verl, Ray and torch).
"""

from __future__ import annotations

import asyncio
import logging
import time
import weakref
from collections.abc import AsyncIterator
from typing import Any

import torch
from verl.checkpoint_engine import CheckpointEngine, CheckpointEngineRegistry

from deltasync import PublishOptions, StreamReader
from deltasync.engine import Replica, Verify
from deltasync.errors import ConfigError
from rollout_loader.vllm.trainer_sync import TrainerSync

from .settings import BACKEND, SETTINGS, VerlSettings, step_metrics

log = logging.getLogger(__name__)

__all__ = ["DeltasyncCheckpointEngine"]

WHO = "verl checkpoint engine 'deltasync'"  # names this engine in messages


@CheckpointEngineRegistry.register(BACKEND)
class DeltasyncCheckpointEngine(CheckpointEngine):
    """verl's ``deltasync`` checkpoint engine: publish on the actor side, follow the stream on the rollout side.

    verl makes one per actor rank (``is_master`` on rank 0) and one per rollout worker, with the options of
    ``checkpoint_engine.engine_kwargs.deltasync`` as keyword arguments (:class:`VerlSettings`); which side an
    instance is on shows in the method verl calls. No process group joins the two sides: the store does.

    Step numbers are verl's ``global_steps``, published through :class:`~rollout_loader.vllm.trainer_sync.TrainerSync`
    (the step rules every framework seam shares). A step the stream holds already publishes nothing once the
    actor's weights are proved to be that step's, tensor by tensor: verl syncs the same step again (or passes no
    step) only to wake replicas with unchanged weights, and a resumed run's first step is the one its checkpoint
    was published as. A step older than the stream's newest is a ``ConfigError``: the run resumed from a
    checkpoint older than the stream's newest step, whose later steps it would contradict; publish to a new
    ``url``.

    Args:
        bucket_size: verl's ``update_weights_bucket_megabytes`` in bytes (unused: nothing is bucketed here).
        is_master: set by verl on actor rank 0, the rank that publishes.
        **options: :class:`VerlSettings`.

    Raises:
        ConfigError: a bad option, named as verl's setting.

    Example (what verl does on actor rank 0)::

        engine = CheckpointEngineRegistry.new("deltasync", is_master=True, bucket_size=2 << 30, url="s3://b/run")
        metrics = await engine.send_weights(actor.engine.get_per_tensor_param()[0], global_steps=12)
    """

    def __init__(self, bucket_size: int = 0, is_master: bool = False, **options: Any) -> None:
        self.settings = VerlSettings.parse(options)
        self.settings.trusted()  # a bad key file fails the worker's start, not its first step
        self.bucket_size = bucket_size
        self.is_master = is_master
        self._sync: TrainerSync | None = None  # the actor side's publisher (rank 0)
        self._reader: StreamReader | None = None
        self._replica: Replica | None = None  # the rollout side's verified host copy
        self._delivered: int | None = None  # the step the adapter took whole; None: unknown, yield everything
        self._finalizer: weakref.finalize | None = None  # closes the publisher and reader if close() is not called

    # --- no process group: the store joins the two sides ---

    def prepare(self) -> dict[str, Any]:
        return {}

    @classmethod
    def build_topology(cls, actor_wg_world_size: int, rollout_world_size: int,
                       metadata: list[dict]) -> tuple[dict[str, list[Any]], dict[str, list[Any]]]:
        return {}, {}

    def init_process_group(self, **kwargs: Any) -> None:
        pass

    def finalize(self) -> None:
        pass  # the publisher and reader stay open from step to step (close() ends them)

    def close(self) -> None:
        """Flush and close the publisher (releasing the stream's lease) and the reader."""
        if self._finalizer is not None:
            self._finalizer.detach()
        _close([self._sync, self._reader])
        self._sync = self._reader = None

    def _track(self) -> None:
        """Close what is open when this engine is collected, or at exit (verl never calls a close)."""
        if self._finalizer is not None:
            self._finalizer.detach()
        self._finalizer = weakref.finalize(self, _close, [self._sync, self._reader])

    # --- actor side ---

    async def send_weights(self, weights: Any, global_steps: int | None = None) -> dict[str, float]:
        """Publish the actor's weights as step ``global_steps`` (rank 0) and return once it is committed; on the
        other ranks only walk the generator. Returns the step's metrics (:func:`step_metrics`) on rank 0."""
        if hasattr(weights, "__aiter__"):  # verl's training engines yield from plain generators; an async one is
            weights = [pair async for pair in weights]  # read here first (one copy of the model)
        if not self.is_master:  # every tensor is a collective the publishing rank waits in: read them all
            for _ in weights:
                pass
            return {}
        sync = self._open_sync()
        step = global_steps if global_steps is not None else sync.step  # none: the step synced last, again
        t0 = time.perf_counter()
        try:
            step = sync.send(weights, step=step)  # each tensor diffed as it arrives; blocks until committed
        except ConfigError as e:  # a step the stream cannot take: the way out is another stream
            raise ConfigError(f"{e} (the stream is {SETTINGS}.url)") from None
        log.info("deltasync: step %d committed in %.2f s", step, time.perf_counter() - t0)
        reader = self._open_reader()
        return step_metrics(await asyncio.to_thread(reader.manifest, step))

    def _open_sync(self) -> TrainerSync:
        if self._sync is None:
            s = self.settings
            options = PublishOptions(anchor_every=s.anchor_every, dtype=s.publish_dtype, signing_key=s.signing_key,
                                     stream_id=s.stream_id)
            self._sync = TrainerSync(s.location(), options=options, who=WHO)
            self._track()
        return self._sync

    # --- rollout side ---

    async def receive_weights(self, global_steps: int | None = None) -> AsyncIterator[tuple[str, torch.Tensor]]:
        """Yield step ``global_steps`` (None: the newest committed step) to verl's server adapter: every tensor
        the first time, afterwards only those that changed since the step the adapter last took whole.

        Waits up to ``timeout_s`` for the actor to commit the step (verl runs both sides at once). The tensors
        come from a host copy of the weights, advanced and verified against the trainer's checksums first."""
        names = await asyncio.to_thread(self._advance, global_steps)
        assert self._replica is not None
        tensors, step = self._replica.tensors, self._replica.step
        self._delivered = None  # until the adapter has taken every tensor: a failure in between resends all
        for name in names:
            yield name, tensors[name]
        self._delivered = step

    def _open_reader(self) -> StreamReader:
        if self._reader is None:
            s = self.settings
            self._reader = StreamReader(s.location(), trusted_keys=s.trusted())
            self._track()
        return self._reader

    def _advance(self, global_steps: int | None) -> list[str]:
        """Bring the host copy to the step; return the names to yield."""
        reader = self._open_reader()
        timeout_s = self.settings.timeout_s
        if global_steps is None:
            step = reader.wait_for(None, timeout_s=timeout_s)
        else:
            step = global_steps
            reader.wait_for(step, timeout_s=timeout_s)
            reader.manifest(step)  # committed (StepNotFoundError otherwise: the stream went past it without it)
        verify: Verify = "incremental" if self.settings.verify == "incremental" else "full"
        rep = self._replica
        held = rep.step if rep is not None else None
        changed = None if rep is None or step < rep.step else self._catch_up(reader, rep, step, verify)
        if changed is None:
            self._replica = reader.replica(step, verify=verify)
        assert self._replica is not None
        names = list(self._replica.tensors)
        if changed is not None and self.settings.changed_only and self._delivered is not None \
                and self._delivered == held:
            names = [n for n in names if n in changed]
        log.info("deltasync: rollout at step %d, yielding %d of %d tensors", step, len(names),
                 len(self._replica.tensors))
        return names

    @staticmethod
    def _catch_up(reader: StreamReader, rep: Replica, step: int, verify: Verify) -> set[str] | None:
        """Advance ``rep`` to ``step`` along the cheapest chain; the names it changed (aliases included), or None
        where an anchor brings other tensors than the copy holds (a new copy is needed)."""
        changed: set[str] = set()
        aliases: dict[str, str] = {}
        for s in reader.chain(step, start=rep.step):
            with reader.open(s, base=rep.step) as obj:
                h = obj.header
                if h.kind == "anchor" and h.tensors.keys() != rep.checksums.keys():
                    return None
                rep.apply(obj, verify=verify)
                changed.update(n for n, t in h.tensors.items() if h.kind == "anchor" or t.changed)
                aliases.update(h.aliases)
        changed.update(a for a, target in aliases.items() if target in changed)
        return changed


def _close(things: list[Any]) -> None:
    for thing in things:
        if thing is None:
            continue
        try:
            thing.close()
        except Exception as e:  # noqa: BLE001 - closing at exit: say so, never raise
            log.warning("deltasync: closing %s failed: %s", type(thing).__name__, e)
