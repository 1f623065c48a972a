"""The RDMA fast path with real NIXL agents in separate processes over loopback (UCX, CPU memory).

A trainer process publishes a small model to a local store with DeltaPublisher and offers each committed
object's bytes to its outbox ring; consumer processes read them over NIXL. What a consumer accepts is checked
against the store independently (the manifest's SHA-256, written by the publisher, and the object file's
bytes), never against the ring's own announcement. Faults: a slow consumer whose slot was reused, a consumer
killed while reading, a lost announcement, a missing acknowledgement, a restarted trainer (stale metadata).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import signal
import time
import uuid
from pathlib import Path
from typing import Any

import blake3
import pytest

from deltasync.rdma.agent import nixl_available

pytestmark = pytest.mark.skipif(not nixl_available(), reason="needs NIXL: pip install 'deltasync[rdma]'")

NAMES = ("model.a.weight", "model.b.bias", "model.c.weight")
CTX = mp.get_context("spawn")
SECRET = "the-cluster-secret-of-these-ring-tests-0123456789"  # the control plane is authenticated


# --- peers (run in spawned processes; module-level so that spawn can import them) ---


def _model(seed: int = 0) -> dict[str, Any]:
    import torch

    g = torch.Generator().manual_seed(seed)
    return {NAMES[0]: torch.randn(256, 256, generator=g).to(torch.bfloat16),
            NAMES[1]: torch.randn(1000, generator=g),
            NAMES[2]: (torch.randn(512, 64, generator=g) * 0.02).to(torch.bfloat16)}


def _train_step(state: dict[str, Any], step: int) -> None:
    """Change ~3% of every tensor's elements in place, as an optimizer step would."""
    import torch

    g = torch.Generator().manual_seed(1000 + step)
    for t in state.values():
        flat = t.view(-1)
        idx = torch.randint(0, flat.numel(), (max(1, flat.numel() // 32),), generator=g)
        flat[idx] = (flat[idx].float() + torch.randn(len(idx), generator=g) * 0.01).to(t.dtype)


def _store_object(url: str, step: int) -> bytes:
    """A committed step's object as the store holds it, checked against the publisher's own SHA-256."""
    from deltasync.store import Store

    with Store(url) as store:
        manifest = store.manifest(step)
        data = store.fetch_object(manifest).read_bytes()
    assert "blake3:" + blake3.blake3(data).hexdigest() == manifest.objects[0].digest
    return data


def trainer_peer(address: str, url: str, steps: list[int], opts: dict[str, Any], out: Any, stop: Any) -> None:
    """Publish ``steps`` to the store and offer each object to the ring; stay up until ``stop`` is set."""
    import torch

    from deltasync.publish.publisher import DeltaPublisher
    from deltasync.rdma.agent import Agent
    from deltasync.rdma.link import TrainerLink
    from deltasync.rdma.messages import PartMeta, TensorMeta, TrainerHello
    from deltasync.rdma.outbox import Outbox

    state = _model()
    for s in range(1, steps[0]):
        _train_step(state, s)  # a restarted trainer resumes from the weights it had
    agent = Agent(f"trainer-0-{uuid.uuid4().hex[:8]}")
    outbox = Outbox(agent, slots=opts.get("slots", 4), slot_bytes=1 << 20, chunk_bytes=64 << 10,
                    ack_deadline_s=opts.get("deadline_s", 5.0))
    tensors = {n: TensorMeta(t.numel(), t.element_size()) for n, t in state.items()}
    with TrainerLink(address, rank=0, secret=SECRET) as link:
        plan = link.register(TrainerHello(rank=0, metadata=agent.metadata(), ring=outbox.layout(), tensors=tensors,
                                          parts=[PartMeta(n, 0, m.numel) for n, m in tensors.items()]))
        outbox.set_consumers(plan.consumers)
        offered = []
        with DeltaPublisher(url, state, anchor_every=1000, take_over=opts.get("take_over", False)) as pub:
            for step in steps:
                if step > 1:
                    _train_step(state, step)
                with torch.no_grad():
                    pub.publish(step)
                pub.flush()
                newer = link.consumers()
                if newer is not None:
                    outbox.set_consumers(newer)
                info = outbox.offer(step, _store_object(url, step))
                offered.append(info.step)
                if step not in opts.get("lose_ready", ()):
                    link.ready(info)
                time.sleep(opts.get("interval_s", 0.0))
        out.put(("trainer", {"offered": offered, "expired": [(s, sorted(a)) for s, a in outbox.expired],
                             "agent": agent.name}))
        while not stop.wait(0.05):
            outbox.poll()
    agent.close()


def consumer_peer(address: str, url: str, cid: str, engine: str, steps: list[int], opts: dict[str, Any],
                  out: Any) -> None:
    """Follow ``steps``: over NIXL when possible, from the store otherwise; report how each step arrived."""
    from deltasync.errors import RdmaError, StaleMetadataError
    from deltasync.format.objects import StepObject
    from deltasync.rdma.agent import Agent
    from deltasync.rdma.inbox import Inbox
    from deltasync.rdma.link import ConsumerLink
    from deltasync.rdma.messages import ConsumerHello
    from deltasync.store import Store

    agent = Agent(f"{cid}-{uuid.uuid4().hex[:8]}")
    inbox = Inbox(agent, capacity_bytes=1 << 20)
    record: list[tuple[int, str, str]] = []
    with ConsumerLink(address, consumer_id=cid, secret=SECRET) as link, Store(url) as store:
        plan = link.register(ConsumerHello(id=cid, engine=engine, agent=agent.name, needs=list(NAMES)))
        for read in plan.reads:
            inbox.connect(read.source.ring, read.source.metadata)
        out.put((cid, "ready"))
        for step in steps:
            how, error = "rdma", ""
            try:
                if step == 2 and "lag_until" in opts:  # busy elsewhere until the trainer is that far ahead
                    while opts["lag_until"] not in link._ready:
                        link._next(30.0)
                (info,) = link.wait_step(step, timeout_s=opts.get("timeouts", {}).get(step, 60.0)).values()
                if step in opts.get("skip", ()):
                    raise RdmaError("skipped (busy)")  # never reads, never acknowledges
                if opts.get("victim"):
                    out.put((cid, "reading"))
                    while True:  # read until killed (the slot is overwritten meanwhile: read on regardless)
                        try:
                            inbox.read(info)
                        except RdmaError:
                            pass
                try:
                    data = bytes(inbox.read(info))
                except StaleMetadataError as e:
                    error = type(e).__name__
                    fresh = link.fetch_metadata(0)
                    inbox.connect(fresh.ring, fresh.metadata)
                    how, data = "rdma-refetched", bytes(inbox.read(info))
            except RdmaError as e:
                how, error, data = "store", type(e).__name__, _store_object(url, step)
            ok = "blake3:" + blake3.blake3(data).hexdigest() == store.manifest(step).objects[0].digest  # publisher
            with StepObject(data, where=f"{cid} step {step}") as obj:  # opens as the store's object does
                ok = ok and obj.header.step == step
            record.append((step, how, error if ok else f"{error} BYTES DIFFER"))
            link.applied(step)
            if step != steps[-1]:
                time.sleep(opts.get("delay_s", 0.0))
        out.put((cid, record))
        deadline = time.monotonic() + 5
        while engine not in link.versions or link.versions[engine] < steps[-1]:
            link._next(max(deadline - time.monotonic(), 0.01))
        out.put((cid, ("version", link.versions[engine])))
    inbox.close()
    agent.close()


# --- harness ---


class Run:
    """A controller in this process and peers in spawned processes; everything stopped on exit."""

    def __init__(self, tmp_path: Path, *, consumers: int) -> None:
        from deltasync.rdma.controller import Controller

        self.url = str(tmp_path / "store")
        self.controller = Controller(trainers=1, consumers=consumers, secret=SECRET)
        self.out = CTX.Queue()
        self.stop = CTX.Event()
        self.procs: list[Any] = []
        self.got: dict[str, list[Any]] = {}

    def trainer(self, steps: list[int], **opts: Any) -> Any:
        return self._start(trainer_peer, self.controller.address, self.url, steps, opts, self.out, self.stop)

    def consumer(self, cid: str, steps: list[int], engine: str = "engine0", **opts: Any) -> Any:
        return self._start(consumer_peer, self.controller.address, self.url, cid, engine, steps, opts, self.out)

    def _start(self, target: Any, *args: Any) -> Any:
        p = CTX.Process(target=target, args=args, daemon=True)
        p.start()
        self.procs.append(p)
        return p

    def wait(self, who: str, what: Any = None, timeout_s: float = 120.0) -> Any:
        """The next report from ``who`` (matching ``what`` when given), collecting others meanwhile.

        The timeout only guards against a hang: it includes spawning the peers (each imports torch and NIXL),
        which on a loaded CI machine beside vLLM tests has taken over 20 s.
        """
        deadline = time.monotonic() + timeout_s
        while True:
            for i, item in enumerate(self.got.get(who, [])):
                if what is None or what(item):
                    return self.got[who].pop(i)
            left = deadline - time.monotonic()
            if left <= 0:
                raise AssertionError(f"no report from {who} in {timeout_s} s; got {self.got}; "
                                     f"exit codes {[p.exitcode for p in self.procs]}")
            try:
                name, item = self.out.get(timeout=min(left, 1.0))
            except queue.Empty:
                continue
            self.got.setdefault(name, []).append(item)

    def close(self) -> None:
        self.stop.set()
        for p in self.procs:
            p.join(10)
            if p.is_alive():
                p.kill()
                p.join()
        self.controller.close()
        self.out.close()
        self.out.join_thread()


@pytest.fixture
def run(tmp_path: Path, request: pytest.FixtureRequest) -> Any:
    runs: list[Run] = []

    def make(consumers: int) -> Run:
        runs.append(Run(tmp_path, consumers=consumers))
        return runs[-1]

    yield make
    for r in runs:
        r.close()


def _is_list(item: Any) -> bool:
    return isinstance(item, list)


def _version(item: Any) -> Any:
    return isinstance(item, tuple) and item[0] == "version"


def test_consumer_reads_the_store_objects_over_nixl(run):
    r = run(consumers=1)
    steps = [1, 2, 3, 4]
    r.trainer(steps)
    r.consumer("c0", steps)
    record = r.wait("c0", _is_list)
    assert record == [(s, "rdma", "") for s in steps]
    assert r.wait("c0", _version) == ("version", 4)
    trainer = r.wait("trainer")
    assert trainer["offered"] == steps and trainer["expired"] == []  # every slot was acknowledged
    assert r.controller.versions == {"engine0": 4}


def test_fast_consumer_never_waits_for_slow_one_which_falls_back_to_the_store(run):
    """The slow consumer reads step 2 only once step 4 is announced: the trainer reused step 2's slot when its
    deadline passed (only the slow consumer had not acknowledged it), so the slow one reads step 2 from the
    store; the fast one got every step over NIXL."""
    r = run(consumers=2)
    steps = [1, 2, 3, 4]
    r.trainer(steps, slots=2, deadline_s=5.0)
    r.consumer("fast", steps, engine="e-fast")
    r.consumer("slow", steps, engine="e-slow", lag_until=4)
    assert r.wait("fast", _is_list) == [(s, "rdma", "") for s in steps]
    assert r.wait("slow", _is_list) == [(1, "rdma", ""), (2, "store", "StaleSlotError"), (3, "rdma", ""),
                                        (4, "rdma", "")]
    trainer = r.wait("trainer")
    assert trainer["offered"] == steps
    assert [(s, [a.split("-")[0] for a in who]) for s, who in trainer["expired"]] == [(2, ["slow"])]
    assert r.wait("fast", _version) == r.wait("slow", _version) == ("version", 4)
    assert r.controller.versions == {"e-fast": 4, "e-slow": 4}


def test_killed_consumer_frees_its_slot_by_deadline(run):
    r = run(consumers=2)
    steps = [1, 2, 3, 4]
    r.consumer("victim", [1], victim=True)
    r.consumer("healthy", steps)
    trainer = r.trainer(steps, slots=2, deadline_s=2.0, interval_s=0.02)
    r.wait("victim", lambda x: x == "reading")
    victim = r.procs[0]
    time.sleep(0.05)
    os.kill(victim.pid, signal.SIGKILL)
    victim.join(10)
    assert victim.exitcode == -signal.SIGKILL
    assert r.wait("healthy", _is_list) == [(s, "rdma", "") for s in steps]
    report = r.wait("trainer")
    assert report["offered"] == steps and trainer.is_alive()
    # the victim stopped acknowledging when it died: the slots it held were freed by their deadline (which
    # steps depends on when the kill landed), and nobody else's acknowledgement ever expired
    expired = [(s, [a.split("-")[0] for a in who]) for s, who in report["expired"]]
    assert expired and all(who == ["victim"] for _, who in expired), expired


def test_lost_announcements_and_a_missing_acknowledgement_fall_back(run):
    """Announcements of steps 3 and 5 are lost: the consumer reads them from the store, having seen a later
    step announced (3) or timed out (5). Step 2 is never read, so never acknowledged: the trainer reuses its
    slot after the deadline (as it does step 3's, which nobody was told about)."""
    r = run(consumers=1)
    steps = [1, 2, 3, 4, 5]
    r.trainer(steps, slots=2, deadline_s=1.5, lose_ready={3, 5})
    r.consumer("c0", steps, skip={2}, timeouts={5: 1.0})
    assert r.wait("c0", _is_list) == [(1, "rdma", ""), (2, "store", "RdmaError"), (3, "store", "RdmaError"),
                                      (4, "rdma", ""), (5, "store", "RdmaTimeoutError")]
    report = r.wait("trainer")
    assert [s for s, _ in report["expired"]] == [2, 3], report
    assert r.wait("c0", _version) == ("version", 5)  # applied from the store, it still counts
    assert r.controller.versions == {"engine0": 5}


def test_restarted_trainer_consumer_refetches_metadata(run):
    r = run(consumers=1)
    r.consumer("c0", [1, 2, 3, 4], timeouts={3: 60.0})  # step 3 comes once the trainer restarted
    first = r.trainer([1, 2])
    deadline = time.monotonic() + 30
    while r.controller.versions.get("engine0", 0) < 2:
        assert time.monotonic() < deadline, r.got
        time.sleep(0.05)
    old = r.wait("trainer")["agent"]
    r.stop.set()
    first.join(15)
    assert first.exitcode == 0
    r.stop.clear()
    r.trainer([3, 4], take_over=True)
    record = r.wait("c0", _is_list)
    assert record == [(1, "rdma", ""), (2, "rdma", ""), (3, "rdma-refetched", "StaleMetadataError"), (4, "rdma", "")]
    assert r.wait("trainer")["agent"] != old


def overwriting_peer(out: Any, stop: Any) -> None:
    """A one-slot ring rewritten as fast as it goes, alternating two blobs, each offer announced on ``out``."""
    from deltasync.rdma.agent import Agent
    from deltasync.rdma.outbox import Outbox

    agent = Agent(f"writer-{uuid.uuid4().hex[:8]}")
    outbox = Outbox(agent, slots=1, slot_bytes=1 << 20, chunk_bytes=64 << 10)
    out.put(("layout", (outbox.layout(), agent.metadata())))
    step = 0
    while not stop.is_set():
        step += 1
        out.put(("info", outbox.offer(step, _blob(step))))
        time.sleep(0.05 if step % 10 == 0 else 0.001)  # now and then a pause long enough to read whole
    agent.close()


def _blob(step: int) -> bytes:
    return bytes([step % 2 * 255]) * (512 << 10)


def test_slot_overwritten_while_read_is_detected(run, tmp_path):
    """Every read returns the announced step's exact bytes or raises StaleSlotError; never a mix."""
    from deltasync.errors import StaleSlotError
    from deltasync.rdma.agent import Agent
    from deltasync.rdma.inbox import Inbox

    r = run(consumers=0)
    r._start(overwriting_peer, r.out, r.stop)
    layout, metadata = r.wait("layout")
    with Agent(f"reader-{uuid.uuid4().hex[:8]}") as agent:
        inbox = Inbox(agent, capacity_bytes=1 << 20)
        inbox.connect(layout, metadata)
        first = r.wait("info")
        while r.wait("info").step < first.step + 2:
            pass
        with pytest.raises(StaleSlotError, match="overwritten"):  # announced, then overwritten before the read
            inbox.read(first)
        good = stale = 0
        for _ in range(5000):
            if good >= 5 and stale >= 5:
                break
            r.got["info"] = r.got.get("info", [])[-1:]  # only the newest announcement matters
            info = r.wait("info")
            try:
                data = inbox.read(info)
            except StaleSlotError:
                stale += 1
                continue
            assert bytes(data) == _blob(info.step), f"step {info.step}: bytes of another step returned"
            good += 1
        inbox.close()
    assert good >= 5 and stale >= 5


def serving_peer(out: Any, commands: Any, stop: Any) -> None:
    """A two-slot ring that offers, corrupts and reports on command (the consumer side runs in the test)."""
    import torch

    from deltasync.rdma.agent import Agent
    from deltasync.rdma.outbox import Outbox

    agent = Agent(f"server-{uuid.uuid4().hex[:8]}")
    outbox = Outbox(agent, slots=2, slot_bytes=1 << 20, chunk_bytes=64 << 10, ack_deadline_s=30.0)
    out.put(("layout", (outbox.layout(), agent.metadata())))
    while not stop.is_set():
        try:
            what, *args = commands.get(timeout=0.05)
        except queue.Empty:
            continue
        if what == "consumers":
            outbox.set_consumers(args[0])
        elif what == "offer":
            out.put(("info", outbox.offer(*args)))
        elif what == "flip":  # one byte of a slot's object, after its announcement: what a bad NIC would do
            slot, at = args
            outbox._buffer[slot * outbox.slot_bytes + 32 + at] ^= 1
            out.put(("flipped", slot))
        elif what == "poke":  # bytes at ``at`` of a slot (its header included), after the announcement
            slot, at, data = args
            start = slot * outbox.slot_bytes + at
            outbox._buffer[start:start + len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
            out.put(("poked", slot))
        elif what == "waiting":
            deadline = time.monotonic() + 10
            while outbox._slots[args[0]].waiting and time.monotonic() < deadline:
                outbox.poll()
                time.sleep(0.01)
            out.put(("waiting", sorted(outbox._slots[args[0]].waiting)))
    agent.close()


def test_pieced_read_hashed_once_held_in_place_and_refused_once_changed(run, tmp_path):
    """A read cut into pieces (hashed as they land) brings the object's exact bytes, checked against the
    publisher's manifest SHA-256, and acknowledges the slot; a lease keeps its bytes where they landed (the
    next read lands elsewhere) and a step object opens on them without a copy; a flipped byte, a digest that
    is not the manifest's, or memory changed under a held object are each refused by name."""
    import torch

    from deltasync.errors import StaleSlotError
    from deltasync.follow.reader import _HeldObject
    from deltasync.publish.publisher import DeltaPublisher
    from deltasync.rdma.agent import Agent
    from deltasync.rdma.inbox import Inbox

    url = str(tmp_path / "published")
    state = _model()
    with DeltaPublisher(url, state, anchor_every=1000) as pub:
        pub.publish(1)
        _train_step(state, 2)
        pub.publish(2)
    objects = {s: _store_object(url, s) for s in (1, 2)}  # checked against the manifest's SHA-256 there
    sha = {s: "blake3:" + blake3.blake3(d).hexdigest() for s, d in objects.items()}
    assert len(objects[1]) > 2 * (64 << 10)  # several pieces of one 64 KiB chunk each

    r = run(consumers=0)
    commands = CTX.Queue()
    r._start(serving_peer, r.out, commands, r.stop)
    layout, metadata = r.wait("layout")
    with Agent(f"reader-{uuid.uuid4().hex[:8]}") as agent:
        inbox = Inbox(agent, capacity_bytes=1 << 20, piece_bytes=64 << 10)
        inbox.connect(layout, metadata)
        commands.put(("consumers", [agent.name]))
        commands.put(("offer", 1, objects[1]))
        first = r.wait("info")
        held = inbox.lease(first, digest=sha[1])
        assert bytes(held.view()) == objects[1] and held.digest == sha[1]
        commands.put(("waiting", first.slot))
        assert r.wait("waiting") == []  # the pieced read acknowledged the slot once every piece landed

        commands.put(("offer", 2, objects[2]))
        second = r.wait("info")
        with pytest.raises(StaleSlotError, match="not the expected"):  # announced object is not the manifest's
            inbox.lease(second, digest=sha[1])
        other = inbox.lease(second, digest=sha[2])
        assert other.offset >= held.offset + held.total  # landed beside the held object, not over it
        assert bytes(held.view()) == objects[1] and bytes(other.view()) == objects[2]
        other.release()

        obj = _HeldObject(held, where="held step 1")  # opens in place: its bytes are the inbox's
        import numpy as np

        address = np.frombuffer(obj.buffer, np.uint8).ctypes.data  # the inbox's own memory, no copy
        assert address == inbox._buffer.data_ptr() + held.offset + 32
        got = {n: obj.read_tensor(n) for n in NAMES}
        assert all(torch.equal(got[n].view(torch.uint8), _model()[n].view(torch.uint8)) for n in NAMES)
        inbox._buffer[held.offset] ^= 1  # the held slot header's generation changes under the open object
        with pytest.raises(StaleSlotError, match="overwritten"):
            obj.read_tensor(NAMES[0])
        with pytest.raises(StaleSlotError, match="overwritten"):
            _HeldObject(held, where="held step 1 again")
        obj.close()
        assert held.released and not inbox._leases  # closing the object let its bytes go

        commands.put(("offer", 3, objects[1]))
        third = r.wait("info")
        commands.put(("flip", third.slot, len(objects[1]) - 7))
        r.wait("flipped")
        with pytest.raises(StaleSlotError, match="differs from the announced"):  # one hash catches one flipped bit
            inbox.lease(third, digest=sha[1])
        with pytest.raises(StaleSlotError, match="not the expected"):  # same hex, another algorithm: another object
            inbox.lease(third, digest="sha256:" + sha[1].removeprefix("blake3:"))
        assert not inbox._leases
        inbox.close()


# --- a read of several pieces that fails midway: what the caller gets, and what is left behind ---
#
# One serving ring (a real NIXL agent in another process) for these tests; each test reads it with a fresh agent
# and inbox of its own, its real calls wrapped by ``Requests`` (which only counts, holds or changes what NIXL
# reports for one piece). What a read must leave after any failure: the error raised as is, no piece posted after
# the failure, every posted request waited for and dropped once (NIXL's handle says it was released), no lease
# held, the next read on the same inbox good, and no landing thread once the inbox is closed.

PIECE = 64 << 10  # the serving ring's chunk, and the inbox's piece: one READ per chunk
PIECES = 6


class Server:
    """``serving_peer`` in a spawned process, shared by the tests below; offers are checked by the test itself."""

    def __init__(self, tmp_path: Path) -> None:
        self.run = Run(tmp_path, consumers=0)
        self.commands = CTX.Queue()
        self.run._start(serving_peer, self.run.out, self.commands, self.run.stop)
        self.layout, self.metadata = self.run.wait("layout")
        self.step = 0

    def offer(self, data: bytes) -> Any:
        self.step += 1
        self.commands.put(("offer", self.step, data))
        return self.run.wait("info")

    def poke(self, slot: int, at: int, data: bytes) -> None:
        self.commands.put(("poke", slot, at, data))
        self.run.wait("poked")

    def close(self) -> None:
        self.run.close()
        self.commands.close()
        self.commands.join_thread()


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Any:
    s = Server(tmp_path_factory.mktemp("ring"))
    yield s
    s.close()


def _blob(seed: int) -> bytes:
    """Random bytes that, after the 32-byte slot header, fill PIECES pieces (the last one not quite)."""
    import random

    return random.Random(seed).randbytes(PIECES * PIECE - 32 - 100)


class Requests:
    """A thin wrapper around a real agent's per-READ calls. It records each request posted (piece k is the k-th
    post: one landing thread posts them in order) and each dropped; ``after_post[k]`` is set once piece k is
    posted, piece k's wait starts only once ``before_wait[k]`` is set; ``report[k]`` is what NIXL is made to
    report for piece k's request (``"ERR"``: failed, ``"PROC"``: never completes), and ``fail[k]`` an error the
    agent's wait raises for piece k after really waiting."""

    def __init__(self, agent: Any, monkeypatch: pytest.MonkeyPatch) -> None:
        import threading

        self.posted: list[Any] = []
        self.dropped: list[Any] = []
        self.after_post: dict[int, threading.Event] = {}
        self.before_wait: dict[int, threading.Event] = {}
        self.report: dict[int, str] = {}
        self.fail: dict[int, BaseException] = {}
        post_read, wait, drop, state = agent.post_read, agent.wait, agent.drop, agent._agent.check_xfer_state

        def posted(*a: Any, **kw: Any) -> Any:
            handle = post_read(*a, **kw)
            self.posted.append(handle)
            if len(self.posted) - 1 in self.after_post:
                self.after_post[len(self.posted) - 1].set()
            return handle

        def waited(handle: Any, **kw: Any) -> None:
            k = self.piece(handle)
            if k in self.before_wait:
                assert self.before_wait[k].wait(30), f"piece {k}: nobody let its wait start"
            wait(handle, **kw)
            if k in self.fail:
                raise self.fail[k]

        def checked(handle: Any) -> str:
            real = state(handle)
            return self.report.get(self.piece(handle), real)

        def dropped(handle: Any, where: str) -> None:
            self.dropped.append(handle)
            drop(handle, where)

        monkeypatch.setattr(agent, "post_read", posted)
        monkeypatch.setattr(agent, "wait", waited)
        monkeypatch.setattr(agent, "drop", dropped)
        monkeypatch.setattr(agent._agent, "check_xfer_state", checked)

    def piece(self, handle: Any) -> int:
        return next(k for k, h in enumerate(self.posted) if h is handle)

    def assert_all_dropped(self) -> None:
        """Every posted request was dropped exactly once, and NIXL's own handle says it was released."""
        assert sorted(map(id, self.dropped)) == sorted(map(id, self.posted))
        assert all(h._released for h in self.posted), self.posted


def _reader(server: Server, monkeypatch: pytest.MonkeyPatch, *, pieces: int = PIECES) -> tuple[Any, Any, Requests]:
    """A fresh agent and inbox on ``server``'s ring that reads a ``_blob`` in ``pieces`` READs (PIECES, or 1: the
    whole object one piece, posted and waited for on the calling thread)."""
    from deltasync.rdma.agent import Agent
    from deltasync.rdma.inbox import Inbox

    assert pieces in (1, PIECES)
    agent = Agent(f"reader-{uuid.uuid4().hex[:8]}")
    inbox = Inbox(agent, capacity_bytes=1 << 20, piece_bytes=PIECE if pieces > 1 else PIECES * PIECE)
    inbox.connect(server.layout, server.metadata)
    return agent, inbox, Requests(agent, monkeypatch)


def _landing_threads(agent: Any) -> list[Any]:
    import threading

    return [t for t in threading.enumerate() if t.name.startswith(f"inbox-{agent.name}")]


def _left_clean(server: Server, agent: Any, inbox: Any, requests: Requests, *, posted: int,
                pieces: int = PIECES) -> None:
    """After a failed read of ``pieces`` pieces: exactly ``posted`` requests were posted and all dropped, nothing
    is held, the same inbox reads the next object whole (where the failed one had landed), and closing the inbox
    ends its landing thread (a one-piece read never starts one)."""
    from deltasync.errors import RdmaError, StaleMetadataError

    assert len(requests.posted) == posted, f"{len(requests.posted)} pieces posted, expected {posted}"
    requests.assert_all_dropped()
    assert not inbox._leases  # the failed read's inbox range is free again: nothing was handed out
    if pieces == 1:
        assert _landing_threads(agent) == [] and inbox._landing is None, "a one-piece read started a landing thread"
    requests.report.clear()
    requests.fail.clear()
    requests.before_wait.clear()
    data = _blob(1000 + server.step)
    info = server.offer(data)
    lease = inbox.lease(info, digest="blake3:" + blake3.blake3(data).hexdigest())
    assert bytes(lease.view()) == data and lease.offset == 0
    lease.release()
    assert len(requests.posted) == posted + pieces
    requests.assert_all_dropped()
    if pieces == 1:
        assert _landing_threads(agent) == [] and inbox._landing is None, "a one-piece read started a landing thread"
    else:
        assert _landing_threads(agent), "a read of several pieces lands them on a thread of its own"
    inbox.close()
    assert _landing_threads(agent) == [], "the landing thread outlived Inbox.close()"
    with pytest.raises(StaleMetadataError):  # a closed inbox reads nothing and starts no thread
        inbox.read(info)
    inbox.connect(server.layout, server.metadata)  # not even when connected again, one piece or several
    with pytest.raises(RdmaError, match="closed"):
        inbox.read(info)
    assert len(requests.posted) == posted + pieces, "a closed inbox posted a READ"
    assert _landing_threads(agent) == [] and not inbox._leases
    agent.close()


@pytest.mark.parametrize(("pieces", "piece"), [(PIECES, 1), (PIECES, 3), (1, 0)])
@pytest.mark.parametrize("how", ["nixl-reports-err", "wait-raises"])
def test_a_read_whose_piece_fails_raises_that_error_and_leaves_nothing(server, monkeypatch, pieces, piece, how):
    """Piece ``piece`` of a read of ``pieces`` fails (NIXL reports ERR for its request, so the agent's wait raises
    RdmaError; or the wait raises an RdmaError subclass of its own): the caller gets that error, the pieces after
    it are never posted, the ones posted are dropped, nothing is held (a one-piece read starts no landing
    thread), and the inbox goes on."""
    from deltasync.errors import RdmaError, StaleSlotError

    agent, inbox, requests = _reader(server, monkeypatch, pieces=pieces)
    data = _blob(piece if pieces > 1 else 10)
    info = server.offer(data)
    if how == "nixl-reports-err":
        requests.report[piece] = "ERR"
        expected: Any = pytest.raises(RdmaError, match="NIXL state ERR")
    else:
        injected = StaleSlotError(f"injected: the NIC lost piece {piece}")
        requests.fail[piece] = injected
        expected = pytest.raises(StaleSlotError)
    with expected as raised:
        inbox.lease(info, digest="blake3:" + blake3.blake3(data).hexdigest())
    if how == "wait-raises":
        assert raised.value is injected
    else:
        assert type(raised.value) is RdmaError
    _left_clean(server, agent, inbox, requests, posted=piece + 1, pieces=pieces)


def test_pieced_read_whose_middle_piece_never_lands_times_out_and_leaves_nothing(server, monkeypatch):
    """Piece 2 of 6 stays in progress (as NIXL reports it) past the read's deadline: RdmaTimeoutError, nothing
    posted after it, every posted request dropped, and the inbox goes on."""
    from deltasync.errors import RdmaTimeoutError

    agent, inbox, requests = _reader(server, monkeypatch)
    data = _blob(2)
    info = server.offer(data)
    requests.report[2] = "PROC"
    with pytest.raises(RdmaTimeoutError, match="deadline"):
        inbox.read(info, timeout_s=2.0)  # ample for pieces 0 and 1 (done inside their post over shared memory)
    _left_clean(server, agent, inbox, requests, posted=3)


def test_pieced_read_of_an_overwritten_header_fails_while_a_later_piece_lands(server, monkeypatch):
    """The slot's header is overwritten between announcement and read (a newer generation), so the first piece
    fails its check while the second is posted and not yet waited for (held until the check ran): StaleSlotError,
    the second piece waited for and dropped, the four after it never posted, and the inbox goes on."""
    import struct
    import threading

    from deltasync.errors import StaleSlotError

    agent, inbox, requests = _reader(server, monkeypatch)
    data = _blob(4)
    info = server.offer(data)
    server.poke(info.slot, 0, struct.pack("<QQQQ", info.generation + 1, info.step, info.length, 0))
    second_posted, checked = threading.Event(), threading.Event()
    requests.after_post[1] = second_posted
    requests.before_wait[1] = checked
    check = inbox._check_header

    def check_header(*a: Any) -> None:  # the real check, once piece 1 is in flight; piece 1 lands after it
        assert second_posted.wait(30), "piece 1 was never posted"
        try:
            check(*a)
        finally:
            checked.set()

    monkeypatch.setattr(inbox, "_check_header", check_header)
    with pytest.raises(StaleSlotError, match=f"generation {info.generation + 1} .*overwritten"):
        inbox.lease(info)
    assert checked.is_set()
    monkeypatch.setattr(inbox, "_check_header", check)
    _left_clean(server, agent, inbox, requests, posted=2)


@pytest.mark.parametrize("piece", [0, 3, PIECES - 1])
def test_pieced_read_whose_bytes_changed_fails_its_digest_and_leaves_nothing(server, monkeypatch, piece):
    """One byte of piece ``piece`` changes in the slot after the announcement (header intact): every piece lands,
    the digest differs, StaleSlotError, every request dropped, no lease, and the inbox goes on."""
    from deltasync.errors import StaleSlotError

    agent, inbox, requests = _reader(server, monkeypatch)
    data = _blob(5 + piece)
    info = server.offer(data)
    at = piece * PIECE + 40  # in the slot: past the header on piece 0
    server.poke(info.slot, at, bytes([data[at - 32] ^ 0x80]))
    with pytest.raises(StaleSlotError, match="differs from the announced"):
        inbox.lease(info, digest="blake3:" + blake3.blake3(data).hexdigest())
    _left_clean(server, agent, inbox, requests, posted=PIECES)


# --- a read of one piece that fails: posted and waited for on the calling thread, the acknowledgement its READ's
# notification; the same guarantees as above, and no landing thread ever started ---


def test_one_piece_read_that_never_lands_times_out_and_leaves_nothing(server, monkeypatch):
    """The one READ stays in progress (as NIXL reports it) past the read's deadline: RdmaTimeoutError, not before
    the deadline, the request dropped once, nothing held, no landing thread, and the inbox goes on."""
    from deltasync.errors import RdmaTimeoutError

    agent, inbox, requests = _reader(server, monkeypatch, pieces=1)
    info = server.offer(_blob(11))
    requests.report[0] = "PROC"
    start = time.monotonic()
    with pytest.raises(RdmaTimeoutError, match="deadline"):
        inbox.read(info, timeout_s=1.0)
    assert time.monotonic() - start >= 1.0, "gave up before the deadline"
    _left_clean(server, agent, inbox, requests, posted=1, pieces=1)


def test_one_piece_read_of_an_overwritten_header_fails_and_leaves_nothing(server, monkeypatch):
    """The slot's header is overwritten between announcement and read (a newer generation): the READ lands, its
    header check fails, StaleSlotError, the request dropped once, nothing held, no landing thread, and the inbox
    goes on."""
    import struct

    from deltasync.errors import StaleSlotError

    agent, inbox, requests = _reader(server, monkeypatch, pieces=1)
    data = _blob(12)
    info = server.offer(data)
    server.poke(info.slot, 0, struct.pack("<QQQQ", info.generation + 1, info.step, info.length, 0))
    with pytest.raises(StaleSlotError, match=f"generation {info.generation + 1} .*overwritten"):
        inbox.lease(info, digest="blake3:" + blake3.blake3(data).hexdigest())
    _left_clean(server, agent, inbox, requests, posted=1, pieces=1)

