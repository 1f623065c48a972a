"""Follow a deltasync stream and keep a target (a state dict, or a vLLM engine) at the newest step.

The follower fetches and verifies the next object in the background, then hands it to the target, which
applies it all-or-nothing. A failed step is retried from the nearest anchor; the target keeps its last
consistent step meanwhile and ``step`` never names weights the target does not hold.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any, Protocol

from deltasync import Replica, StepObject, StreamReader
from deltasync.apply import Verify
from deltasync.errors import DeltaSyncError, WaitTimeoutError
from deltasync.maintenance import check_consumer_id, write_heartbeat

log = logging.getLogger(__name__)


class Target(Protocol):
    """Something that holds weights at a step and can move them to another step."""

    @property
    def step(self) -> int | None: ...

    def apply(self, obj: StepObject) -> None:
        """Apply an anchor (any time) or a delta based on ``step``; all or nothing."""


class StateDictTarget:
    """A pure-torch target: a ``Replica`` (state dict plus checksums) in this process."""

    def __init__(self, *, verify: Verify = "incremental", device: str = "cpu") -> None:
        self.replica: Replica | None = None
        self.verify = verify
        self.device = device

    @property
    def step(self) -> int | None:
        return self.replica.step if self.replica else None

    def apply(self, obj: StepObject) -> None:
        if self.replica is None or obj.header.kind == "anchor" and obj.header.tensors.keys() != self.replica.checksums.keys():
            self.replica = Replica.from_anchor(obj, device=self.device)
        else:
            self.replica.apply(obj, verify=self.verify)

    def state_dict(self) -> dict[str, Any]:
        if self.replica is None:
            raise WaitTimeoutError("no step has been applied yet")
        return self.replica.state_dict()


class Follower:
    """Keep ``target`` at the newest committed step of the stream at ``url``.

    ``start()`` runs a background thread polling every ``poll_s``; ``sync()`` catches up once in the
    caller's thread. ``on_step(step)`` is called after each step is live in the target. If the target is
    more than ``max_chain`` deltas behind, it restarts from the nearest anchor instead. With ``consumer_id``
    it records its step in the store after each step (a heartbeat that garbage collection respects).
    """

    def __init__(
        self,
        url: str | StreamReader,
        target: Target,
        *,
        poll_s: float = 0.05,
        max_chain: int = 50,
        on_step: Callable[[int], None] | None = None,
        storage_options: dict[str, Any] | None = None,
        consumer_id: str | None = None,
    ) -> None:
        self.reader = url if isinstance(url, StreamReader) else StreamReader(url, storage_options=storage_options)
        self.target = target
        self.poll_s = poll_s
        self.max_chain = max_chain
        self.on_step = on_step
        self.consumer_id = consumer_id if consumer_id is None else check_consumer_id(consumer_id)
        self.last_error: BaseException | None = None
        self._from_anchor = False  # after a failure, rebuild from the nearest anchor
        self._stop = threading.Event()
        self._changed = threading.Condition()
        self._thread: threading.Thread | None = None

    @property
    def step(self) -> int | None:
        return self.target.step

    def sync(self, step: int | None = None) -> list[int]:
        """Bring the target to ``step`` (default: latest committed); returns the steps applied."""
        if step is None:
            step = self.reader.latest_step()
            if step is None:
                return []
        if step == self.target.step:
            return []
        held = self.target.step
        # walk back only to the step the target holds (or to the nearest anchor when it is not on the chain)
        chain = self.reader.chain(step, start=None if self._from_anchor else held)
        if len(chain) > self.max_chain and self.reader.manifest(chain[0]).kind == "delta":
            chain = self.reader.chain(step)  # too far behind: start again from the nearest anchor
        applied = []
        for s in chain:
            try:
                with self.reader.open(s) as obj:
                    self.target.apply(obj)
            except DeltaSyncError:
                self._from_anchor = True
                raise
            self._from_anchor = False
            applied.append(s)
            with self._changed:
                self._changed.notify_all()
            if self.on_step:
                self.on_step(s)
            if self.consumer_id is not None:
                try:
                    write_heartbeat(self.reader.store, self.consumer_id, s)
                except (DeltaSyncError, OSError) as e:  # a missed heartbeat must not stop the follower
                    log.warning("follower: heartbeat for step %d failed: %s", s, e)
        return applied

    def wait_for(self, step: int, *, timeout_s: float = 60.0) -> int:
        """Block until the target holds ``step`` or later (with ``start()``), or sync to it (without)."""
        deadline = time.monotonic() + timeout_s
        if self._thread is None:
            self.reader.wait_for(step, timeout_s=timeout_s)
            self.sync()
        with self._changed:
            while self.target.step is None or self.target.step < step:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise WaitTimeoutError(
                        f"{self.reader.url}: target holds step {self.target.step}, step {step} not live within {timeout_s}s"
                        + (f" (last error: {self.last_error})" if self.last_error else "")
                    )
                self._changed.wait(min(left, 0.05))
        return self.target.step  # type: ignore[return-value]

    def start(self) -> Follower:
        if self._thread is None:
            self._stop.clear()
            self._thread = threading.Thread(target=self._run, name="deltasync-follower", daemon=True)
            self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def __enter__(self) -> Follower:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.sync()
                self.last_error = None
            except (DeltaSyncError, OSError) as e:
                # the target still holds its last consistent step; try again (from an anchor if needed)
                if str(e) != str(self.last_error):
                    log.warning("follower: %s", e)
                self.last_error = e
            self._stop.wait(self.poll_s)
