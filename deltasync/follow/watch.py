"""Finding a stream's newest committed step for one small request per poll, polls timed by the stream's cadence.

Object stores bill and throttle per request, so what an idle follower costs is its polls. A
:class:`StepWatch` reads one document per poll, ``latest.json``, and nothing else while the stream is
quiet; it lists the manifests only on its first poll, when the hint is missing, damaged or names a step
that is not committed, and every ``audit_s`` (a writer that died between a manifest and the hint leaves
it stale). :meth:`StepWatch.delay` says when to poll next: fast around the moment the next step is due
(the writer records its cadence in ``latest.json``), backing off geometrically to ``idle_max_s`` when
the stream is quiet, with jitter, and wider while the store throttles. docs/FORMAT.md section 5c.

With a :class:`~deltasync.notify.Notifier` (a mirror's event feed, the trainer's RDMA announcements) a
pushed step wakes :meth:`StepWatch.wait` at once and :meth:`StepWatch.newest` checks that step's manifest
instead of reading ``latest.json``; a pushed step that is not committed is ignored (logged). A pushed step is a
hint bounded by what the store confirms: the last few announcements are kept (not the largest: one announcement
of a step far ahead must not hide the real ones after it), each costs at most one manifest read, and while a
notifier's announcements turned out false within ``push_poll_s`` it is not relied on (polls keep their
cadence). While the notifier is connected and truthful, polls slow to ``push_poll_s``: a safety net for a
lost notification.

With trusted keys (the reader's, deltasync/trust.py) a step that is not trusted does not exist here: a hinted,
pushed or listed step whose signature does not prove it is skipped (logged once), and the newest trusted one
is the newest. The signed head ``latest.json`` carries (docs/FORMAT.md section 5e) is checked on every read of
it: a head naming a step the store no longer holds raises ``RollbackError``; with ``max_age_s`` a newest head
older than that (and not closed), or none, raises ``StaleStreamError``.

    watch = StepWatch(reader)
    while True:
        newest = watch.newest()          # usually one GET of latest.json
        ...
        watch.wait(watch.delay())        # or less, when a step is pushed or watch.wake is set

:class:`FollowLoop` is that loop, written once: every follower, the mirror and the vLLM engine's prefetcher drive
it, each with what it does with the newest step; it also says how failures are retried (the error class decides
whether retrying can help: :func:`deltasync.errors.can_retry`).
"""

from __future__ import annotations

import logging
import random
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Generic, Protocol, TypeVar

from deltasync.errors import ConfigError, RollbackError, StaleStreamError, StepNotFoundError, can_retry
from deltasync.format.documents import LatestHint
from deltasync.trust import UNTRUSTED, Head, newest_trusted

if TYPE_CHECKING:
    from deltasync.format.documents import Manifest
    from deltasync.notify import Notifier
    from deltasync.store import Store
    from deltasync.trust import TrustedKeys

log = logging.getLogger(__name__)

MAX_REFUSED = 100_000  # steps a trusted reader remembers as not existing (each refused once, then free)

__all__ = ["FollowLoop", "Polled", "PollPolicy", "StepWatch", "retry_delay_s"]


class Watched(Protocol):
    """What a watch reads through (``deltasync.follow.reader.StreamReader`` is one; the reader builds watches, so the
    watch knows it only by this): the store, the manifests as the reader trusts them, and the steps it refused."""

    store: Store
    trusted: TrustedKeys | None
    refused: dict[int, str]

    @property
    def url(self) -> str: ...

    def manifest(self, step: int, *, nearby: bool = True) -> Manifest: ...

T = TypeVar("T")
T_co = TypeVar("T_co", covariant=True)


def retry_delay_s(failures: int, *, poll_s: float, max_s: float, rng: random.Random | None = None) -> float:
    """Seconds to wait after ``failures`` failed attempts in a row: doubling from ``poll_s``, capped at
    ``max_s``, with jitter (uniform in the upper half) so that many followers of one stream spread out."""
    ceiling = min(max_s, poll_s * 2.0 ** min(max(failures - 1, 0), 64))
    return max(poll_s, min(ceiling, (rng or random).uniform(ceiling / 2, ceiling)))


