"""StepWatch (deltasync/follow/watch.py): the newest committed step for one small read per poll, and polls timed by
the stream's cadence. Requests are counted at the transport; time is a fake clock."""

from __future__ import annotations

import uuid
from collections import Counter

import pytest
import torch

from deltasync import DeltaPublisher, StepWatch, StreamReader
from deltasync.engine import PollPolicy
from deltasync.errors import ConfigError
from deltasync.format.documents import LatestHint, encode
from deltasync.store import LATEST


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def _stream(steps: int) -> str:
    url = f"memory://watch-{uuid.uuid4().hex[:8]}"
    state = {"w": torch.zeros(64)}
    with DeltaPublisher(url, state, on_backlog="block") as pub:
        for s in range(steps):
            state["w"][s] = s + 1.0
            pub.publish(s)
    return url


def _counting(reader: StreamReader) -> Counter:
    """Count the transport's calls by (method, key's last part or 'LIST')."""
    calls: Counter = Counter()
    t = reader.store.transport
    get, lst = t.get, t.list

    def counted_get(key, **kw):
        calls["get", key.rsplit("/", 1)[-1]] += 1
        return get(key, **kw)

    def counted_list(prefix=""):
        calls["list", prefix] += 1
        return lst(prefix)

    t.get, t.list = counted_get, counted_list  # type: ignore[method-assign]
    return calls


def test_a_quiet_stream_costs_one_read_of_the_hint_per_poll():
    reader = StreamReader(_stream(3))
    calls = _counting(reader)
    watch = StepWatch(reader, PollPolicy(jitter=0.0), clock=Clock())
    assert watch.newest() == 2 and watch.listings == 1  # the first poll lists
    calls.clear()
    for _ in range(50):
        assert watch.newest() == 2
    assert calls == Counter({("get", "latest.json"): 50})


def test_a_new_step_is_checked_by_its_manifest_only():
    url = _stream(2)
    reader = StreamReader(url)
    watch = StepWatch(reader, PollPolicy(jitter=0.0), clock=Clock())
    assert watch.newest() == 1
    with DeltaPublisher(url, {"w": torch.ones(64)}, on_backlog="block") as pub:
        pub.publish(5)  # a gap in numbering is fine: the hint names the step
    calls = _counting(reader)
    assert watch.newest() == 5
    assert calls == Counter({("get", "latest.json"): 1, ("get", "manifest.json"): 1})
    calls.clear()
    reader.manifest(5)  # the follower reads it next: cached, no request
    assert not calls


@pytest.mark.parametrize("hint", [b"{not json", b'{"step": -3}', encode(LatestHint(step=40))],
                         ids=["damaged", "out-of-range", "uncommitted-step"])
def test_a_hint_that_cannot_be_used_is_answered_by_the_manifests(hint):
    url = _stream(3)
    reader = StreamReader(url)
    clock = Clock()
    watch = StepWatch(reader, PollPolicy(jitter=0.0, idle_max_s=2.0), clock=clock)
    assert watch.newest() == 2
    reader.store.write_bytes(LATEST, hint)
    clock.t += 10
    assert watch.newest() == 2  # never a step that is not committed
    listings = watch.listings
    assert listings == 2 if hint == encode(LatestHint(step=40)) else listings >= 1
    for _ in range(10):  # a hint that stays unusable is not answered by a listing on every poll
        watch.newest()
    assert watch.listings <= listings + 1


def test_a_stale_hint_is_caught_by_the_audit():
    """A writer that died between a manifest and the hint leaves latest.json behind: the audit listing finds
    the step within ``audit_s``, and between audits nothing more than the hint is read."""
    url = _stream(3)
    reader = StreamReader(url)
    clock = Clock()
    watch = StepWatch(reader, PollPolicy(jitter=0.0, audit_s=60.0), clock=clock)
    assert watch.newest() == 2
    with DeltaPublisher(url, {"w": torch.ones(64)}, on_backlog="block") as pub:
        pub.publish(3)
    reader.store.write_bytes(LATEST, encode(LatestHint(step=2)))  # as if the hint had not been written
    clock.t += 30
    assert watch.newest() == 2  # not yet: the hint says 2
    clock.t += 31
    assert watch.newest() == 3 and watch.listings == 2


def test_distrust_lists_at_the_next_poll():
    reader = StreamReader(_stream(2))
    watch = StepWatch(reader, clock=Clock())
    watch.newest()
    watch.distrust()
    watch.newest()
    assert watch.listings == 2


