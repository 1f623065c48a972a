"""Fuzzing the inputs that arrive from outside other than a stored stream (issue 19): version-2 (multi-part)
manifests, RDMA control messages (to the controller) and announcements (to a consumer), ``init_info`` and
``update_info`` of the vLLM engine, and the HTTP replies the server client reads; and (issue 30) consumers'
heartbeats as ``deltasync status`` shows them, the engine ranks' status replies, event-feed lines, and the
entries a node cache holds (files, links, FIFOs, folders where an object or a lock belongs).

Each target has valid seed inputs; a case takes one and mutates it (a value swapped for a hostile one, a
key dropped or added, a type changed, bytes flipped, cut or inserted), from ``(seed, index)`` alone, so
a case id reproduces. The oracle is the project's rule for hostile input: the code under test returns a
value that satisfies the target's invariants (``accepted``), or raises a ``DeltaSyncError`` (``rejected``;
vLLM's own ``TypeError`` for unknown ``init_info`` keys counts, it answers those itself); anything else,
or an accepted value that breaks an invariant, is a ``failure`` naming the library frame that raised.

``run_inputs(seed, iterations)`` runs every target in this process (microseconds to milliseconds a case);
``python -m tests.fuzz --inputs N`` is the long run; ``tests/test_fuzz.py`` a short one in CI.
"""

from __future__ import annotations

import http.server
import json
import logging
import random
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec

from deltasync.errors import CorruptObjectError, DeltaSyncError, FormatError
from tests.http_server import serving

from .operations import library_frame

HOSTILE = [None, True, False, 0, -1, 1, 2**31, 2**63, -(2**63), 2**64, 10**40, 0.5, -0.0, float("nan"), float("inf"),
           "", "x", "0", "²", "12\n", " 3", "latest", "../../etc", "a" * 5000, "\x00", "ü", [], [1], {}, {"a": 1},
           b"", b"\xff" * 9]


@dataclass
class TargetReport:
    cases: int = 0
    outcomes: dict[str, int] = field(default_factory=lambda: {"accepted": 0, "rejected": 0, "failure": 0})
    failures: dict[str, tuple[int, str]] = field(default_factory=dict)  # class -> (case index, detail)


@dataclass
class InputsReport:
    seed: int
    seconds: float = 0.0
    interrupted: bool = False
    targets: dict[str, TargetReport] = field(default_factory=dict)

    @property
    def cases(self) -> int:
        return sum(t.cases for t in self.targets.values())

    @property
    def failures(self) -> int:
        return sum(t.outcomes["failure"] for t in self.targets.values())

    def table(self) -> str:
        rows = [f"{'target':<16} {'cases':>9} {'accepted':>9} {'rejected':>9} {'failure':>8}"]
        for name, t in self.targets.items():
            o = t.outcomes
            rows.append(f"{name:<16} {t.cases:>9} {o['accepted']:>9} {o['rejected']:>9} {o['failure']:>8}")
        rows.append(f"{'total':<16} {self.cases:>9}  in {self.seconds:.0f} s (seed {self.seed})"
                    f"{' (interrupted)' if self.interrupted else ''}")
        return "\n".join(rows)

    def failure_text(self) -> str:
        return "\n".join(f"{name}: {cls} (case {i}): {detail}" for name, t in self.targets.items()
                         for cls, (i, detail) in t.failures.items())

    def to_dict(self) -> dict[str, Any]:
        return {"seed": self.seed, "seconds": self.seconds, "cases": self.cases, "failures": self.failures,
                "interrupted": self.interrupted,
                "targets": {n: {"cases": t.cases, **t.outcomes,
                                "failure_classes": {c: list(v) for c, v in t.failures.items()}}
                            for n, t in self.targets.items()}}


class Broken(Exception):
    """An accepted input broke an invariant of its target."""


# --- mutation of JSON-like values and of bytes ---