@dataclass(frozen=True, kw_only=True)
class PollPolicy:
    """How a follower spaces its polls (seconds).

    ``fast_s``: the period around the moment the next step is due (and right after a step arrived, while
    the cadence is unknown). ``idle_max_s``: the longest period, reached by growing ``backoff``-fold per
    poll once no step is due. ``window_s``: fast polling starts this long before the next step is due and
    lasts until it is overdue by ``window_s`` plus a quarter of the interval. ``audit_s``: the longest time
    between listings that catch a stale hint. ``jitter``: each delay is scaled by a uniform factor in
    ``1 ± jitter``, so that followers started together spread out. ``push_poll_s``: the period while a
    notifier is connected (steps are pushed; polls only catch a lost notification). ``retry_max_s``: the longest
    wait after failures in a row (doubling from ``fast_s``: :func:`retry_delay_s`).

    Example: ``Follower(url, target, policy=PollPolicy(fast_s=0.1, idle_max_s=5))``
    """

    fast_s: float = 0.25
    idle_max_s: float = 10.0
    backoff: float = 2.0
    window_s: float = 1.0
    audit_s: float = 600.0
    jitter: float = 0.2
    push_poll_s: float = 60.0
    retry_max_s: float = 30.0

    def __post_init__(self) -> None:
        for name in ("fast_s", "idle_max_s", "window_s", "audit_s", "push_poll_s", "retry_max_s"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and 0 < value < 1e7):
                raise ConfigError(f"PollPolicy: {name} must be a positive number of seconds, not {value!r}")
        if self.idle_max_s < self.fast_s:
            raise ConfigError(f"PollPolicy: idle_max_s ({self.idle_max_s}) must be at least fast_s ({self.fast_s})")
        if not 1.0 <= self.backoff <= 10.0:
            raise ConfigError(f"PollPolicy: backoff must be between 1 and 10, not {self.backoff!r}")
        if not 0.0 <= self.jitter < 1.0:
            raise ConfigError(f"PollPolicy: jitter must be in [0, 1), not {self.jitter!r}")


