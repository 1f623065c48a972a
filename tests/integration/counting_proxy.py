"""A reverse HTTP proxy that counts the requests a store client makes (method, path, query), in front of a real
S3 server: what an object store bills and throttles is requests, so tests count them where they happen.

The client signs its requests for the proxy's address; the proxy forwards them unchanged (``Host`` header
included), so the server checks the same signature. ``fail`` injects answers (e.g. 503 SlowDown) for the
requests a predicate picks; ``lose`` forwards a request and then answers 503 instead of the server's reply
(a write that happened but whose reply was lost).
"""

from __future__ import annotations

import http.client
import threading
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler
from urllib.parse import urlsplit

from tests.http_server import serving


@dataclass
class Request:
    method: str
    path: str  # without the query
    query: str
    nbytes: int = 0  # of the answer's body


@dataclass
class CountingProxy:
    url: str
    requests: list[Request] = field(default_factory=list)
    # (method, path, query) -> (status, headers, body) to answer instead of forwarding, or None to forward
    fail: Callable[[Request], tuple[int, dict[str, str], bytes] | None] | None = None
    # requests to forward whose reply is then lost: the client gets 503 SlowDown though the server acted
    lose: Callable[[Request], bool] | None = None
    lost: list[Request] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def take(self) -> list[Request]:
        """The requests since the last ``take`` (and forget them)."""
        with self.lock:
            out, self.requests = self.requests, []
        return out

    def count(self, requests: list[Request]) -> Counter:
        """``{(method, kind): n}`` with kind a LIST (a bucket listing), or the key's last part."""
        def kind(r: Request) -> str:
            if "list-type" in r.query or r.path.rstrip("/").count("/") <= 1:
                return "LIST"
            return r.path.rsplit("/", 1)[-1]
        return Counter((r.method, kind(r)) for r in requests)


@contextmanager
def counting_proxy(endpoint: str) -> Iterator[CountingProxy]:
    """A proxy on a free loopback port forwarding to ``endpoint`` (``http://host:port``)."""
    target = urlsplit(endpoint)
    state = CountingProxy(url="")

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def _forward(self) -> None:
            path, _, query = self.path.partition("?")
            req = Request(self.command, path, query)
            with state.lock:
                state.requests.append(req)
            length = int(self.headers.get("Content-Length") or 0)
            body = self.rfile.read(length) if length else None
            injected = state.fail(req) if state.fail is not None else None
            if injected is not None:
                status, headers, data = injected
                self.send_response(status)
                for k, v in {**headers, "Content-Length": str(len(data))}.items():
                    self.send_header(k, v)
                self.end_headers()
                self.wfile.write(data)
                return
            conn = http.client.HTTPConnection(target.hostname, target.port, timeout=60)
            try:
                headers = {k: v for k, v in self.headers.items() if k.lower() not in ("connection", "keep-alive")}
                conn.request(self.command, self.path, body=body, headers=headers)
                reply = conn.getresponse()
                data = reply.read()
                if state.lose is not None and state.lose(req):
                    with state.lock:
                        state.lost.append(req)
                    gone = b"<Error><Code>SlowDown</Code><Message>reply lost</Message></Error>"
                    self.send_response(503)
                    self.send_header("Content-Length", str(len(gone)))
                    self.end_headers()
                    self.wfile.write(gone)
                    return
                self.send_response(reply.status, reply.reason)
                for k, v in reply.getheaders():
                    if k.lower() not in ("connection", "keep-alive", "transfer-encoding", "content-length"):
                        self.send_header(k, v)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                req.nbytes = len(data)
                if self.command != "HEAD":
                    self.wfile.write(data)
            finally:
                conn.close()

        do_GET = do_PUT = do_POST = do_HEAD = do_DELETE = _forward

        def log_message(self, *args: object) -> None:
            pass

    with serving(Handler) as state.url:
        yield state