def _paths(value: Any, prefix: tuple = ()) -> list[tuple]:
    out = [prefix]
    if isinstance(value, dict):
        for k, v in value.items():
            out += _paths(v, prefix + (k,))
    elif isinstance(value, list):
        for i, v in enumerate(value):
            out += _paths(v, prefix + (i,))
    return out


def _set(value: Any, path: tuple, new: Any, *, delete: bool = False) -> Any:
    if not path:
        return new
    head, rest = path[0], path[1:]
    if isinstance(value, dict):
        value = dict(value)
        if delete and not rest:
            value.pop(head, None)
        else:
            value[head] = _set(value[head], rest, new, delete=delete)
    else:
        value = list(value)
        if delete and not rest:
            del value[head]
        else:
            value[head] = _set(value[head], rest, new, delete=delete)
    return value


def mutate_value(value: Any, rng: random.Random) -> Any:
    """One to three structural edits of ``value``."""
    for _ in range(rng.randint(1, 3)):
        paths = _paths(value)
        path = rng.choice(paths)
        what = rng.random()
        if what < 0.45:
            value = _set(value, path, rng.choice(HOSTILE))
        elif what < 0.6 and path:
            value = _set(value, path, None, delete=True)
        elif what < 0.7:
            target = _get(value, path)
            if isinstance(target, dict):
                value = _set(value, path, {**target,
                                           rng.choice(["extra", "__proto__", "type", "step", ""]): rng.choice(HOSTILE)})
            elif isinstance(target, list):
                value = _set(value, path, target
                             + [rng.choice(target) if target else rng.choice(HOSTILE)] * rng.randint(1, 3))
        elif what < 0.85:
            target = _get(value, path)
            if isinstance(target, int) and not isinstance(target, bool):
                value = _set(value, path, rng.choice([target + 1, target - 1, -target, target * 2**20, 2**62]))
            elif isinstance(target, str):
                value = _set(value, path, rng.choice([target + "\n", target[:-1], target * 3, target.upper(),
                                                      "../" + target]))
        else:
            target = _get(value, path)
            value = _set(value, path, [target] if rng.random() < 0.5 else {"v": target})
    return value


def _get(value: Any, path: tuple) -> Any:
    for k in path:
        value = value[k]
    return value


def mutate_bytes(data: bytes, rng: random.Random) -> bytes:
    b = bytearray(data)
    for _ in range(rng.randint(1, 4)):
        what = rng.random()
        if what < 0.4 and b:
            b[rng.randrange(len(b))] ^= 1 << rng.randrange(8)
        elif what < 0.6 and b:
            del b[rng.randrange(len(b)):]
        elif what < 0.8:
            i = rng.randrange(len(b) + 1)
            b[i:i] = bytes(rng.randrange(256) for _ in range(rng.randint(1, 16)))
        elif b:
            i = rng.randrange(len(b))
            b[i:i + rng.randint(1, 8)] = b""
    return bytes(b)


def _json(value: Any) -> bytes:
    """JSON text of ``value`` as a hostile writer could send it (NaN and infinities included; bytes as text)."""
    return json.dumps(value, allow_nan=True,
                      default=lambda o: o.decode("latin-1") if isinstance(o, bytes) else str(o)).encode()


# --- targets ---


Z = "0" * 64


def _manifest_seeds() -> list[Any]:
    part = {"object": "delta-r00000-5e07e99d83ae73a9.safetensors", "object_bytes": 31337, "object_sha256": "5e" * 32,
            "tensors": {"model.layers.0.mlp.down_proj.weight": [0, 24576], "model.norm.weight": [0, 128]}}
    part1 = {"object": "delta-r00001-0c1d2e3f4a5b6c7d.safetensors", "object_bytes": 29897, "object_sha256": "0c" * 32,
             "tensors": {"model.layers.0.mlp.down_proj.weight": [24576, 49152]}}
    v2 = {"format_version": 2, "step": 12, "base_step": 11, "kind": "delta", "object_bytes": 31337 + 29897,
          "state_checksum": Z, "created_unix_s": 1790000000.0, "aliases": {"lm_head.weight": "model.embed.weight"},
          "parts": [part, part1], "stats": {}}
    v1 = {"format_version": 1, "step": 3, "base_step": None, "kind": "anchor", "object": "anchor-00.safetensors",
          "object_bytes": 999, "object_sha256": Z, "state_checksum": Z, "created_unix_s": 1.0, "stats": {},
          "delta": {"base_step": 2, "object": "delta-00.safetensors", "object_bytes": 99, "object_sha256": Z}}
    return [v2, v1]