class StepWatch:
    """The newest committed step of ``reader``'s stream, found for O(1) store requests per poll.

    Args:
        reader: the stream (its manifests are cached there, so checking a hinted step costs nothing extra
            when the follower goes on to read that manifest).
        policy: poll spacing (:class:`PollPolicy`).
        notifier: pushes committed steps (:mod:`deltasync.notify`); None: the store's own feed where it has
            one (``Transport.step_events``: a Hugging Face bucket), which :meth:`close` closes; else polling alone.
        clock, rng: for tests.

    ``newest()`` raises what the store raises (``StoreError`` and subclasses); a damaged or lying hint or
    pushed step is never an error (the manifests decide). Not thread-safe: one watch per polling thread;
    ``wake`` (an event a pushed step sets) may be set from any thread to end a :meth:`wait` early.
    """

    def __init__(self, reader: Watched, policy: PollPolicy | None = None, *, notifier: Notifier | None = None,
                 clock: Callable[[], float] = time.monotonic, rng: random.Random | None = None,
                 wall: Callable[[], float] = time.time) -> None:
        self.reader = reader
        self.policy = policy or PollPolicy()
        self._owns_notifier = notifier is None
        self.notifier = reader.store.transport.step_events() if notifier is None else notifier
        self.wake = threading.Event()  # set by a pushed step (or the owner): ends wait() early
        self._pushed: deque[int] = deque(maxlen=4)  # the last steps pushed, not yet checked (not the largest)
        self._pushed_lock = threading.Lock()
        self._lied_at: float | None = None  # when a pushed step last turned out not committed (or not trusted)
        self._woken_at: float | None = None  # when a pushed step last woke the poller
        self._clock = clock
        self._wall = wall
        self.head: Head | None = None  # with trusted keys: the newest valid signed head seen
        self.last_hint: LatestHint | None = None  # latest.json as last read (a mirror relays its head)
        self._bad_head: bytes | None = None  # a head that did not verify (logged once)
        self._rng = rng or random.Random()
        self._known: int | None = None  # newest step whose manifest was seen
        self._listed_at: float | None = None  # when the manifests were last listed
        self._must_list = True  # the first poll lists
        self._due: float | None = None  # when the next step is expected (clock time)
        self._interval: float | None = None  # the writer's time between steps
        self._period = self.policy.fast_s  # the current back-off period
        self._refused: int | None = None  # a hinted step found not committed
        self.polls = 0  # newest() calls
        self.listings = 0  # of which listed the manifests
        if self.notifier is not None:
            self.notifier.subscribe(self._heard)

    @property
    def known(self) -> int | None:
        """The newest committed step seen so far (None before the first)."""
        return self._known

    def newest(self) -> int | None:
        """The newest committed step (None while the stream has none): one read of ``latest.json``, plus the
        newer step's manifest when the hint moved, plus a listing when the hint cannot be used or an audit
        is due. With trusted keys, the newest trusted step; raises ``RollbackError`` or ``StaleStreamError``
        (module docstring) after it updated what it knows."""
        self.polls += 1
        now = self._clock()
        with self._pushed_lock:
            pushed = sorted(set(self._pushed), reverse=True)
            self._pushed.clear()
        if pushed and not self._must_list:
            known = -1 if self._known is None else self._known
            fresh = [s for s in pushed if s > known]
            hit = None
            for s in fresh:  # newest first, one read each at most: the newest committed one wins
                if self._exists(s, "was announced but"):
                    hit = s
                    break
                self._lied_at = now  # a false announcement: the notifier is not relied on for a while
            if hit is not None:
                self._arrived(hit, now, None)
                if not self._needs_head():
                    return hit
            elif not fresh and self._known is not None and not self._needs_head():
                return self._known  # steps already seen (a feed that (re)connected says its newest): no request
        hint = self.last_hint = self.reader.store.latest_hint()
        self._read_head(hint)
        if hint is not None and hint.step == self._refused:
            hint = None  # it named a step that is not committed: unusable until it changes
        listed: int | None = None
        list_now = self._must_list or (self._listed_at is not None and now - self._listed_at >= self.policy.audit_s)
        if hint is None and self._listed_at is not None and now - self._listed_at >= 3 * self.policy.idle_max_s:
            list_now = True  # no usable hint: list, but not on every poll
        if hint is not None and not list_now and (self._known is None or hint.step > self._known):
            if not self._exists(hint.step, "is named by latest.json but"):  # the follower reads it next anyway
                self._refused, hint, list_now = hint.step, None, True
        if list_now:
            steps = self.reader.store.steps()
            self.listings += 1
            self._listed_at, self._must_list = now, False
            if self.reader.trusted is None:
                listed = steps[-1] if steps else None
            else:  # the newest a trusted key signed: a forged manifest past it does not exist here
                listed = newest_trusted(steps, lambda s: self.reader.manifest(s, nearby=False),
                                        refused=self.reader.refused, where=self.reader.url)
            if hint is not None and listed is not None and hint.step > listed:
                hint = None  # a hint ahead of every manifest is not believed
        newest = max((s for s in (self._known, listed, hint.step if hint else None) if s is not None), default=None)
        if newest is not None and newest != self._known:
            self._arrived(newest, now, hint)
        return self._check_head(newest)

    def _exists(self, step: int, what: str) -> bool:
        """Whether ``step`` is committed (and, with trusted keys, trusted): one manifest read, which the follower
        needs next anyway (the reader keeps it); a step that is not is logged, once per step."""
        if self.reader.trusted is not None and step in self.reader.refused:
            return False
        try:
            self.reader.manifest(step, nearby=False)
        except StepNotFoundError:
            log.info("%s: step %d %s is not committed: ignored", self.reader.url, step, what)
            return False
        except UNTRUSTED as e:
            if self.reader.trusted is None:
                raise
            if len(self.reader.refused) < MAX_REFUSED:
                self.reader.refused[step] = str(e)
            log.warning("%s: step %d %s does not count as committed for this reader: %s: %s", self.reader.url, step,
                        what, type(e).__name__, e)
            return False
        return True

    def _needs_head(self) -> bool:
        """Whether ``latest.json`` must be read even though a pushed step answered: a reader that requires
        freshness whose newest head is half its age limit old."""
        trusted = self.reader.trusted
        if trusted is None or trusted.max_age_s is None:
            return False
        return self.head is None or self._wall() - self.head.signed_unix_s > trusted.max_age_s / 2

    def _read_head(self, hint: LatestHint | None) -> None:
        """Keep the newest valid signed head of ``hint`` (trusted readers only); a bad one is logged once."""
        trusted = self.reader.trusted
        raw = None if hint is None else hint.head_bytes
        if trusted is None or raw is None:
            return
        try:
            head = trusted.check_head(raw, where=self.reader.url)
        except UNTRUSTED as e:
            if raw != self._bad_head:
                self._bad_head = raw
                log.warning("%s: ignoring latest.json's head: %s: %s", self.reader.url, type(e).__name__, e)
            return
        if self.head is None or head.signed_unix_s > self.head.signed_unix_s:
            self.head = head

    def _check_head(self, newest: int | None) -> int | None:
        """``newest``, checked for rollback and freshness against the newest signed head (docs/FORMAT.md section
        5e); the head's step where it names a committed step the listing did not show yet."""
        trusted, head = self.reader.trusted, self.head
        if trusted is None:
            return newest
        if head is not None and (newest is None or head.step > newest):
            if not self._exists(head.step, "is named by a signed head but"):
                when = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(head.signed_unix_s))
                raise RollbackError(
                    f"{self.reader.url}: a head signed at {when} by key {head.key_id} names step {head.step} as the "
                    f"newest, but the store holds no trusted step from {head.step} on (newest: {newest}): steps were "
                    "deleted or replaced after they were committed; keeping the step held")
            newest = head.step
            self._arrived(head.step, self._clock(), None)
        if trusted.max_age_s is None:
            return newest
        if head is None:
            raise StaleStreamError(f"{self.reader.url}: no valid signed head in latest.json, and this reader requires "
                                   f"one no older than {trusted.max_age_s:g} s (max_age_s): the stream's publisher "
                                   "does not sign heads, or somebody removed them")
        if not head.closed and self._wall() - head.signed_unix_s > trusted.max_age_s:
            when = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(head.signed_unix_s))
            raise StaleStreamError(
                f"{self.reader.url}: the newest signed head (step {head.step}, signed {when}) is older than "
                f"max_age_s={trusted.max_age_s:g}: the publisher stopped, or somebody holds the stream's new steps "
                "back; keeping the step held")
        return newest

    def distrust(self) -> None:
        """The step :meth:`newest` named turned out not to be readable: list the manifests at the next poll."""
        self._must_list = True

    def refuse(self, step: int, why: str) -> None:
        """Step ``step`` (which :meth:`newest` named) turned out not to be trusted after all (its chain broke the
        chain of trust): it does not exist for this watch from now on, and the next poll lists the manifests for
        the newest step that does (a trusted reader only; otherwise as :meth:`distrust`)."""
        if self.reader.trusted is not None:
            if len(self.reader.refused) < MAX_REFUSED:
                self.reader.refused[step] = why
            if self._known is not None and self._known >= step:
                self._known = None
        self._must_list = True

    def delay(self) -> float:
        """Seconds until the next poll, by the stream's cadence, with jitter; longer while the store throttles."""
        p = self.policy
        now = self._clock()
        truthful = self._lied_at is None or now - self._lied_at >= p.push_poll_s
        if self.notifier is not None and self.notifier.alive and truthful:
            d = p.push_poll_s  # steps are pushed: a poll only catches a lost notification
        elif self._due is not None and now < self._due - p.window_s:
            d = min(self._due - p.window_s - now, p.idle_max_s)  # sleep until the window opens
        elif self._due is not None and now <= self._due + p.window_s + 0.25 * (self._interval or 0.0):
            d = p.fast_s  # the next step is due: poll fast
        else:
            d, self._period = self._period, min(p.idle_max_s, self._period * p.backoff)
        d = max(d, self.reader.store.throttle_s())
        return max(0.001, d * (1.0 + self._rng.uniform(-p.jitter, p.jitter)))

    def wait(self, seconds: float) -> None:
        """Sleep up to ``seconds``, less when a step is pushed or ``wake`` is set (then cleared)."""
        self.wake.wait(seconds)
        self.wake.clear()

    def close(self) -> None:
        """Close the store's feed this watch opened (a notifier given to it is its owner's to close)."""
        notifier, self.notifier = self.notifier, None
        if notifier is not None and self._owns_notifier:
            notifier.close()

    def retry_delay(self, failures: int) -> float:
        """Seconds to wait after ``failures`` failed polls in a row (:func:`retry_delay_s` from ``fast_s`` up to
        ``retry_max_s``), at least as long as the store asked to be left alone."""
        p = self.policy
        wait = retry_delay_s(failures, poll_s=p.fast_s, max_s=max(p.retry_max_s, p.fast_s), rng=self._rng)
        return max(wait, self.reader.store.throttle_s())

    # --- internals ---

    def _heard(self, step: int) -> None:
        """A notifier's callback (its thread): remember the step among the last few and wake the poller; a notifier
        that lied lately wakes it at most every ``fast_s`` (a flood of false steps costs a read per ``fast_s``,
        not one per announcement)."""
        now = self._clock()
        with self._pushed_lock:
            self._pushed.append(step)
            lying = self._lied_at is not None and now - self._lied_at < self.policy.push_poll_s
            if lying and self._woken_at is not None and now - self._woken_at < self.policy.fast_s:
                return  # kept: the next poll checks it
            self._woken_at = now
        self.wake.set()

    def _arrived(self, step: int, now: float, hint: LatestHint | None) -> None:
        """A newer step was seen: when the next one is due, from the writer's cadence in ``latest.json``.

        Only the writer's own figure is used: the gaps a follower sees include the stream's quiet spells
        (a trainer that paused, a follower that started late), which would put the next step far off. Without
        one (an older writer, its first commits), polls back off from ``fast_s`` after each step."""
        interval = hint.interval_s if hint is not None and hint.step == step and hint.interval_s else None
        # seen up to one poll period after it was committed: the writer's clock says how much (when plausible:
        # clocks of two machines may disagree, so a lag outside [0, interval) is not believed)
        lag = 0.0
        if interval and hint is not None and hint.committed_unix_s is not None:
            lag = time.time() - hint.committed_unix_s
            lag = lag if 0.0 <= lag < interval else 0.0
        self._known, self._period = step, self.policy.fast_s
        self._interval = interval
        self._due = now - lag + interval if interval else None


