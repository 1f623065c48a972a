"""Push: hearing of a new step as it is committed instead of polling for it.

A follower that polls pays a request per poll and notices a step up to a poll period late. Where something
can tell it "step N is committed" (a mirror that just committed N in this region, the trainer's RDMA
announcements, a Hugging Face bucket's event feed), a :class:`Notifier` hands the step to the follower's
:class:`~deltasync.follow.watch.StepWatch`, which wakes at once and checks that step's manifest (one GET): a pushed
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
import io
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
from deltasync.secrets import redact_url

log = logging.getLogger(__name__)

__all__ = ["EventFeed", "EventServer", "Notifier", "host_port"]

MAX_LINE_BYTES = 4096  # an event line longer than this is not ours: the feed is dropped and reconnected
KEEPALIVE_S = 15.0
HEADER_TIMEOUT_S = 10.0  # a client must send its whole request (line and headers) within this, or is dropped
MAX_HEAD_BYTES = 8192  # a request's line and headers together: a GET of /events needs a few hundred
WRITE_TIMEOUT_S = 60.0  # a follower that takes longer than this to take an event is dropped


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
    """The subscriber list every notifier keeps (a base class).

    Every announcement is passed on but a repeat of the one before: what a notifier hears is a hint, which the
    subscriber checks against the store (:class:`~deltasync.follow.watch.StepWatch`). Keeping only announcements past
    the largest so far would let one announcement of a step far ahead silence every real one after it.
    """

    def __init__(self) -> None:
        self._callbacks: list[Callable[[int], None]] = []
        self._lock = threading.Lock()
        self.newest: int | None = None  # the last step announced (a hint, not necessarily the largest)

    def subscribe(self, callback: Callable[[int], None]) -> None:
        with self._lock:
            self._callbacks.append(callback)
            newest = self.newest
        if newest is not None:
            callback(newest)

    def _announce(self, step: int) -> None:
        with self._lock:
            if step == self.newest:
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


class EventParser:
    """Server-sent events, one line at a time, as a feed reads them: each complete ``step`` event whose data is
    ``{"step": N}`` with N a step number gives N; anything else gives nothing. A line over
    :data:`MAX_LINE_BYTES` is a ``ConnectionError`` (the feed drops the connection); at most 16 data lines count
    per event."""

    def __init__(self) -> None:
        self._event = "message"
        self._data: list[str] = []

    def feed(self, line: bytes) -> int | None:
        if len(line) > MAX_LINE_BYTES:
            raise ConnectionError(f"an event line over {MAX_LINE_BYTES} bytes")
        text = line.decode("utf-8", "replace").rstrip("\r\n")
        if not text:  # end of one event
            step = _step_from("\n".join(self._data)) if self._event == "step" else None
            self._event, self._data = "message", []
            return step
        if text.startswith(":"):
            return None  # keep-alive
        field, _, value = text.partition(":")
        value = value[1:] if value.startswith(" ") else value
        if field == "event":
            self._event = value[:64]
        elif field == "data" and len(self._data) < 16:
            self._data.append(value)
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
            raise ConfigError(f"EventFeed: expected an http(s) URL of a mirror's /events, got {redact_url(str(url))!r}")
        try:
            parts.port  # noqa: B018 - a port that is not one fails here, not in the feed's thread
        except ValueError:
            raise ConfigError(f"EventFeed: {redact_url(url)!r} names no valid port") from None
        if parts.username is not None or parts.password is not None:  # never sent, and it would show in logs
            raise ConfigError(f"EventFeed: {redact_url(url)!r} carries a user or password: an event feed is read "
                              "without credentials (they would only show in logs); expected http://HOST:PORT/events")
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
            parser = EventParser()
            while not self._stop.is_set():
                line = reply.readline(MAX_LINE_BYTES + 1)
                if not line:
                    raise ConnectionError("the server closed the stream")
                step = parser.feed(line)
                if step is not None:
                    self._announce(step)
        finally:
            self._sock = None
            conn.close()


def _read_head(sock: socket.socket, *, deadline: float, max_bytes: int) -> bytes:
    """A request's line and headers, read within ``deadline`` (monotonic) and ``max_bytes``; b"" when the client
    is too slow, sends too much, or goes away (the handler then closes the connection without a reply). The
    deadline is for the whole head, not per read: a client sending a byte now and then cannot stretch it."""
    buf = bytearray()
    while b"\r\n\r\n" not in buf and b"\n\n" not in buf:
        left = deadline - time.monotonic()
        if left <= 0 or len(buf) > max_bytes:
            return b""
        sock.settimeout(left)
        try:
            chunk = sock.recv(4096)
        except OSError:  # a timeout, a reset
            return b""
        if not chunk:
            return b""
        buf += chunk
    return bytes(buf) if len(buf) <= max_bytes else b""


class _BoundedServer(ThreadingHTTPServer):
    """A threading HTTP server that counts connections, not requests: beyond ``max_connections`` a connection is
    answered 503 at once by the accepting thread and closed, so no client can hold more than that many threads,
    however slowly it sends its request."""

    daemon_threads = True
    request_queue_size = 128  # the listen backlog: a burst of connections is accepted (and answered), not dropped

    def __init__(self, address: tuple[str, int], handler: type[BaseHTTPRequestHandler], *,
                 max_connections: int) -> None:
        self.max_connections = max_connections
        self.connections = 0
        self._count_lock = threading.Lock()
        super().__init__(address, handler)

    def verify_request(self, request, client_address) -> bool:  # noqa: ANN001 - socketserver's signature
        with self._count_lock:
            if self.connections < self.max_connections:
                self.connections += 1
                return True
        try:  # refused without a thread and without reading: a reply that cannot wait
            request.setblocking(False)
            request.send(b"HTTP/1.1 503 Service Unavailable\r\nContent-Length: 0\r\nConnection: close\r\n\r\n")
        except OSError:
            pass
        return False

    def process_request(self, request, client_address) -> None:  # noqa: ANN001
        try:
            super().process_request(request, client_address)
        except BaseException:
            self._left()
            raise

    def process_request_thread(self, request, client_address) -> None:  # noqa: ANN001
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._left()

    def _left(self) -> None:
        with self._count_lock:
            self.connections -= 1


class EventServer:
    """Serve ``GET /events`` (server-sent events) announcing committed steps: what a mirror runs for its region.

    Args:
        host, port: where to listen (port 0: any free port; ``url`` says which).
        max_clients: followers streaming events at once; beyond, a request is answered 503. Connections (each
            holds a thread, streaming or still sending its request) are bounded at twice this plus 8 (requests
            being answered): beyond, a new one is answered 503 at once, before anything is read from it.
        header_timeout_s: a client that has not sent its whole request within this is dropped.

    Example::

        with EventServer("127.0.0.1", 0) as server:
            server.announce(3)   # every connected follower hears "step 3" now
    """

    def __init__(self, host: str = "127.0.0.1", port: int = 0, *, max_clients: int = 512,
                 header_timeout_s: float = HEADER_TIMEOUT_S) -> None:
        if isinstance(max_clients, bool) or not isinstance(max_clients, int) or not 0 < max_clients <= 100_000:
            raise ConfigError(f"EventServer: max_clients must be a number of connections (1..100000), got "
                              f"{max_clients!r}")
        if isinstance(header_timeout_s, bool) or not isinstance(header_timeout_s, (int, float)) or not (
                0 < header_timeout_s <= 3600):
            raise ConfigError(f"EventServer: header_timeout_s must be seconds in (0, 3600], got {header_timeout_s!r}")
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

            def setup(self) -> None:
                super().setup()
                # the request is read whole within the deadline, then parsed from memory (a GET has no body)
                head = _read_head(self.connection, deadline=time.monotonic() + header_timeout_s,
                                  max_bytes=MAX_HEAD_BYTES)
                self.rfile.close()  # the socket's reader, unused: the head was read from the socket itself
                self.rfile = io.BytesIO(head)
                self.connection.settimeout(WRITE_TIMEOUT_S)  # a follower that stops taking events is dropped

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

        self._http = _BoundedServer((host, port), Handler, max_connections=2 * max_clients + 8)
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