def _check_manifest(m: Any) -> None:
    from deltasync.format.documents import Manifest
    from deltasync.format.names import OBJECT_NAME, check

    again = Manifest.from_json(m.to_json(), where="round trip")
    if again != m:
        raise Broken("an accepted manifest does not survive its own encoding")
    for p in m.objects:
        if not check(OBJECT_NAME, p.object):
            raise Broken(f"accepted object name {p.object!r}")
    if m.is_multipart:
        if sum(p.object_bytes for p in m.objects) != m.object_bytes:
            raise Broken("accepted parts whose sizes do not add up")
        for p in m.parts:
            for name, (start, stop) in p.tensors.items():
                if not 0 <= start <= stop:
                    raise Broken(f"accepted range [{start}, {stop}) of {name!r}")


def t_manifest(rng: random.Random) -> Callable[[], None]:
    from deltasync.format.documents import Manifest

    seed = rng.choice(_manifest_seeds())
    if rng.random() < 0.8:
        text = _json(mutate_value(seed, rng))
    else:
        text = mutate_bytes(json.dumps(seed).encode(), rng)
    return lambda: _check_manifest(Manifest.from_json(text, where="fuzz manifest"))


def _ring() -> dict[str, Any]:
    return {"agent": "trainer-0-abc", "addr": 1 << 20, "device": 0, "mem_type": "DRAM", "slots": 2,
            "slot_bytes": 4096, "chunk_bytes": 1024}


def _slot(step: int) -> dict[str, Any]:
    return {"agent": "trainer-0-abc", "step": step, "slot": step % 2, "offset": (step % 2) * 4096, "length": 10,
            "digest": "sha256:" + Z, "generation": step}


def _to_controller_seeds() -> list[Any]:
    return [
        {"type": "TrainerHello", "rank": 0, "metadata": b"meta", "ring": _ring(), "tensors": {"w": [100, 2]},
         "parts": [["w", 0, 100]]},
        {"type": "ConsumerHello", "id": "c0", "engine": "e", "agent": "agent-c0", "needs": ["w"]},
        {"type": "ConsumerHello", "id": "c1", "engine": "e", "agent": "agent-c1", "needs": [], "everything": True},
        {"type": "StepReady", "rank": 0, "slot": _slot(5)},
        {"type": "Applied", "id": "c0", "step": 5},
        {"type": "MetadataRequest", "rank": 0},
    ]


def _to_peer_seeds() -> list[Any]:
    plan = {"type": "ConsumerPlan", "reads": [{"source": {"rank": 0, "ring": _ring(), "metadata": b"m"},
                                              "parts": [["w", 0, 100]]}]}
    return [plan, {"type": "StepReady", "rank": 0, "slot": _slot(7)},
            {"type": "EngineVersion", "engine": "e", "step": 7},
            {"type": "TrainerPlan", "consumers": ["agent-c0"]}, {"type": "RankMetadata", "rank": 0, "ring": _ring(),
                                                                 "metadata": b"m"},
            {"type": "Refused", "reason": "no"}]


def _frame(seeds: list[Any], rng: random.Random) -> bytes:
    seed = rng.choice(seeds)
    if rng.random() < 0.75:
        try:
            return msgspec.msgpack.encode(mutate_value(seed, rng))
        except OverflowError:  # msgpack has no integers past 64 bits: a peer cannot send one either
            pass
    return mutate_bytes(msgspec.msgpack.encode(seed), rng)


