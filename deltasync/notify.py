"""Push: hearing of a new step as it is committed instead of polling for it.

A follower that polls pays a request per poll and notices a step up to a poll period late. Where something
can tell it "step N is committed" (a mirror that just committed N in this region, the trainer's RDMA
announcements, a Hugging Face bucket's event feed), a :class:`Notifier` hands the step to the follower's
:class:`~deltasync.watch.StepWatch`, which wakes at once and checks that step's manifest (one GET): a pushed
step is a hint, never believed without its commit, so a bogus one costs a log line. Polling goes on at
``PollPolicy.push_poll_s`` as a safety net while the notifier is connected, and at the normal cadence when
it is not.

This module holds the protocol and the HTTP pair a mirror uses (docs/FORMAT.md section 5d):
:class:`EventServer` serves ``GET /events`` as server-sent events (``event: step`` / ``data: {"step": N}``,
the newest step first, then each new one, a comment every 15 s to keep proxies from closing the stream), and
:class:`EventFeed` follows such a URL, reconnecting with backoff.

    server = EventServer("0.0.0.0", 8901)            # beside `deltasync mirror SRC DST --events 0.0.0.0:8901`
    server.announce(12)
    follower = Follower(url, target, notifier=EventFeed("http://mirror:8901/events"))
"""

from __future__ import annotations

import http.client
import json
import logging
import random
import socket
import threading
import time
import urllib.parse
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Protocol

from deltasync.errors import ConfigError
from deltasync.format.documents import MAX_STEP

log = logging.getLogger(__name__)

__all__ = ["EventFeed", "EventServer", "Notifier", "host_port"]

MAX_LINE_BYTES = 4096  # an event line longer than this is not ours: the feed is dropped and reconnected
KEEPALIVE_S = 15.0


def host_port(value: object, *, what: str = "--events") -> tuple[str, int]:
    """``HOST:PORT`` (port 0: any free port; an IPv6 host in brackets) as (host, port), or a ``ConfigError``
    naming ``what`` and the value."""
    host, sep, port = value.rpartition(":") if isinstance(value, str) else ("", "", "")
    if not (sep and host and port.isdigit() and port.isascii() and int(port) <= 65535):
        raise ConfigError(f"{what}: expected HOST:PORT (e.g. 0.0.0.0:8901), got {value!r}")
    return host.strip("[]"), int(port)


class Notifier(Protocol):
    """Something that hears of committed steps: calls each subscriber with a step number (a hint)."""

    @property
    def alive(self) -> bool:
        """Whether it is connected now (while it is, polling slows to a safety net)."""

    def subscribe(self, callback: Callable[[int], None]) -> None:
        """Call ``callback(step)`` (from the notifier's thread) for each step it hears of."""

    def close(self) -> None: ...


class Announcements:
    """The subscriber list every notifier keeps (a base class)."""

    def __init__(self) -> None:
        self._callbacks: list[Callable[[int], None]] = []
        self._lock = threading.Lock()
        self.newest: int | None = None

    def subscribe(self, callback: Callable[[int], None]) -> None:
        with self._lock:
            self._callbacks.append(callback)
            newest = self.newest
        if newest is not None:
            callback(newest)

    def _announce(self, step: int) -> None:
        with self._lock:
            if self.newest is not None and step <= self.newest:
                return
            self.newest = step
            callbacks = list(self._callbacks)
        for cb in callbacks:
            try:
                cb(step)
            except Exception as e:  # noqa: BLE001 - one subscriber's bug must not silence the others
                log.warning("notifier: a subscriber failed on step %d: %s", step, e)


def _step_from(data: str) -> int | None:
    """The step of one event's data (``{"step": N}``), None for anything else."""
    try:
        doc = json.loads(data)
    except ValueError:
        return None
    step = doc.get("step") if isinstance(doc, dict) else None
    if isinstance(step, int) and not isinstance(step, bool) and 0 <= step <= MAX_STEP:
        return step
    return None


