"""Push (deltasync/notify.py): a mirror serves its new steps as server-sent events and followers hear of each
step at once instead of polling; a pushed step is a hint, checked against the store's commit; a hostile
event server costs nothing but a reconnect."""

from __future__ import annotations

import logging
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler

import pytest
import torch

from deltasync import DeltaPublisher, StreamReader
from deltasync.errors import ConfigError
from deltasync.follow.watch import PollPolicy, StepWatch
from deltasync.history.mirror import mirror_follow
from deltasync.notify import EventFeed, EventServer
from deltasync.store import Store
from rollout_loader import Follower, StateDictTarget
from tests.conftest import states_equal
from tests.http_server import serving


def _state(step: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return {"w": torch.randn(20_000, generator=g).bfloat16(), "b": torch.randn(16, generator=g).bfloat16()}


def _heard(feed: EventFeed) -> list[int]:
    got: list[int] = []
    feed.subscribe(got.append)
    return got


def _started_counting_hints(follower: Follower) -> list[int]:
    """Wait for ``follower`` to hold step 0 (its first poll), then start its thread; returns a list that grows by
    one at each ``latest.json`` read from then on (a follower on push should read it once at most)."""
    follower.wait_for(0, timeout_s=60)
    hints: list[int] = []
    original = follower.reader.store.latest_hint
    follower.reader.store.latest_hint = lambda: hints.append(1) or original()  # type: ignore[method-assign]
    follower.start()
    return hints


def _until(condition, timeout_s: float = 30.0) -> None:
    """Wait for ``condition()`` (a hang guard, not a timing check)."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def test_followers_hear_each_announced_step_and_newcomers_the_newest():
    with EventServer() as server:
        early = EventFeed(server.url)
        try:
            got = _heard(early)
            _until(lambda: early.alive)
            for step in (3, 4, 4, 2, 7):  # repeats and older steps are not announced again
                server.announce(step)
            _until(lambda: got and got[-1] == 7)
            assert got == [3, 4, 7] or got == [4, 7] or got == [3, 7] or got == [7]  # coalesced, never backwards
            late = EventFeed(server.url)
            try:
                later = _heard(late)
                _until(lambda: later == [7])  # the newest step, at once
            finally:
                late.close()
        finally:
            early.close()
        assert not early.alive


class Hostile(BaseHTTPRequestHandler):
    """An event server that lies: malformed, oversized, out-of-range and wrongly typed events, then one good one."""

    protocol_version = "HTTP/1.1"
    sent = 0

    def log_message(self, *args: object) -> None:
        pass

    def do_GET(self) -> None:  # noqa: N802
        Hostile.sent += 1
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        if Hostile.sent == 1:  # first connection: an endless line, which must not be read whole
            self.wfile.write(b"data: " + b"9" * 100_000 + b"\n\n")
            self.wfile.flush()
            return
        for bad in (b'event: step\ndata: {"step": -1}\n\n', b'event: step\ndata: {"step": true}\n\n',
                    b'event: step\ndata: {"step": 1e3}\n\n', b'event: step\ndata: [5]\n\n',
                    b'event: step\ndata: {"step": 10000000000000}\n\n', b'event: other\ndata: {"step": 8}\n\n',
                    b"event: step\ndata: not json\n\n", b'data: {"step": 9}\n\n'):
            self.wfile.write(bad)
        self.wfile.write(b': comment\n\nevent: step\ndata: {"step": 5}\n\n')
        self.wfile.flush()
        time.sleep(0.5)


def test_a_hostile_event_server_costs_a_reconnect_and_nothing_else():
    Hostile.sent = 0
    with serving(Hostile) as base:
        feed = EventFeed(f"{base}/events", max_backoff_s=0.2)
        try:
            got = _heard(feed)
            _until(lambda: got == [5])
        finally:
            feed.close()
    assert Hostile.sent >= 2


@pytest.mark.parametrize("url", ["ftp://x/events", "mirror:8901", "", "http:///events"])
def test_a_feed_url_must_be_http(url):
    with pytest.raises(ConfigError, match="expected an http\\(s\\) URL"):
        EventFeed(url)


def test_the_event_server_bounds_its_followers_and_serves_only_events():
    import urllib.error
    import urllib.request

    with EventServer(max_clients=1) as server:
        feed = EventFeed(server.url)
        try:
            _until(lambda: feed.alive)
            with pytest.raises(urllib.error.HTTPError, match="503"):
                urllib.request.urlopen(server.url, timeout=10)
            with pytest.raises(urllib.error.HTTPError, match="404"):
                urllib.request.urlopen(server.url.replace("/events", "/other"), timeout=10)
        finally:
            feed.close()


def test_a_pushed_step_is_checked_against_the_commit(tmp_path, caplog):
    """The watch reads no latest.json for a pushed step, only its manifest; an uncommitted one is ignored."""
    url = str(tmp_path / "s")
    with DeltaPublisher(url, _state(0), on_backlog="block") as pub:
        pub.publish(0)
        pub.source = _state(1)
        pub.publish(1)
    with EventServer() as server, StreamReader(url) as reader:
        feed = EventFeed(server.url)
        try:
            watch = StepWatch(reader, PollPolicy(fast_s=1.0, idle_max_s=2.0, push_poll_s=600.0), notifier=feed)
            assert watch.newest() == 1  # the first poll lists
            hints = []
            original = reader.store.latest_hint
            reader.store.latest_hint = lambda: hints.append(1) or original()  # type: ignore[method-assign]
            _until(lambda: feed.alive)
            server.announce(1)
            watch.wait(30)
            assert watch.newest() == 1 and hints == []  # a step already known: not a single request
            assert watch.delay() > 100  # connected: polls are a safety net
            with caplog.at_level(logging.INFO, logger="deltasync.follow.watch"):
                server.announce(40)  # never committed
                watch.wait(30)
                assert watch.newest() == 1
            assert "step 40 was announced but is not committed: ignored" in caplog.text
            assert watch.delay() < 100  # a feed that lied is not relied on: the usual cadence, for push_poll_s
        finally:
            feed.close()
        assert watch.delay() < 100  # the feed is gone: the usual cadence again


def test_a_region_follows_a_mirror_by_its_events_bit_exactly(tmp_path):
    """Trainer → source store → mirror (serving events) → a follower that would poll once in ten minutes: it
    applies every step as the mirror commits it, reading latest.json once at most (its thread's first poll)."""
    src, dst = str(tmp_path / "src"), str(tmp_path / "dst")
    truth = {}
    pub = DeltaPublisher(src, _state(0), anchor_every=3, on_backlog="block")
    pub.publish(0)
    truth[0] = _state(0)
    stop = threading.Event()
    with EventServer() as server:
        mirror = threading.Thread(target=mirror_follow, args=(src, dst), daemon=True,
                                  kwargs={"events": server, "stop": stop,
                                          "policy": PollPolicy(fast_s=0.05, idle_max_s=0.05)})
        mirror.start()
        feed = EventFeed(server.url)
        target = StateDictTarget(verify="all")
        follower = Follower(dst, target, policy=PollPolicy(fast_s=600.0, idle_max_s=600.0), notifier=feed)
        try:
            hints = _started_counting_hints(follower)  # its first poll: the mirror may not have copied step 0 yet
            for step in range(1, 7):
                pub.source = truth[step] = _state(step)
                pub.publish(step)
                pub.flush()
                _until(lambda: follower.step == step, timeout_s=60)  # noqa: B023 - _until() calls it at once; no wait_for: it would poke a poll
                assert states_equal(target.state_dict(), truth[follower.step])
            assert len(hints) <= 1  # the thread's first poll at most: every step came by push
            assert follower.last_error is None
        finally:
            follower.close()
            feed.close()
            stop.set()
            mirror.join(30)
            pub.close()
    assert Store(dst).steps() == list(range(7))


@pytest.mark.parametrize("args, needle", [
    (["mirror", "SRC", "DST", "--events", "8901"], "--events: expected HOST:PORT (e.g. 0.0.0.0:8901), got '8901'"),
    (["mirror", "SRC", "DST", "--events", "host:99999"], "got 'host:99999'"),
    (["mirror", "SRC", "DST", "--notify", "mirror:8901"],
     "expected an http(s) URL of a mirror's /events, got 'mirror:8901'"),
    (["follow", "SRC", "--server", "http://127.0.0.1:9", "--notify", "ftp://m/events"], "got 'ftp://m/events'"),
])
def test_event_options_of_the_cli_are_checked_before_anything_runs(tmp_path, monkeypatch, capsys, args, needle):
    from tests.test_cli_errors import assert_one_line_error, run_main

    src, dst = str(tmp_path / "src"), tmp_path / "dst"
    with DeltaPublisher(src, _state(0), on_backlog="block") as pub:
        pub.publish(0)
    args = [src if a == "SRC" else str(dst) if a == "DST" else a for a in args]
    code, _, err = run_main(monkeypatch, capsys, *args)
    assert_one_line_error(code, err, "ConfigError", needle)
    assert not dst.exists()


def test_a_store_that_pushes_its_changes_is_followed_by_its_feed_and_the_feed_closed(tmp_path):
    """A transport with ``step_events`` (as a Hugging Face bucket has) gives every watch its own feed, without
    the follower asking; closing the follower closes that feed."""
    from deltasync.transports import register_transport, unregister_transport
    from deltasync.transports.local import LocalTransport, open_local

    feeds: list[EventFeed] = []
    with EventServer() as server:

        class Pushing(LocalTransport):
            def step_events(self) -> EventFeed:
                feeds.append(EventFeed(server.url))
                return feeds[-1]

        def open_pushing(url: str, options: dict) -> Pushing:
            local = open_local(url.removeprefix("pushing://"), options)
            return Pushing(local.root)

        register_transport("pushing", open_pushing)
        try:
            url = str(tmp_path / "s")
            with DeltaPublisher(url, _state(0), on_backlog="block") as pub:
                pub.publish(0)
                pub.flush()
                target = StateDictTarget()
                slow = PollPolicy(fast_s=600.0, idle_max_s=600.0)
                with Follower(f"pushing://{url}", target, policy=slow) as follower:
                    follower.wait_for(0, timeout_s=60)
                    assert len(feeds) == 1 and follower.watch.notifier is feeds[0]
                    _until(lambda: feeds[0].alive)
                    pub.source = _state(1)
                    pub.publish(1)
                    pub.flush()
                    server.announce(1)
                    _until(lambda: follower.step == 1, timeout_s=60)
                    assert states_equal(target.state_dict(), _state(1))
                assert not feeds[0].alive and not feeds[0]._thread.is_alive()
        finally:
            unregister_transport("pushing")


def test_a_publisher_serves_its_own_events_and_a_follower_applies_each_step_as_it_commits(tmp_path):
    """``events=HOST:PORT``: the publisher announces every commit; a follower that would poll once in ten minutes
    applies each step at once, bit-exactly, and a newcomer hears the newest step. The feed stops with close()."""
    url = str(tmp_path / "s")
    truth = {0: _state(0)}
    pub = DeltaPublisher(url, truth[0], anchor_every=3, on_backlog="block", events="127.0.0.1:0")
    assert pub.events_url is not None and pub.events_url.startswith("http://127.0.0.1:")
    pub.publish(0)
    pub.flush()
    feed = EventFeed(pub.events_url)
    target = StateDictTarget(verify="all")
    follower = Follower(url, target, policy=PollPolicy(fast_s=600.0, idle_max_s=600.0), notifier=feed)
    try:
        hints = _started_counting_hints(follower)
        for step in range(1, 5):
            pub.source = truth[step] = _state(step)
            pub.publish(step)
            _until(lambda: follower.step == step, timeout_s=60)  # noqa: B023 - _until() calls it at once
            assert states_equal(target.state_dict(), truth[step])
        assert len(hints) <= 1  # the thread's first poll at most: every step came by push
        late = EventFeed(pub.events_url)
        try:
            heard = _heard(late)
            _until(lambda: heard)
            assert heard == [4]  # a newcomer hears the newest committed step
        finally:
            late.close()
    finally:
        follower.close()
        feed.close()
        pub.close()
    with pytest.raises(OSError):  # closed with the publisher
        socket.create_connection(("127.0.0.1", int(pub.events_url.rsplit(":", 1)[1].split("/")[0])), timeout=5)


def test_a_publisher_that_cannot_listen_says_so_and_leaves_the_stream_untouched(tmp_path):
    with EventServer() as taken:
        port = taken.url.rsplit(":", 1)[1].split("/")[0]
        with pytest.raises(ConfigError, match=f"publish option events: cannot listen on '127.0.0.1:{port}'"):
            DeltaPublisher(str(tmp_path / "s"), _state(0), events=f"127.0.0.1:{port}")
    assert not (tmp_path / "s").exists()
    with DeltaPublisher(str(tmp_path / "s"), _state(0)) as pub:  # no lease was left behind either
        pub.publish(0)


class Scripted(BaseHTTPRequestHandler):
    """An event feed that sends whatever steps the test appends to ``events``, in that order (a mirror that lies
    once, then tells the truth)."""

    protocol_version = "HTTP/1.1"
    events: list[int] = []

    def log_message(self, *args: object) -> None:
        pass

    def do_GET(self) -> None:  # noqa: N802
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        sent = 0
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            while sent < len(Scripted.events):
                self.wfile.write(f'event: step\ndata: {{"step": {Scripted.events[sent]}}}\n\n'.encode())
                self.wfile.flush()
                sent += 1
            time.sleep(0.01)


def test_one_announcement_far_ahead_does_not_silence_the_feed(tmp_path):
    """Issue 30 item 8: a feed announces step 999999999999 (a hostile mirror, a spoofed event); every real step
    after it is still heard and found at once, and the false one cost one manifest read."""
    url = str(tmp_path / "s")
    with DeltaPublisher(url, _state(0), on_backlog="block") as pub:
        pub.publish(0)
    lie = 10**12 - 1
    with serving(Scripted) as base, StreamReader(url) as reader:
        Scripted.events.clear()
        feed = EventFeed(f"{base}/events")
        try:
            heard = _heard(feed)
            watch = StepWatch(reader, PollPolicy(fast_s=1.0, idle_max_s=2.0, push_poll_s=600.0), notifier=feed)
            assert watch.newest() == 0  # the first poll lists
            _until(lambda: feed.alive)
            reads: list[int] = []
            original = reader.store.manifest_record
            reader.store.manifest_record = (  # type: ignore[method-assign]
                lambda step, **kw: reads.append(step) or original(step, **kw))
            Scripted.events.append(lie)
            _until(lambda: lie in heard)
            assert watch.newest() == 0 and reads == [lie]  # one read: not committed, ignored
            with DeltaPublisher(url, _state(1), on_backlog="block") as pub:
                for s in (1, 2):
                    pub.source = _state(s)
                    pub.publish(s)
                    pub.flush()
                    Scripted.events.append(s)  # smaller than the lie: heard all the same
                    _until(lambda s=s: s in heard)  # type: ignore[misc]
                    assert watch.newest() == s
            assert reads.count(lie) == 1
        finally:
            feed.close()


def test_slow_clients_hold_no_thread_for_ever(tmp_path):
    """Issue 30 item 9: connections that never finish their request are dropped at the header deadline and,
    beyond the server's connection bound, refused at once; a real follower is served meanwhile and after."""
    before = threading.active_count()
    with EventServer(max_clients=2, header_timeout_s=0.3) as server:
        host, port = server._http.server_address[:2]
        slow = [socket.create_connection((host, port), timeout=10) for _ in range(60)]
        try:
            for s in slow[:3]:
                s.sendall(b"GET /ev")  # a request line that never ends
            assert threading.active_count() - before <= 2 * 2 + 8 + 1  # the bound, plus the server's own thread
            for s in slow:  # each is answered 503 or closed at the deadline: none is held
                data = s.recv(4096)
                assert data == b"" or data.startswith(b"HTTP/1.1 503"), data[:80]
            feed = EventFeed(server.url)
            try:
                got = _heard(feed)
                server.announce(7)
                _until(lambda: got and got[-1] == 7)
            finally:
                feed.close()
        finally:
            for s in slow:
                s.close()
    _until(lambda: threading.active_count() <= before + 1)


def test_a_flood_of_false_announcements_costs_a_read_per_poll_period(tmp_path):
    """A feed that lied is not relied on: thousands of false steps wake the poller at most once per fast_s, so
    the store sees a bounded number of reads, not one per announcement."""
    url = str(tmp_path / "s")
    with DeltaPublisher(url, _state(0), on_backlog="block") as pub:
        pub.publish(0)
    now = [100.0]
    with StreamReader(url) as reader:
        watch = StepWatch(reader, PollPolicy(fast_s=1.0, idle_max_s=2.0, push_poll_s=60.0), clock=lambda: now[0])
        assert watch.newest() == 0
        watch._heard(10**12 - 1)
        assert watch.newest() == 0  # the lie: checked once
        watch.wake.clear()
        wakes = 0
        for fake in range(1000, 3000):  # within one fast_s of the clock
            watch._heard(fake)
            wakes += watch.wake.is_set()
            watch.wake.clear()
        assert wakes <= 1
        now[0] += 1.5
        watch._heard(5000)
        assert watch.wake.is_set()  # the next period: heard again