class _ControllerUnderTest:
    """One real controller (its socket bound, no peer connected) whose handler the cases call directly, with
    the sender's key chosen per case; its planned state is rebuilt every 500 cases."""

    SECRET = "the-fuzzer-s-cluster-secret-0123456789abcdef"

    def __init__(self) -> None:
        from deltasync.rdma.controller import Controller

        self.controller = Controller(trainers=1, consumers=2, secret=self.SECRET)
        self.uses = 0
        self._fresh()

    def _fresh(self) -> None:
        from deltasync.rdma import auth
        from deltasync.rdma.messages import ConsumerHello, PartMeta, TensorMeta, TrainerHello
        from deltasync.rdma.outbox import RingLayout

        c = self.controller
        c._trainers.clear()
        c._consumers.clear()
        c._latest.clear()
        c.versions.clear()
        c.schedule = None
        c._send = lambda peer, message: None  # nobody is connected: replies go nowhere
        key = self.SECRET.encode()
        ring = RingLayout(**_ring())
        c._handle(b"t0", TrainerHello(rank=0, metadata=b"m", ring=ring, tensors={"w": TensorMeta(100, 2)},
                                      parts=[PartMeta("w", 0, 100)]))
        c._handle(b"c0", ConsumerHello(id="c0", engine="e", agent="agent-c0", needs=["w"]))
        if self.uses % 2:  # every other generation keeps one consumer unregistered: no plan yet
            c._handle(b"c1", ConsumerHello(id="c1", engine="e", agent="agent-c1", needs=["w"]))
        self.keys = [auth.public_key(key, n) for n in ("trainer:0", "consumer:c0", "consumer:c1", "consumer:x")]
        self.peers = [b"t0", b"c0", b"c1", b"zz"]

    def case(self, rng: random.Random) -> Callable[[], None]:
        from deltasync.rdma.messages import decode_message, to_controller

        self.uses += 1
        if self.uses % 500 == 0:
            self._fresh()
        frame = _frame(_to_controller_seeds(), rng)
        key, peer = rng.choice(self.keys), rng.choice(self.peers)
        c = self.controller

        def run() -> None:
            msg = decode_message(frame, to_controller, where="fuzz")
            c._check_sender(key, msg)
            c._handle(peer, msg)
            if len(c._trainers) > c.expected_trainers or len(c._consumers) > c.expected_consumers:
                raise Broken("more peers registered than expected")
            if len(c.applied) > c.applied.maxlen:
                raise Broken("the applied log grew past its bound")

        return run

    def close(self) -> None:
        self.controller.close()


class _ConsumerLinkUnderTest:
    """A consumer link's filing of what the controller sends (no socket traffic: the cases call ``file``)."""

    def __init__(self) -> None:
        from deltasync.rdma.link import ConsumerLink
        from deltasync.rdma.messages import ConsumerHello

        self.link = ConsumerLink("tcp://127.0.0.1:9", consumer_id="c0", secret=_ControllerUnderTest.SECRET)
        self.link.hello(ConsumerHello(id="c0", engine="e", agent="agent-c0", needs=["w"]))

    def case(self, rng: random.Random) -> Callable[[], None]:
        from deltasync.rdma.link import MAX_ANNOUNCED
        from deltasync.rdma.messages import decode_message, to_peer

        frame = _frame(_to_peer_seeds(), rng)
        link = self.link

        def run() -> None:
            msg = decode_message(frame, to_peer, where="fuzz")
            link.file(msg)
            if len(link._ready) > MAX_ANNOUNCED or len(link.versions) > MAX_ANNOUNCED:
                raise Broken("a consumer's table of announcements grew past its bound")
            newest = link.newest_announced()
            if newest is not None:
                link.announced(newest)

        return run

    def close(self) -> None:
        self.link.close()


def _init_info_seeds() -> list[Any]:
    return [{"url": "s3://bucket/run", "storage_options": {"key": "k"}, "verify": "incremental", "step": 4,
             "mode": "auto", "prefetch": True, "notify": "http://mirror:8765/events",
             "rdma": {"controller": "tcp://h:5555", "engine": "e0", "capacity_bytes": 1 << 20,
                      "secret": "s" * 40}},
            {"url": "/data/stream"}]


