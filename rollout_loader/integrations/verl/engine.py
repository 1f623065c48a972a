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

from deltasync import DeltaPublisher, StreamReader
from deltasync.engine import MAX_STEP, Replica, Verify
from deltasync.errors import StepOrderError

from .settings import BACKEND, SETTINGS, VerlSettings, step_metrics

log = logging.getLogger(__name__)

__all__ = ["DeltasyncCheckpointEngine"]


async def _drain(weights: Any) -> None:
    """Walk a weights generator to its end: every actor rank must, since producing each tensor is collective."""
    if hasattr(weights, "__aiter__"):
        async for _ in weights:
            pass
    else:
        for _ in weights:
            pass


@CheckpointEngineRegistry.register(BACKEND)
class DeltasyncCheckpointEngine(CheckpointEngine):
    """verl's ``deltasync`` checkpoint engine: publish on the actor side, follow the stream on the rollout side.

    verl makes one per actor rank (``is_master`` on rank 0) and one per rollout worker, with the options of
    ``checkpoint_engine.engine_kwargs.deltasync`` as keyword arguments (:class:`VerlSettings`); which side an
    instance is on shows in the method verl calls. No process group joins the two sides: the store does.

    Step numbers are verl's ``global_steps``. A step this engine published last, or ``global_steps=None`` (verl
    passes the same step, or none, only to wake replicas again with unchanged weights), publishes nothing; so
    does the first step of a resumed run when the stream's newest step is that very step. A step at or below
    the stream's newest step otherwise is a ``StepOrderError``: the run resumed from a checkpoint older than
    the stream's newest step, whose later steps it would contradict; publish to a new ``url``.

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
        self._publisher: DeltaPublisher | None = None
        # the step being published, where the publisher's source function finds it (a box, not self: the
        # publisher must not keep this engine alive, or the finalizer below would never run)
        self._weights: list[dict[str, torch.Tensor]] = [{}]
        self._published: int | None = None  # the step this engine published (or found committed) last
        self._newest: int | None = None  # the stream's newest committed step, as this engine knows it
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
        _close([self._publisher, self._reader])
        self._publisher = self._reader = None

    def _track(self) -> None:
        """Close what is open when this engine is collected, or at exit (verl never calls a close)."""
        if self._finalizer is not None:
            self._finalizer.detach()
        self._finalizer = weakref.finalize(self, _close, [self._publisher, self._reader])

    # --- actor side ---

    async def send_weights(self, weights: Any, global_steps: int | None = None) -> dict[str, float]:
        """Publish the actor's weights as step ``global_steps`` (rank 0) and return once it is committed; on the
        other ranks only walk the generator. Returns the step's metrics (:func:`step_metrics`) on rank 0."""
        if not self.is_master:
            await _drain(weights)
            return {}
        try:
            pub = self._open_publisher()
            step, publish = self._step_for(global_steps)
        except BaseException:
            await _drain(weights)  # the other ranks' gathers still need this rank
            raise
        if not publish:
            await _drain(weights)
            log.info("deltasync: step %d is in the stream already: nothing published", step)
        else:
            t0 = time.perf_counter()
            await self._publish(pub, step, weights)
            await asyncio.to_thread(pub.flush)
            self._newest = step
            log.info("deltasync: published step %d in %.2f s", step, time.perf_counter() - t0)
        self._published = step
        reader = self._open_reader()
        return step_metrics(await asyncio.to_thread(reader.manifest, step))

    def _open_publisher(self) -> DeltaPublisher:
        if self._publisher is None:
            s, box = self.settings, self._weights
            self._publisher = DeltaPublisher(
                s.url, lambda: box[0], storage_options=s.storage_options, anchor_every=s.anchor_every,
                dtype=s.publish_dtype, signing_key=s.signing_key, on_backlog="block",  # never skip a verl step
            )
            self._newest = self._publisher.last_committed_step
            self._track()
        return self._publisher

    def _step_for(self, global_steps: int | None) -> tuple[int, bool]:
        """The step to publish as, and whether to publish it (see the class docstring)."""
        where = f"{self.settings.url}: verl's global_steps"
        if global_steps is None:
            if self._published is not None:
                return self._published, False
            return (0 if self._newest is None else self._newest + 1), True
        if isinstance(global_steps, bool) or not isinstance(global_steps, int) or not 0 <= global_steps <= MAX_STEP:
            raise StepOrderError(f"{where} must be a step number (0..{MAX_STEP}), got {global_steps!r}")
        if global_steps == self._published:
            return global_steps, False
        if self._newest is not None and global_steps <= self._newest:
            if global_steps == self._newest and self._published is None:
                return global_steps, False  # a resumed run starts at the step the stream ends with
            raise StepOrderError(
                f"{where} is {global_steps}, but the stream already holds steps up to {self._newest}: the run "
                f"resumed from a checkpoint older than the stream's newest step, whose later steps it would "
                f"contradict; publish to a new stream ({SETTINGS}.url)")
        return global_steps, True

    async def _publish(self, pub: DeltaPublisher, step: int, weights: Any) -> None:
        """Capture ``weights`` as ``step`` (diffed against the step before; encoded and uploaded behind)."""
        # TODO(stream): pub.publish(step, weights=weights) once branch `stream` lands: each tensor diffed as it
        # arrives, instead of this second copy of the model on the host
        dtype = self.settings.publish_dtype
        collected: dict[str, torch.Tensor] = {}
        try:
            if hasattr(weights, "__aiter__"):
                async for name, tensor in weights:
                    collected[name] = _host(tensor, dtype)
            else:
                for name, tensor in weights:
                    collected[name] = _host(tensor, dtype)
        except BaseException:
            await _drain(weights)
            raise
        self._weights[0] = collected
        try:
            pub.publish(step)
        finally:
            self._weights[0] = {}

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
            self._reader = StreamReader(s.url, storage_options=s.storage_options, trusted_keys=s.trusted())
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


def _host(tensor: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    """A tensor as published: cast on its own device (less to copy), then on the host."""
    t = tensor.detach()
    if dtype is not None and t.is_floating_point():
        t = t.to(dtype)
    return t.to("cpu")


def _close(things: list[Any]) -> None:
    for thing in things:
        if thing is None:
            continue
        try:
            thing.close()
        except Exception as e:  # noqa: BLE001 - closing at exit: say so, never raise
            log.warning("deltasync: closing %s failed: %s", type(thing).__name__, e)