class EventFeed(Announcements):
    """Follow an :class:`EventServer`'s ``/events`` (a mirror's) in a daemon thread.

    Args:
        url: ``http://host:port/events`` (or ``https://``).
        timeout_s: a connection silent this long (no event, no keep-alive) is dropped and reopened.
        max_backoff_s: the longest wait between reconnection attempts (jittered, doubling from 0.5 s).

    Raises:
        ConfigError: ``url`` is not an http(s) URL.

    Every line is bounded (:data:`MAX_LINE_BYTES`); anything but a well-formed step is ignored. Redirects are
    not followed.
    """

    def __init__(self, url: str, *, timeout_s: float = 3 * KEEPALIVE_S, max_backoff_s: float = 30.0) -> None:
        super().__init__()
        parts = urllib.parse.urlsplit(url) if isinstance(url, str) else None
        if parts is None or parts.scheme not in ("http", "https") or not parts.hostname:
            raise ConfigError(f"EventFeed: expected an http(s) URL of a mirror's /events, got {url!r}")
        self.url = url
        self._parts = parts
        self.timeout_s = timeout_s
        self.max_backoff_s = max_backoff_s
        self._alive = False
        self._stop = threading.Event()
        self._sock: socket.socket | None = None  # the open connection's socket: close() shuts it to wake the reader
        self._thread = threading.Thread(target=self._run, name="deltasync-event-feed", daemon=True)
        self._thread.start()

    @property
    def alive(self) -> bool:
        return self._alive

    def close(self) -> None:
        self._stop.set()
        sock = self._sock
        if sock is not None:
            try:
                sock.shutdown(socket.SHUT_RDWR)  # wakes the reading thread
            except OSError:
                pass
        self._thread.join(timeout=5)

    def _run(self) -> None:
        failures = 0
        while not self._stop.is_set():
            try:
                self._follow_once()
                failures = 0
            except Exception as e:  # noqa: BLE001 - a feed that fails is reopened; polling covers meanwhile
                failures += 1
                if failures == 1:
                    log.info("event feed %s: %s (reconnecting; polling meanwhile)", self.url, e)
            finally:
                self._alive = False
            ceiling = min(self.max_backoff_s, 0.5 * 2 ** min(failures, 16))
            self._stop.wait(random.uniform(ceiling / 2, ceiling))

    def _follow_once(self) -> None:
        p = self._parts
        conn_class = http.client.HTTPSConnection if p.scheme == "https" else http.client.HTTPConnection
        assert p.hostname is not None  # checked in __init__
        conn = conn_class(p.hostname, p.port, timeout=self.timeout_s)
        try:
            conn.connect()
            self._sock = conn.sock
            if self._stop.is_set():
                return
            path = (p.path or "/") + (f"?{p.query}" if p.query else "")
            conn.request("GET", path, headers={"Accept": "text/event-stream"})
            reply = conn.getresponse()
            if reply.status != 200 or not reply.getheader("Content-Type", "").startswith("text/event-stream"):
                raise ConnectionError(f"expected 200 text/event-stream, got {reply.status} "
                                      f"{reply.getheader('Content-Type', '')!r}")
            self._alive = True
            event = "message"
            data: list[str] = []
            while not self._stop.is_set():
                line = reply.readline(MAX_LINE_BYTES + 1)
                if not line:
                    raise ConnectionError("the server closed the stream")
                if len(line) > MAX_LINE_BYTES:
                    raise ConnectionError(f"an event line over {MAX_LINE_BYTES} bytes")
                text = line.decode("utf-8", "replace").rstrip("\r\n")
                if not text:  # end of one event
                    step = _step_from("\n".join(data)) if event == "step" else None
                    if step is not None:
                        self._announce(step)
                    event, data = "message", []
                elif text.startswith(":"):
                    continue  # keep-alive
                else:
                    field, _, value = text.partition(":")
                    value = value[1:] if value.startswith(" ") else value
                    if field == "event":
                        event = value
                    elif field == "data" and len(data) < 16:
                        data.append(value)
        finally:
            self._sock = None
            conn.close()


class EventServer:
    """Serve ``GET /events`` (server-sent events) announcing committed steps: what a mirror runs for its region.

    Args:
        host, port: where to listen (port 0: any free port; ``url`` says which).
        max_clients: connections beyond this are answered 503 (each holds a thread).

    Example::

        with EventServer("127.0.0.1", 0) as server:
            server.announce(3)   # every connected follower hears "step 3" now
    """

    def __init__(self, host: str = "127.0.0.1", port: int = 0, *, max_clients: int = 512) -> None:
        self.max_clients = max_clients
        self.newest: int | None = None
        self._changed = threading.Condition()
        self._clients = 0
        self._closed = False
        server = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: object) -> None:  # no line per request on stderr
                pass

            def do_GET(self) -> None:  # noqa: N802 - http.server's name
                if self.path.split("?", 1)[0] != "/events":
                    self.send_error(404, "only /events is served here")
                    return
                if not server._join():
                    self.send_error(503, "too many followers on this event server")
                    return
                try:
                    self.send_response(200)
                    self.send_header("Content-Type", "text/event-stream")
                    self.send_header("Cache-Control", "no-store")
                    self.end_headers()
                    server._stream(self.wfile)
                except OSError:
                    pass  # the follower went away
                finally:
                    server._leave()

        self._http = ThreadingHTTPServer((host, port), Handler)
        self._http.daemon_threads = True
        self._thread = threading.Thread(target=self._http.serve_forever, name="deltasync-event-server", daemon=True)
        self._thread.start()

    @property
    def url(self) -> str:
        host, port = self._http.server_address[:2]
        assert isinstance(host, str)  # an AF_INET server's address (bytes only for AF_UNIX)
        return f"http://{host}:{port}/events"

    def announce(self, step: int) -> None:
        """Tell every connected follower that ``step`` is committed (older or equal steps are not repeated)."""
        with self._changed:
            if self.newest is None or step > self.newest:
                self.newest = step
                self._changed.notify_all()

    def close(self) -> None:
        with self._changed:
            self._closed = True
            self._changed.notify_all()
        self._http.shutdown()
        self._http.server_close()
        self._thread.join(timeout=5)

    def __enter__(self) -> EventServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _join(self) -> bool:
        with self._changed:
            if self._clients >= self.max_clients or self._closed:
                return False
            self._clients += 1
            return True

    def _leave(self) -> None:
        with self._changed:
            self._clients -= 1

    def _stream(self, out) -> None:  # noqa: ANN001 - the handler's wfile
        sent: int | None = None
        last_write = time.monotonic()
        while True:
            with self._changed:
                if not self._closed and self.newest == sent:
                    self._changed.wait(max(0.0, KEEPALIVE_S - (time.monotonic() - last_write)))
                if self._closed:
                    return
                newest = self.newest
            if newest is not None and newest != sent:
                out.write(f"event: step\ndata: {json.dumps({'step': newest})}\n\n".encode())
                sent = newest
            elif time.monotonic() - last_write >= KEEPALIVE_S:
                out.write(b": keep-alive\n\n")
            else:
                continue
            out.flush()
            last_write = time.monotonic()