def t_init_info(rng: random.Random) -> Callable[[], None]:
    from rollout_loader.vllm.settings import EngineSettings

    info = mutate_value(rng.choice(_init_info_seeds()), rng)

    def run() -> None:
        EngineSettings.parse(info)  # what the engine's parse_init_info does with any JSON value

    return run


def t_update_info(rng: random.Random) -> Callable[[], None]:
    from rollout_loader.vllm.engine import MAX_STEP, DeltasyncUpdateInfo

    info = mutate_value({"step": rng.choice([0, 7, "latest"])}, rng)

    def run() -> None:
        if not isinstance(info, dict) or not all(isinstance(k, str) for k in info):
            return
        try:
            u = DeltasyncUpdateInfo(**info)
        except TypeError as e:
            if "argument" in str(e):
                return
            raise
        if not (u.step == "latest" or (type(u.step) is int and 0 <= u.step <= MAX_STEP)):
            raise Broken(f"accepted update_info step {u.step!r}")

    return run


class _Replies(http.server.BaseHTTPRequestHandler):
    """Answers every request with the reply the current case set (status, headers, body)."""

    reply: tuple[int, dict[str, str], bytes] = (200, {}, b"{}")

    def _answer(self) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        if length:
            self.rfile.read(length)
        status, headers, body = type(self).reply
        self.send_response(status)
        for k, v in headers.items():
            self.send_header(k, v)
        if "Content-Length" not in headers:
            self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    do_GET = do_POST = _answer

    def log_message(self, *args: object) -> None:
        pass


def _http_seeds() -> list[tuple[str, Any]]:
    return [("held_step", {"weight_version": "12"}), ("held_step", {"weight_version": "default"}),
            ("status", {"results": [{"held_step": 3, "arrived": {}, "pauses_s": [], "checksums": {}}]}),
            ("update", {"weight_version": "5"}), ("init", {})]


class _HttpUnderTest:
    def __init__(self) -> None:
        self._cm = serving(_Replies)
        self.url = self._cm.__enter__()

    def case(self, rng: random.Random) -> Callable[[], None]:
        from rollout_loader.vllm.client import HttpWeightTransfer
        from rollout_loader.vllm.settings import EngineSettings

        op, body = rng.choice(_http_seeds())
        status = rng.choice([200] * 6 + [201, 204, 301, 302, 307, 400, 404, 500, 503])
        headers: dict[str, str] = {}
        if status in (301, 302, 307):
            headers["Location"] = rng.choice(["http://example.invalid/weight_info", "/weight_info", ""])
        if rng.random() < 0.1:
            headers["Content-Length"] = rng.choice(["0", "5", "-1", "999999999999", "x"])
        raw = _json(mutate_value(body, rng) if rng.random() < 0.8 else body)
        if rng.random() < 0.2:
            raw = mutate_bytes(raw, rng)
        _Replies.reply = (status, headers, raw)
        client = HttpWeightTransfer(self.url, timeout_s=2.0, check_timeout_s=2.0)

        def run() -> None:
            if op == "held_step":
                held = client.held_step()
                if held is not None and not (type(held) is int and held >= 0):
                    raise Broken(f"held_step returned {held!r}")
            elif op == "status":
                client.status()
            elif op == "update":
                client.update(5)  # succeeds only when /weight_info then names step 5
                if not (status == 200 and json.loads(raw).get("weight_version") == "5"):
                    raise Broken(f"an update reported done though the server answered {status} {raw[:80]!r}")
            else:
                client.init(EngineSettings(url="s3://b/run"))

        return run

    def close(self) -> None:
        self._cm.__exit__(None, None, None)


# --- issue 30: heartbeats, status replies, event-feed lines, node-cache entries ---

_CONTROL = {chr(c) for c in range(32) if c != 10} | {chr(127)} | {chr(c) for c in range(0x80, 0xA0)}


