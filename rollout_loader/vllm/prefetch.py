"""Fetch, verify and decode the next committed steps in the background, so an update finds them staged.

A :class:`Prepared` step is everything that can be done before the pause: the object downloaded and its
SHA-256 checked (``StreamReader.open``), its header checked against the engine, a delta decoded and mapped
onto this rank's elements (``state.stage``), an anchor's tensors read into memory; and, once the engine holds
the delta's base step, the delta sealed (``state.seal``: each patched tensor's checksum after the write,
from the bits held and the patch). What is left for the pause is a plain XOR scatter and the comparison of
the sealed checksums with the trainer's.

The :class:`Prefetcher` thread polls the store and prepares the chain from the step the engine holds to the
newest committed step, a few steps ahead at most; the engine wakes it after each update, so the next step is
sealed against the new bits at once. Anything it fails at is dropped (logged once): the update prepares that
step again in its own thread and raises the error there, where it is reported.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch

from deltasync import StreamReader
from deltasync.engine import Notifier, PollPolicy, StepHeader, StepWatch

from .state import Seal, Staged, WorkerState

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Prepared:
    """One step made ready for the write: a delta's staged patches, or an anchor's tensors."""

    step: int
    header: StepHeader
    where: str
    staged: list[Staged] | None = None
    anchor: dict[str, torch.Tensor] | None = None
    seal: Seal | None = None  # a delta's checksums after the write, over the bits held when sealed

    @property
    def ready(self) -> bool:
        """Nothing but the write and the comparison left (a sealed delta; an anchor is staged in the pause)."""
        return self.seal is not None or self.anchor is not None


def prepare(reader: StreamReader, state: WorkerState, step: int, *, base: int | None = None,
            held: int | None = None) -> Prepared:
    """Fetch, verify, decode and stage ``step`` against ``state`` (writes nothing). ``base``: the step the engine
    will hold before it (an anchor that carries its delta from there is prepared as that delta). ``held``: the
    step the engine holds now: a delta on it is sealed in the same pass as its decoding."""
    with reader.open(step, base=base) as obj:
        h = obj.header
        state.check_header(h, obj.where)
        if h.kind == "anchor":
            tensors = {name: obj.read_tensor(name) for name in state.homes}
            return Prepared(step=step, header=h, where=obj.where, anchor=tensors)
        staged, sealed = state.stage_object(obj, seal=held is not None and h.base_step == held)
        return Prepared(step=step, header=h, where=obj.where, staged=staged, seal=sealed)


class Prefetcher:
    """A background thread keeping up to ``ahead`` prepared steps past ``held()``.

    ``held`` returns the step the engine holds (None: nothing yet, so the chain starts at an anchor).
    ``take(step)`` hands over a prepared step (or None). ``stop()`` ends the thread and drops what it holds.
    """

    def __init__(self, reader: StreamReader, state: WorkerState, held: Callable[[], int | None], *,
                 policy: PollPolicy | None = None, notifier: Notifier | None = None, ahead: int = 2,
                 anchor_deltas: bool = True) -> None:
        self.reader = reader
        self.anchor_deltas = anchor_deltas  # open anchors by their own delta where the engine holds its base
        self.state = state
        self.held = held
        # one small read per poll, timed by the stream's cadence; at once when a step is pushed (RDMA announcements)
        self.watch = StepWatch(reader, policy, notifier=notifier)
        self.ahead = ahead
        self._ready: dict[int, Prepared] = {}
        # seconds per step prepared here, by part ("find": the poll and the chain, "prepare": fetch, verify,
        # decode and route, and seal when the engine held the base; "seal": a seal after the engine moved), the
        # last 16 steps: where the time from a commit to a ready step goes
        self.timings: dict[int, dict[str, float]] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._wake = self.watch.wake
        self._logged: str | None = None
        self._thread = threading.Thread(target=self._run, name="deltasync-prefetch", daemon=True)
        self._thread.start()

    def has(self, step: int) -> bool:
        """Whether ``step`` is prepared and sealed (an update to it would only write and compare)."""
        with self._lock:
            p = self._ready.get(step)
            return p is not None and p.ready

    def peek(self, step: int) -> Prepared | None:
        with self._lock:
            return self._ready.get(step)

    def take(self, step: int) -> Prepared | None:
        with self._lock:
            return self._ready.pop(step, None)

    def wake(self) -> None:
        """Look again now (the engine moved: seal the next step against its new bits)."""
        self._wake.set()

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout=60)
        self.watch.close()
        with self._lock:
            self._ready.clear()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self._prefetch_once()
                self._logged = None
            except Exception as e:  # noqa: BLE001 - the update prepares the step itself and reports the error
                if str(e) != self._logged:
                    self._logged = str(e)
                    log.info("deltasync prefetch: %s: %s (the update will fetch the step itself)", type(e).__name__, e)
            self.watch.wait(self.watch.delay())

    def _prefetch_once(self) -> None:
        t0 = time.perf_counter()
        latest = self.watch.newest()
        held = self.held()
        if latest is None or latest == held:
            return
        chain = self.reader.chain(latest, start=held)
        t1 = time.perf_counter()
        wanted = chain[: self.ahead]
        with self._lock:
            for s in list(self._ready):
                if s not in wanted:  # the engine moved past it, or the chain changed
                    del self._ready[s]
        for before, s in zip([held, *wanted], wanted, strict=False):  # each step after the one before it
            if self._stop.is_set():
                return
            with self._lock:
                if s in self._ready:
                    continue
            t2 = time.perf_counter()
            # the first step after the one held is sealed as it is decoded (its base is what the engine holds)
            prepared = prepare(self.reader, self.state, s, base=before if self.anchor_deltas else None,
                               held=held if before == held else None)
            with self._lock:
                if self.held() != held:  # the engine moved meanwhile: stage against what it holds now
                    return
                self._ready[s] = prepared
                self._timed(s, find=t1 - t0, prepare=time.perf_counter() - t2)
        self._seal_next(wanted[0], held)

    def _seal_next(self, step: int, held: int | None) -> None:
        """Seal the next step (its base is the step held) against the bits held now, once."""
        with self._lock:
            prepared = self._ready.get(step)
        if prepared is None or prepared.staged is None or prepared.seal is not None:
            return
        if prepared.header.base_step != held or held is None:
            return
        t0 = time.perf_counter()
        sealed = self.state.seal(prepared.staged)
        with self._lock:
            if self.held() == held and self._ready.get(step) is prepared:
                self._ready[step] = replace(prepared, seal=sealed)
                self._timed(step, seal=time.perf_counter() - t0)

    def _timed(self, step: int, **parts: float) -> None:  # under the lock
        self.timings.setdefault(step, {}).update(parts)
        while len(self.timings) > 16:
            del self.timings[min(self.timings)]