class Polled(Protocol[T_co]):
    """What a :class:`FollowLoop` polls: a :class:`StepWatch` (the newest committed step), or a source that another
    loop feeds (the vLLM engine's other ranks hear what to stage from the rank that watches the stream)."""

    wake: threading.Event  # set to end a wait early (a pushed step, a stop)

    def newest(self) -> T_co:
        """What is newest now (a step, a plan)."""

    def delay(self) -> float:
        """Seconds until the next poll."""

    def retry_delay(self, failures: int) -> float:
        """Seconds to wait after ``failures`` failed turns in a row."""


class FollowLoop(Generic[T]):
    """The follow loop, written once: find the newest committed step (:meth:`StepWatch.newest`), act on it, and
    wait for the next poll by the stream's cadence (at once when a step is pushed or ``source.wake`` is set).

    Every consumer of a stream drives this one loop body: a follower (in its thread, or in the caller's while it
    waits for a step), the mirror, the vLLM engine's prefetcher (on the rank that watches the stream, and on the
    others over what that rank tells them). What differs is ``act`` and what ends the loop.

    Args:
        source: the stream's :class:`StepWatch` (its policy spaces the polls and the retries), or another
            :class:`Polled` source.
        act: called with the source's newest (for a watch: the newest committed step, None while the stream has
            none), in the loop's thread. It may do nothing (the step is held already), or much (fetch and apply a
            chain of steps).
        on_error: hears every failure, of the poll or of ``act``, before it is retried or raised.
        on_success: called after each turn that did not fail (a consumer that logged a failure says it recovered).
        give_up: whether an error retrying cannot help (:func:`~deltasync.errors.can_retry`: the error class
            decides) ends the loop, raised from :meth:`turn` and :meth:`run`. False: it is retried like any other
            (a prefetcher, whose caller meets the error again where it is reported).
        lock: held around each poll and ``act`` (a follower whose caller may also sync).
        hurry_s: the longest wait while somebody waits for a step (``turn(hurry=True)``); None: no limit.

    A failure is retried after :meth:`StepWatch.retry_delay`, doubling with the failures in a row (``failures``)
    up to the policy's ``retry_max_s``; a turn that succeeds resets the count.

    Example::

        loop = FollowLoop(StepWatch(reader), lambda newest: log.info("newest: %s", newest))
        loop.run(stop)                      # until stop is set; raises what retrying cannot help
    """

    def __init__(self, source: Polled[T], act: Callable[[T], object], *,
                 on_error: Callable[[Exception], None] | None = None, on_success: Callable[[], None] | None = None,
                 give_up: bool = True, lock: threading.Lock | None = None, hurry_s: float | None = None) -> None:
        self.source = source
        self.act = act
        self.hurry_s = hurry_s
        self.on_error = on_error
        self.on_success = on_success
        self.give_up = give_up
        self.lock = lock
        self.failures = 0  # failed turns (or failed calls reported with failed()) since the last success
        self.poll_s = 0.0  # how long the last poll took (a prefetcher reports where the time to a staged step went)

    def turn(self, *, hurry: bool = False) -> float:
        """One pass: poll, act; returns the seconds to wait before the next (at most ``hurry_s`` with ``hurry``:
        somebody waits for a step). Raises an error retrying cannot help (with ``give_up``)."""
        try:
            if self.lock is None:
                self._poll_and_act()
            else:
                with self.lock:
                    self._poll_and_act()
        except Exception as e:
            self.failed(e)
            if self.give_up and not can_retry(e):
                raise
            return self.source.retry_delay(self.failures)
        self.succeeded()
        delay = self.source.delay()
        return min(self.hurry_s, delay) if hurry and self.hurry_s is not None else delay

    def _poll_and_act(self) -> None:
        t0 = time.perf_counter()
        newest = self.source.newest()
        self.poll_s = time.perf_counter() - t0
        self.act(newest)

    def failed(self, error: Exception) -> None:
        """Count a failure and report it (``on_error``): a turn's, or a call the owner made outside the loop."""
        self.failures += 1
        if self.on_error is not None:
            self.on_error(error)

    def succeeded(self) -> None:
        """Reset the failure count and report the success (``on_success``)."""
        self.failures = 0
        if self.on_success is not None:
            self.on_success()

    def run(self, stop: threading.Event, *, until: Callable[[], bool] | None = None,
            hurry: Callable[[], bool] | None = None) -> None:
        """Turn until ``stop`` is set or, after a turn, ``until()`` holds; ``hurry()``: whether somebody waits for
        a step now. Raises the first error retrying cannot help (with ``give_up``)."""
        while not stop.is_set():
            delay = self.turn(hurry=hurry is not None and hurry())
            if until is not None and until():
                return
            self.wait(delay, stop)

    def wait(self, seconds: float, stop: threading.Event | None = None) -> None:
        """Sleep up to ``seconds``: less when a step is pushed or ``source.wake`` is set (then cleared), or (within
        half a second) when ``stop`` is set."""
        wake = self.source.wake
        deadline = time.monotonic() + seconds
        while stop is None or not stop.is_set():
            left = deadline - time.monotonic()
            if left <= 0:
                return
            if wake.wait(left if stop is None else min(left, 0.5)):
                wake.clear()
                return