def _heartbeat_seeds() -> list[Any]:
    return [{"consumer_id": "rollout-0", "step": 1, "updated_unix_s": time.time(), "newest_step": 2,
             "weight_version": "1", "errors": 0},
            {"consumer_id": "rollout-0", "step": 0, "updated_unix_s": 1.0},
            {"consumer_id": "rollout-0", "step": 1, "updated_unix_s": time.time() + 10**8,
             "weight_version": "\x1b]52;c;ZXZpbA==\x07[red]x[/red]\u202e"}]


class _StatusUnderTest:
    """``deltasync status`` (table, JSON, Prometheus) over a small local stream whose heartbeat a case writes."""

    def __init__(self) -> None:
        import tempfile

        import torch

        from deltasync import DeltaPublisher

        self._tmp = tempfile.TemporaryDirectory(prefix="deltasync-fuzz-status-")
        self.url = f"{self._tmp.name}/stream"
        with DeltaPublisher(self.url, {"w": torch.zeros(8)}, on_backlog="block") as pub:
            for s in range(3):
                pub.publish(s)

    def case(self, rng: random.Random) -> Callable[[], None]:
        import io

        from rich.console import Console

        from deltasync.history.fleet import fleet_status, prometheus_text
        from deltasync.store import Store
        from deltasync_cli import stream as cli_stream

        seed = rng.choice(_heartbeat_seeds())
        raw = _json(mutate_value(seed, rng)) if rng.random() < 0.8 else mutate_bytes(_json(seed), rng)
        name = rng.choice(["rollout-0", "rollout-0", "other", "x" * 200, "a b"])
        url = self.url

        def run() -> None:
            import os

            folder = f"{url}/consumers"
            os.makedirs(folder, exist_ok=True)
            for old in os.listdir(folder):
                os.unlink(os.path.join(folder, old))
            with open(os.path.join(folder, f"{name}.json"), "wb") as f:
                f.write(raw)
            with Store(url) as store:
                fleet = fleet_status(store)
                if len(fleet.consumers) + len(fleet.unreadable) != 1:
                    raise Broken("a heartbeat file is neither a consumer nor reported unreadable")
                if any(c.suspect and (c.stale or c.age_s >= 0) for c in fleet.consumers):
                    raise Broken("a heartbeat from the future is shown stale or aged")
                texts = [json.dumps(fleet.to_dict()), prometheus_text(fleet)]
            buffer = io.StringIO()
            console, cli_stream.out = cli_stream.out, Console(file=buffer, width=120)
            try:
                cli_stream.status(url, stale_after_s=900.0, as_json=False, prometheus=False, storage_option=None)
            finally:
                cli_stream.out = console
            texts.append(buffer.getvalue())
            for text in texts:
                bad = _CONTROL & set(text)
                if bad:
                    raise Broken(f"status output holds control character(s) {sorted(map(ord, bad))}")
            if fleet.unreadable:
                raise FormatError("the heartbeat was reported unreadable (and the fleet shown)")  # a rejection

        return run

    def close(self) -> None:
        self._tmp.cleanup()


def _status_seeds() -> list[Any]:
    rank = {"held_step": 7, "arrived": {"7": "rdma", "6": "store: timeout"}, "pauses_s": [0.01],
            "checksums": {"w": 2**63 + 5, "b": 3}}
    return [[rank, dict(rank, checksums={"w": 1, "b": 2})], [rank], [{"error": "boom"}], [dict(rank, held_step=None)]]


def t_status_reply(rng: random.Random) -> Callable[[], None]:
    from rollout_loader.vllm.client import combine_status

    ranks = mutate_value(rng.choice(_status_seeds()), rng)

    def run() -> None:
        if not isinstance(ranks, list):
            return  # the client checks that the reply is a list of ranks before combining them
        s = combine_status(ranks, where="fuzz")
        held = s["held_step"]
        if held is not None and not (type(held) is int and 0 <= held < 10**12):
            raise Broken(f"accepted held step {held!r}")
        if any(not (type(v) is int and 0 <= v < 2**64) for v in s["checksums"].values()):
            raise Broken("accepted a checksum that is not 64 bits")
        if any(not (type(k) is int and 0 <= k < 10**12) for k in s["arrived"]):
            raise Broken("accepted an arrival that names no step")

    return run