def test_polls_follow_the_streams_cadence():
    """After a step, the next is due ``interval_s`` later (the writer's average, from latest.json): the watch
    sleeps until ``window_s`` before it, polls every ``fast_s`` until it is overdue, then backs off to
    ``idle_max_s``."""
    url = _stream(1)
    reader = StreamReader(url)
    clock = Clock()
    p = PollPolicy(fast_s=0.25, idle_max_s=8.0, window_s=1.0, backoff=2.0, jitter=0.0)
    watch = StepWatch(reader, p, clock=clock)
    watch.newest()
    reader.store.write_bytes(LATEST, encode(LatestHint(step=1, interval_s=30.0)))  # step 1 committed, 30 s cadence
    with DeltaPublisher(url, {"w": torch.ones(64)}, on_backlog="block") as pub:
        pub.publish(1)
    reader.store.write_bytes(LATEST, encode(LatestHint(step=1, interval_s=30.0)))
    assert watch.newest() == 1
    assert watch.delay() == 8.0  # the next is due in 30 s: long sleeps, capped
    clock.t += 21.0
    assert watch.delay() == pytest.approx(8.0)
    clock.t += 8.0  # 29 s after: inside the window
    assert watch.delay() == 0.25
    clock.t += 10.0  # 39 s: overdue by more than window + interval/4 (8.5 s): back off
    assert [watch.delay() for _ in range(5)] == [0.25, 0.5, 1.0, 2.0, 4.0]
    assert watch.delay() == 8.0 and watch.delay() == 8.0


def test_an_unknown_cadence_backs_off_and_jitter_spreads_followers():
    reader = StreamReader(_stream(1))
    watch = StepWatch(reader, PollPolicy(fast_s=0.5, idle_max_s=4.0, backoff=2.0, jitter=0.0), clock=Clock())
    watch.newest()
    reader.store.write_bytes(LATEST, encode(LatestHint(step=0)))  # an older writer: no interval
    assert [watch.delay() for _ in range(6)] == [0.5, 1.0, 2.0, 4.0, 4.0, 4.0]
    jittered = StepWatch(reader, PollPolicy(fast_s=1.0, idle_max_s=1.0, jitter=0.2))
    delays = [jittered.delay() for _ in range(200)]
    assert min(delays) >= 0.8 and max(delays) <= 1.2 and max(delays) - min(delays) > 0.2


def test_the_writer_records_its_cadence():
    url = f"memory://watch-{uuid.uuid4().hex[:8]}"
    with DeltaPublisher(url, {"w": torch.zeros(8)}, on_backlog="block") as pub:
        pub.publish(0)
        pub.flush()
        assert pub.store.latest_hint().interval_s is None  # one commit: no cadence yet
        pub.publish(1)
        pub.flush()
        hint = pub.store.latest_hint()
    assert hint.step == 1 and hint.interval_s is not None and hint.interval_s >= 0 and hint.committed_unix_s > 0


@pytest.mark.parametrize("bad", [dict(fast_s=0), dict(idle_max_s=-1), dict(fast_s=2.0, idle_max_s=1.0),
                                 dict(backoff=0.5), dict(jitter=1.0), dict(audit_s=float("inf"))])
def test_a_policy_that_makes_no_sense_is_refused(bad):
    with pytest.raises(ConfigError, match="PollPolicy"):
        PollPolicy(**bad)


def test_the_follow_loop_retries_what_can_be_retried_and_raises_the_rest():
    """deltasync.follow.watch.FollowLoop, the one loop body: each turn polls the watch once and hands the newest step to
    ``act``; a failure is counted, reported and retried (the error class decides: ``retryable``), a success resets
    the count, and ``until`` ends the loop after a turn."""
    import threading

    from deltasync.errors import StoreError
    from deltasync.follow.watch import FollowLoop

    reader = StreamReader(_stream(3))
    watch = StepWatch(reader, PollPolicy(fast_s=0.01, idle_max_s=0.02, retry_max_s=0.02, jitter=0.0))
    seen: list[int | None] = []
    heard: list[Exception] = []
    script = [StoreError("the store blinked"), StoreError("again"), None, ConfigError("a wrong setting")]

    def act(newest: int | None) -> None:
        seen.append(newest)
        error = script.pop(0) if script else None
        if error is not None:
            raise error

    loop = FollowLoop(watch, act, on_error=heard.append)
    with pytest.raises(ConfigError, match="a wrong setting"):
        loop.run(threading.Event())
    assert seen == [2, 2, 2, 2] and watch.polls == 4  # one poll per turn
    assert [str(e) for e in heard] == ["the store blinked", "again", "a wrong setting"] and loop.failures == 1

    script[:] = [ConfigError("a wrong setting")]  # retried when giving up is not the loop's to decide
    turns: list[int] = []
    patient = FollowLoop(watch, act, give_up=False, on_success=lambda: turns.append(len(seen)))
    patient.run(threading.Event(), until=lambda: len(seen) >= 7)
    assert len(seen) == 7 and turns == [6, 7] and patient.failures == 0
    watch.close()
    reader.close()
