"""Follow a deltasync stream and keep a target (a state dict, or a vLLM engine) at the newest step.

The follower finds the newest step in the background (:class:`deltasync.follow.watch.FollowLoop`, the one follow loop)
and tells the target to advance along the chain to it, one step at a time; the target reads what it needs from
the follower's reader (a state dict fetches and verifies the step's object; a vLLM engine is sent the step number
and reads the store itself) and applies it all-or-nothing. A failed step is retried (from the nearest anchor when
the step's content was at fault) with exponential backoff; the target keeps its last consistent step meanwhile
and ``step`` never names weights the target does not hold. A follower goes to the newest step by the shortest
chain: when the newest step is an anchor it applies only that anchor, so ``on_step`` need not see every step.
"""

from __future__ import annotations

import atexit
import dataclasses
import functools
import logging
import sys
import threading
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

from deltasync import DeltaSyncError, StreamReader
from deltasync.engine import (
    EventFeed,
    FollowLoop,
    Notifier,
    PollPolicy,
    StepWatch,
    StoreLocation,
    TrustedKeys,
    check_consumer_id,
    open_reader,
    write_heartbeat,
)
from deltasync.errors import (
    CatchupError,
    ConfigError,
    FollowError,
    FormatError,
    SignatureError,
    StepNotFoundError,
    WaitTimeoutError,
    can_retry,
)

from .metrics import FollowerStats, FollowerStatus, MetricsServer, serve
from .targets import Target

log = logging.getLogger(__name__)