def _event_seeds() -> list[bytes]:
    return [b'event: step\ndata: {"step": 12}\n\n', b": keep-alive\n\n", b'data: {"step": 3}\n\n',
            b'event: step\r\ndata: {"step": 999999999999}\r\n\r\nevent: step\ndata: {"step": 4}\n\n',
            b"event: step\ndata: {\ndata: \"step\": 5}\n\n"]


def t_event_line(rng: random.Random) -> Callable[[], None]:
    from deltasync.notify import MAX_LINE_BYTES, EventParser

    raw = rng.choice(_event_seeds())
    raw = mutate_bytes(raw, rng) if rng.random() < 0.8 else raw
    if rng.random() < 0.1:
        raw += b"data: " + b"9" * rng.choice([10, MAX_LINE_BYTES, 10 * MAX_LINE_BYTES]) + b"\n\n"

    def run() -> None:
        parser = EventParser()
        heard = []
        for line in raw.splitlines(keepends=True):
            try:
                step = parser.feed(line)
            except ConnectionError:
                if len(line) <= MAX_LINE_BYTES:
                    raise Broken("a line within bounds dropped the feed") from None
                raise FormatError("the feed was dropped: a line too long") from None  # a rejection
            if step is not None and not (type(step) is int and 0 <= step < 10**12):
                raise Broken(f"announced {step!r}")
            if step is not None:
                heard.append(step)
        if not heard:
            raise FormatError("nothing announced")  # every event refused

    return run


class _NodeCacheUnderTest:
    """A node cache whose entry for an object (and its lock, and its temporary path) a case replaces with
    something hostile; the read must return the object's true bytes, never block, never write elsewhere."""

    KINDS = ("absent", "right", "wrong bytes", "short", "long", "symlink", "dangling symlink", "fifo", "folder",
             "empty")

    def __init__(self) -> None:
        import tempfile

        from deltasync.store.node_cache import NodeCache

        self._tmp = tempfile.TemporaryDirectory(prefix="deltasync-fuzz-node-")
        self.root = Path(self._tmp.name)
        self.cache = NodeCache(self.root / "node", max_bytes=1 << 20)
        self.victim = self.root / "victim"
        self.victim.write_bytes(b"precious")

    def case(self, rng: random.Random) -> Callable[[], None]:
        import hashlib
        import os


        data = bytes(rng.randrange(256) for _ in range(rng.randint(8, 64)))
        hexdigest = hashlib.sha256(data).hexdigest()
        digest = "sha256:" + hexdigest  # a SHA-256 object's cache file is its bare hex (caches from before BLAKE3)
        entries = {where: rng.choice(self.KINDS) for where in ("object", "lock", "tmp")}
        cache, victim = self.cache, self.victim
        paths = {"object": cache.folder / "objects" / hexdigest,
                 "lock": cache.folder / "locks" / f"{hexdigest[:2]}.lock",
                 "tmp": cache.folder / "tmp" / f"{hexdigest}.{os.getpid()}.part"}

        def plant(path: Path, kind: str) -> None:
            if path.is_dir() and not path.is_symlink():
                import shutil

                shutil.rmtree(path)
            else:
                path.unlink(missing_ok=True)
            content = {"right": data, "wrong bytes": bytes(len(data)), "short": data[:-1], "long": data + b"x",
                       "empty": b""}
            if kind in content:
                path.write_bytes(content[kind])
            elif kind == "symlink":
                os.symlink(victim, path)
            elif kind == "dangling symlink":
                os.symlink(self.root / "nowhere", path)
            elif kind == "fifo":
                os.mkfifo(path)
            elif kind == "folder":
                path.mkdir()

        def check(got: bytes) -> None:
            if hashlib.sha256(got).hexdigest() != hexdigest or len(got) != len(data):
                raise CorruptObjectError("not the object")

        def run() -> None:
            for where, kind in entries.items():
                plant(paths[where], kind)
            hits = cache.hits
            got = cache.read(digest, len(data), lambda: data, check)
            if got != data:
                raise Broken(f"read returned other bytes than the object's (entries {entries})")
            if victim.read_bytes() != b"precious":
                raise Broken(f"a write went through a link (entries {entries})")
            victim.write_bytes(b"precious")
            if cache.hits > hits and entries["object"] != "right":
                raise Broken(f"a hostile entry was served as a hit (entries {entries})")
            if cache.hits == hits:
                raise CorruptObjectError("the entry was not used: the object came from the store")  # a rejection

        return run

    def close(self) -> None:
        self._tmp.cleanup()