class Follower:
    """Keep ``target`` at the newest committed step of the stream at ``url`` (a URL, a
    :class:`~deltasync.engine.StoreLocation` or a reader).

    ``start()`` runs a background thread that polls the store; ``sync()`` catches up once in the caller's
    thread. A poll is one small read (``latest.json``: :class:`deltasync.follow.watch.StepWatch`), spaced by the
    stream's cadence (``policy``, a :class:`~deltasync.follow.watch.PollPolicy`): every ``fast_s`` around the moment the
    next step is due, backing off to ``idle_max_s`` while the stream is quiet (docs/FORMAT.md section 5c). With a
    ``notifier`` (:mod:`deltasync.notify`: a mirror's ``EventFeed``, an ``RdmaConsumer``) a pushed step is
    fetched at once and polls slow to a safety net. ``on_step(step)`` is called after each step is live in the target.
    If the target is more than ``max_chain`` deltas behind, it restarts from the nearest anchor instead. With
    ``consumer_id`` it records its step in the store (a heartbeat that garbage collection respects and ``deltasync
    status`` shows): after a step at most every ``heartbeat_s / 10``, and every ``heartbeat_s`` while idle.

    Failures: every exception is recorded in ``last_error``, with the step it happened at in
    ``last_error_step`` (None when no step was being applied, e.g. listing the store failed); both are
    cleared by the next success. The thread never dies from one failure: it retries after
    ``deltasync.follow.watch.retry_delay_s`` (``fast_s`` doubling up to the policy's ``retry_max_s``), logging each
    distinct error once.
    An error retrying cannot help (``deltasync.errors.can_retry``: the error class decides; e.g. a stream whose
    model changed shape, wrong credentials or settings, a missing package, a target said to hold a step it does
    not) stops it; ``wait_for`` then raises ``FollowError`` from that error, and
    on its deadline ``WaitTimeoutError`` from the last error. ``sync()`` raises the error itself.

    Provenance and metrics: ``lag_steps`` is how far the held step is behind the newest committed step
    the follower has seen (``newest_step``); ``status()`` adds what applying cost (rollout_loader/metrics.py).
    With ``metrics_port`` (0: any free port) it serves them for Prometheus at ``metrics_server.url``
    (needs prometheus-client: ``pip install 'deltasync[metrics]'``).

    ``close()`` (or leaving a ``with`` block, which also ``start()``s) stops the thread, the metrics
    endpoint, and removes the download cache of the reader it made from ``url``.

    ``trusted_keys`` (public key files from ``deltasync keygen``): only steps signed by one of them are applied;
    a forged, unsigned or replayed step is refused (``SignatureError``) and the target keeps its last good step.
    The target (:class:`~rollout_loader.targets.Target`) is connected to the follower's reader and event feed
    before the first step (an engine is given the follower's store, storage options, trusted keys and feed,
    unless its own settings name others), and again after a failure.

    Example::

        with Follower(url, StateDictTarget(), policy=PollPolicy(fast_s=0.1), consumer_id="rollout-0") as f:
            f.wait_for(10)
    """

    def __init__(
        self,
        url: str | StoreLocation | StreamReader,
        target: Target,
        *,
        policy: PollPolicy | None = None,
        max_chain: int = 50,
        on_step: Callable[[int], None] | None = None,
        storage_options: dict[str, Any] | None = None,
        consumer_id: str | None = None,
        heartbeat_s: float = 300.0,
        metrics_port: int | None = None,
        metrics_addr: str = "127.0.0.1",
        notifier: Notifier | None = None,
        trusted_keys: Any = None,
    ) -> None:
        self.reader, self._owns_reader = open_reader(url, storage_options)
        if trusted_keys is not None:  # every step must be signed by one of them (docs/FORMAT.md section 5e)
            self.reader.trusted = TrustedKeys.load(trusted_keys)
        self.stats = FollowerStats(self.reader.url)
        self.target = target
        # a target that reads the store itself listens to the same event feed (its URL), unless it names its own
        self._notify_url = notifier.url if isinstance(notifier, EventFeed) else None
        self._connected = False  # the target was told the stream and asked its step
        self.watch = StepWatch(self.reader, policy, notifier=notifier)
        self.policy = self.watch.policy
        self.max_chain = max_chain
        self.on_step = on_step
        self.consumer_id = consumer_id if consumer_id is None else check_consumer_id(consumer_id)
        if not (isinstance(heartbeat_s, (int, float)) and 0 < heartbeat_s < 1e7):
            raise ConfigError(f"Follower: heartbeat_s must be a positive number of seconds, not {heartbeat_s!r}")
        self.heartbeat_s = float(heartbeat_s)
        self._beat_at: float | None = None  # monotonic time of the last heartbeat written
        self._beat_due = False  # a step was applied since
        self.last_error: BaseException | None = None
        self.last_error_step: int | None = None
        self.stopped_by: BaseException | None = None  # the permanent error that stopped the thread
        self._logged: tuple[str, str] | None = None  # the error last logged: each distinct one once
        self._at_step: int | None = None  # the step being applied
        self._from_anchor = False  # after a failure, rebuild from the nearest anchor
        self._stream_seen = False  # stream.json (or a step) was seen: an empty listing is a quiet stream
        self._sync_lock = threading.Lock()  # one sync at a time (thread and caller)
        # the one follow loop: the newest step, then the chain to it (in the thread, or in a caller that waits)
        self._loop = FollowLoop(self.watch, self._follow, on_error=self._failed, on_success=self._succeeded,
                                lock=self._sync_lock, hurry_s=self.policy.fast_s)
        self._stop = threading.Event()
        self._poke = self.watch.wake  # wakes the thread: a pushed step, stop(), or a caller began to wait
        self._waiters = 0  # callers in wait_for (under _changed)
        self._changed = threading.Condition()
        self._thread: threading.Thread | None = None
        self.metrics_server: MetricsServer | None = None
        if metrics_port is not None:
            try:
                self.metrics_server = serve(self, metrics_port, addr=metrics_addr)
            except BaseException:
                self.watch.close()
                if self._owns_reader:
                    self.reader.close()
                raise

    @property
    def step(self) -> int | None:
        return self.target.step

    @property
    def failures(self) -> int:
        """Failed attempts since the last success."""
        return self._loop.failures

    @property
    def newest_step(self) -> int | None:
        """The newest committed step this follower has seen in the store (its last poll's, or a step it applied)."""
        return self.stats.status(None).newest_step

    @property
    def lag_steps(self) -> int | None:
        """How many steps the target is behind the newest committed step seen (None until both are known):
        rollouts generated now come from weights this many steps older than the trainer's newest."""
        return self.status().lag_steps

    def status(self) -> FollowerStatus:
        """Where the follower stands: held and newest step, lag, steps and bytes applied, errors, last apply and
        pause seconds (what ``metrics_port`` serves)."""
        return self.stats.status(self.target.step)

    @property
    def running(self) -> bool:
        """Whether the background thread is following (False after ``stop()`` or a permanent error)."""
        return self._thread is not None and self._thread.is_alive()

    def sync(self, step: int | None = None) -> list[int]:
        """Bring the target to ``step`` (default: latest committed); returns the steps applied.

        Raises what stopped it (also recorded in ``last_error``); the target keeps its last consistent step.
        """
        with self._sync_lock:
            try:
                applied = self._sync(self.watch.newest() if step is None else step, chosen=step is None)
            except Exception as e:
                self._loop.failed(e)
                raise
            self._loop.succeeded()
            return applied

    def connect(self) -> int | None:
        """Point the target at the stream (the follower's reader and event feed) and ask which step it holds;
        returns that step. The first sync does this (again after a failure); call it first to meet an engine that
        cannot be reached or lacks a flag (``EngineConfigError``) before following."""
        if not self._connected:
            self.target.connect(self.reader, notify=self._notify_url)
            self._connected = True
        return self.target.step

    def _follow(self, newest: int | None) -> None:
        """The follow loop's act (under the sync lock): go to the newest step, then write a heartbeat if due."""
        self._sync(newest, chosen=True)
        self.heartbeat()

    def _sync(self, step: int | None, *, chosen: bool) -> list[int]:
        """Bring the target to ``step``; ``chosen``: ``step`` is the watch's newest (None: the stream has none yet),
        not a step the caller asked for."""
        self._at_step = None
        self.connect()
        if chosen:
            self.stats.saw_newest(step)
            if step is None:
                if not self._stream_seen:  # a wrong URL must not look like a quiet stream
                    self.reader.store.require_stream()
                    self._stream_seen = True
                return []
        assert step is not None
        if step == self.target.step:
            return []
        held = self.target.step
        # walk back only to the step the target holds (or to the nearest anchor when it is not on the chain)
        try:
            chain = self.reader.chain(step, start=None if self._from_anchor else held)
        except SignatureError as e:
            if chosen:  # the newest step's chain breaks the chain of trust: it does not exist (docs/FORMAT.md 5e)
                self.watch.refuse(step, str(e))
            raise
        if len(chain) > self.max_chain and self.reader.manifest(chain[0]).kind == "delta":
            chain = self.reader.chain(step)  # too far behind: start again from the nearest anchor
        applied = []
        for s in chain:
            self._at_step = s
            t0 = time.perf_counter()
            try:
                self.target.advance(self.reader, s)
            except CatchupError:
                raise  # refused by the reader: the next attempt takes the steps' own objects, not an anchor
            except DeltaSyncError:
                self._from_anchor = True  # the content was at fault: the next attempt starts at an anchor
                raise
            self._from_anchor = False
            applied.append(s)
            self.stats.applied(s, nbytes=self.reader.manifest(s).object_bytes, apply_s=time.perf_counter() - t0,
                               pause_s=_last_pause_s(self.target))
            with self._changed:
                self._changed.notify_all()
            self._beat_due = True
            if self.on_step:
                self.on_step(s)
        self._at_step = None
        self.heartbeat()
        return applied

    def heartbeat(self, *, force: bool = False) -> bool:
        """Write this consumer's heartbeat (``consumers/<consumer_id>.json``: held step, newest seen, weight
        version, errors) when one is due: after a step, at most every ``heartbeat_s / 10``; otherwise every
        ``heartbeat_s``, so that ``deltasync status`` and garbage collection see a live consumer. Returns
        whether it wrote; a failed write is logged, never raised. The thread calls it after every poll."""
        held = self.target.step
        if self.consumer_id is None or held is None:
            return False
        now = time.monotonic()
        since = None if self._beat_at is None else now - self._beat_at
        if not (force or since is None or since >= self.heartbeat_s
                or self._beat_due and since >= self.heartbeat_s / 10):
            return False
        try:
            seen = self.stats.status(held)
            record_of = getattr(self.target, "record", None)  # an engine's replica record (VllmTarget.record)
            record = record_of() if callable(record_of) else None
            if record is not None and record.last_error is None and self.last_error is not None:
                record = dataclasses.replace(record, last_error=f"{type(self.last_error).__name__}: {self.last_error}")
            beat = functools.partial(write_heartbeat, self.reader.store, self.consumer_id, held,
                                     newest_step=seen.newest_step,
                                     weight_version=getattr(self.target, "weight_version", None), errors=seen.errors)
            try:
                beat(record=record)
            except FormatError as e:  # the target's own account does not fit: it costs the record, not the position
                if record is None:
                    raise
                log.warning("follower: heartbeat for step %d written without the target's replica record, which "
                            "does not fit it: %s", held, e)
                beat(record=None)
        except Exception as e:  # noqa: BLE001 - a missed heartbeat must not stop the follower
            log.warning("follower: heartbeat for step %d failed: %s", held, str(e))
            return False
        self._beat_at, self._beat_due = now, False
        return True

    def _failed(self, e: Exception) -> None:
        """Record a failure (the follow loop counted it); log it unless it is the one logged last."""
        at_step, self._at_step = self._at_step, None  # the next failure may be the poll's, at no step
        self.last_error, self.last_error_step = e, at_step
        self._connected = False  # the target is asked again which step it holds
        if isinstance(e, StepNotFoundError):
            self.watch.distrust()  # a hinted step that is not there: list the manifests next time
        self.stats.failed()
        key = (type(e).__name__, str(e))
        if key != self._logged:
            self._logged = key
            at = "" if at_step is None else f" at step {at_step}"
            permanent = not can_retry(e)
            what = "stopping: retrying cannot help" if permanent else "retrying"
            # text only: a log record that kept the exception would keep its frames (the reader, its
            # downloads) alive as long as any handler keeps the record
            where = "" if isinstance(e, DeltaSyncError) else "\n" + "".join(traceback.format_exception(e)).rstrip()
            log.log(logging.ERROR if permanent else logging.WARNING, "follower%s: %s: %s (%s)%s", at, key[0], key[1],
                    what, where)
        with self._changed:
            self._changed.notify_all()

    def _succeeded(self) -> None:
        if self._logged is not None:
            log.info("follower: recovered, the target holds step %s", self.target.step)
        self.last_error = self.last_error_step = None
        self._logged = None

    def wait_for(self, step: int, *, timeout_s: float = 60.0) -> int:
        """Block until the target holds ``step`` or later; returns the step it holds.

        With ``start()`` the thread does the work, polling every ``fast_s`` while anyone waits; without, the
        caller's thread drives the same follow loop (polling every ``fast_s``), retrying failures like the thread.
        Raises ``FollowError`` (from the error) once the follower stopped on a permanent error,
        ``WaitTimeoutError`` (from the last error, if any) at the deadline.
        """
        deadline = time.monotonic() + timeout_s
        if self._thread is None:
            return self._wait_here(step, deadline, timeout_s)
        with self._changed:
            self._waiters += 1  # someone waits for a step: the thread polls every fast_s meanwhile
            self._poke.set()
            try:
                while not self._holds(step):
                    self._raise_if_stopped(step)
                    left = deadline - time.monotonic()
                    if left <= 0:
                        self._timed_out(step, timeout_s)
                    self._changed.wait(min(left, 0.05))
            finally:
                self._waiters -= 1
        return self.target.step  # type: ignore[return-value]

    def _wait_here(self, step: int, deadline: float, timeout_s: float) -> int:
        """The follow loop in the caller's thread, at the fast period, until the target holds ``step``."""
        while not self._holds(step):
            self._raise_if_stopped(step)
            try:
                delay = self._loop.turn(hurry=True)
            except Exception as e:  # retrying cannot help (recorded and logged by _failed)
                self.stopped_by = e
                self._raise_if_stopped(step)
                raise  # not reached: _raise_if_stopped raised
            if self._holds(step):
                break
            left = deadline - time.monotonic()
            if left <= 0:
                self._timed_out(step, timeout_s)
            self._loop.wait(min(left, delay))  # sooner when a step is pushed
        return self.target.step  # type: ignore[return-value]

    def _holds(self, step: int) -> bool:
        held = self.target.step
        return held is not None and held >= step

    def _raise_if_stopped(self, step: int) -> None:
        e = self.stopped_by
        if e is not None:
            at = f" at step {self.last_error_step}" if self.last_error_step is not None else ""
            raise FollowError(
                f"{self.reader.url}: the follower stopped{at} and cannot reach step {step} "
                f"(the target holds step {self.target.step}): {type(e).__name__}: {e}"
            ) from e

    def _timed_out(self, step: int, timeout_s: float) -> None:
        e = self.last_error
        at = "" if self.last_error_step is None else f" at step {self.last_error_step}"
        why = "" if e is None else f" (last error{at}: {type(e).__name__}: {e})"
        raise WaitTimeoutError(
            f"{self.reader.url}: target holds step {self.target.step}, step {step} not live within {timeout_s}s{why}"
            f"{self._doing()}"
        ) from e

    def _doing(self) -> str:
        """Where the follower thread is now (a wait that timed out says whether it was stuck, and where)."""
        thread = self._thread
        frame = sys._current_frames().get(thread.ident) if thread is not None and thread.ident else None
        if frame is None:
            return ""
        where = [f"{Path(f.filename).name}:{f.lineno} {f.name}" for f in traceback.extract_stack(frame)[-6:]]
        return f"; the follower thread is in {' < '.join(reversed(where))}"

    def start(self) -> Follower:
        """Follow in a background thread (again after ``stop()`` or a permanent error)."""
        if not self.running:
            self._stop.clear()
            self._poke.clear()
            self.stopped_by = None
            self._thread = threading.Thread(target=self._run, name="deltasync-follower", daemon=True)
            self._thread.start()
            # stopped before deltasync removes its caches at exit: the thread may be downloading into one
            atexit.register(self._halt)
        return self

    def stop(self) -> None:
        """Stop the background thread (waits for the step in progress)."""
        self._stop.set()
        self._poke.set()
        thread, self._thread = self._thread, None
        if thread is not None:
            atexit.unregister(self._halt)
            if thread is not threading.current_thread():
                thread.join()

    def close(self) -> None:
        """Stop, close the metrics endpoint, and remove the download cache of the reader made from ``url`` (also
        after an error)."""
        try:
            self.stop()
            self.watch.close()  # the store's own event feed, if it opened one
            if self._beat_due:
                self.heartbeat(force=True)  # the step it holds now, for garbage collection and status
        finally:
            try:
                server, self.metrics_server = self.metrics_server, None
                if server is not None:
                    server.close()
            finally:
                if self._owns_reader:
                    self.reader.close()

    def __enter__(self) -> Follower:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _halt(self) -> None:
        self._stop.set()
        self._poke.set()
        thread = self._thread
        if thread is not None:
            thread.join(timeout=max(10.0, 2 * self.policy.fast_s))

    def _run(self) -> None:
        # while a caller waits for a step, poll at the fast period; otherwise by the stream's cadence. A pushed
        # step, a stop or a new waiter ends a wait early (they set the watch's wake)
        try:
            self._loop.run(self._stop, hurry=lambda: self._waiters > 0)
        except Exception as e:  # retrying cannot help: recorded and logged by _failed
            self.stopped_by = e
            with self._changed:
                self._changed.notify_all()
        except BaseException as e:  # SystemExit and the like end the thread: say why first
            self.stopped_by = self.last_error = e
            log.error("follower: stopped by %s", type(e).__name__)
            with self._changed:
                self._changed.notify_all()
            raise


def _last_pause_s(target: Target) -> float | None:
    """How long an engine target stopped generating for its last step (``pauses_s``), None for one that never
    pauses (a state dict)."""
    pauses = getattr(target, "pauses_s", None)
    return float(pauses[-1]) if pauses else None