def _classify(run: Callable[[], None]) -> tuple[str, str]:
    try:
        run()
    except DeltaSyncError:
        return "rejected", ""
    except Broken as e:
        return "failure", f"Broken: {e}"
    except Exception as e:  # noqa: BLE001 - the oracle: anything else is a failure
        frames = [(f.filename, f.lineno, f.name) for f in traceback.extract_tb(e.__traceback__)]
        return "failure", f"{type(e).__name__} at {library_frame(frames)}: {str(e)[:200]}"
    return "accepted", ""


TARGETS = ("manifest", "control", "announcement", "init_info", "update_info", "http_reply", "heartbeat",
           "status_reply", "event_line", "node_cache")


def run_inputs(seed: int, iterations: int, *, targets: tuple[str, ...] = TARGETS,
               weights: dict[str, int] | None = None, start: int = 0,
               on_progress: Callable[[InputsReport], None] | None = None) -> InputsReport:
    """``iterations`` cases (indices ``start``..) spread over ``targets`` (``weights``: relative shares; the
    HTTP target is about a thousand times slower a case than the others, so it gets fewer by default).
    Ctrl-C (or SIGTERM in ``python -m tests.fuzz``) ends the run early with the report so far
    (``interrupted``); ``on_progress`` hears the report every 10,000 cases."""
    weights = weights or {"manifest": 30, "control": 30, "announcement": 20, "init_info": 10, "update_info": 5,
                          "http_reply": 1, "heartbeat": 1, "status_reply": 10, "event_line": 20, "node_cache": 2}
    report = InputsReport(seed=seed, targets={t: TargetReport() for t in targets})
    shares = [weights.get(t, 1) for t in targets]
    makers: dict[str, Any] = {}
    t0 = time.monotonic()
    quiet = [logging.getLogger(n)
             for n in ("deltasync.rdma", "deltasync.store.node_cache", "deltasync.follow.consumers")]
    levels = [q.level for q in quiet]  # the controller logs every refusal, a cache every dropped entry: millions
    for q in quiet:
        q.setLevel(logging.CRITICAL)
    try:
        for index in range(start, start + iterations):
            if on_progress is not None and index > start and (index - start) % 10_000 == 0:
                report.seconds = time.monotonic() - t0
                on_progress(report)
            rng = random.Random(f"{seed}:{index}")
            name = rng.choices(targets, shares)[0]
            if name not in makers:
                makers[name] = {"control": _ControllerUnderTest, "announcement": _ConsumerLinkUnderTest,
                                "http_reply": _HttpUnderTest, "heartbeat": _StatusUnderTest,
                                "node_cache": _NodeCacheUnderTest}.get(name, lambda: None)()
            under = makers[name]
            make = under.case if under is not None else globals()[f"t_{name}"]
            outcome, detail = _classify(make(rng))
            t = report.targets[name]
            t.cases += 1
            t.outcomes[outcome] += 1
            if outcome == "failure":
                t.failures.setdefault(detail.split(":")[0] + ":" + detail.split(":")[1] if ":" in detail else detail,
                                      (index, detail))
    except KeyboardInterrupt:
        report.interrupted = True
    finally:
        for q, level in zip(quiet, levels, strict=True):
            q.setLevel(level)
        for under in makers.values():
            if under is not None:
                under.close()
    report.seconds = time.monotonic() - t0
    return report
