"""The NIXL fast path end to end: a real DeltaPublisher with ``rdma=`` (the RDMA offer, a sink of its commit
announcement), a controller, a state-dict consumer (``RdmaConsumer``: a notifier and the object source its
reader asks first), real processes.

What the consumer holds is compared with the trainer's own tensors through SHA-256 of their raw bytes,
computed on each side independently of deltasync (never with its checksums). Faults the publisher's hook adds
to those of tests/test_rdma_ring.py: a ring that misses a step (an object larger than a slot) falls back to the
store; a failing RDMA path, or no controller at all, never costs a commit.
"""

from __future__ import annotations

import hashlib
import multiprocessing as mp
import queue
import time
from pathlib import Path
from typing import Any

import blake3
import pytest

from deltasync.rdma.agent import nixl_available

pytestmark = pytest.mark.skipif(not nixl_available(), reason="needs NIXL: pip install 'deltasync[rdma]'")

CTX = mp.get_context("spawn")
STEPS = [1, 2, 3, 4, 5]
SECRET = "the-cluster-secret-of-these-nixl-tests-0123456789"  # the control plane is authenticated


def _model() -> dict[str, Any]:
    import torch

    g = torch.Generator().manual_seed(0)
    return {"model.a.weight": torch.randn(256, 256, generator=g).to(torch.bfloat16),
            "model.b.bias": torch.randn(1000, generator=g),
            "model.c.weight": (torch.randn(512, 64, generator=g) * 0.02).to(torch.bfloat16)}


def _train_step(state: dict[str, Any], step: int) -> None:
    """Change ~3% of each tensor's elements in place, as an optimizer step would."""
    import torch

    g = torch.Generator().manual_seed(1000 + step)
    for t in state.values():
        flat = t.view(-1)
        idx = torch.randint(0, flat.numel(), (max(1, flat.numel() // 32),), generator=g)
        flat[idx] = (flat[idx].float() + torch.randn(len(idx), generator=g) * 0.01).to(t.dtype)


def _digests(state: dict[str, Any]) -> dict[str, str]:
    """SHA-256 of each tensor's raw bytes: the reference, independent of deltasync's checksums."""
    import torch

    return {n: hashlib.sha256(t.contiguous().view(torch.uint8).numpy().tobytes()).hexdigest() for n, t in state.items()}


def _publish(url: str, rdma: dict[str, Any], out: Any | None,
             wait: Any = None) -> tuple[dict[int, dict[str, str]], Any]:
    """Publish STEPS with the RDMA offer on; the truth of every step and the offer's stats (after ``wait``: the
    ring stays up until the consumer is done, a slow consumer would read the store)."""
    import torch

    from deltasync.publish.publisher import DeltaPublisher

    state = _model()
    truth = {}
    with DeltaPublisher(url, state, anchor_every=1000, on_backlog="block", rdma=rdma) as pub:
        for step in STEPS:
            if step > 1:
                _train_step(state, step)
            with torch.no_grad():
                pub.publish(step)
            truth[step] = _digests(state)
            if out is not None:
                out.put(("truth", (step, truth[step])))
            time.sleep(0.05)
        pub.flush()
        stats = pub.rdma.stats
        if wait is not None:
            wait()
    return truth, stats


def trainer_peer(address: str, url: str, opts: dict[str, Any], stop: Any, out: Any) -> None:
    rdma = {"secret": SECRET, "controller": address, "slot_bytes": opts.get("slot_bytes", 1 << 20),
            "chunk_bytes": 16 << 10,
            "plan_wait_s": 30.0, "ack_deadline_s": 5.0}
    _, stats = _publish(url, rdma, out, wait=lambda: stop.wait(60))
    out.put(("trainer", {"announced": stats.announced, "store_only": [s for s, _ in stats.store_only]}))


def consumer_peer(address: str, url: str, out: Any) -> None:
    from deltasync.rdma.consumer import RdmaConsumer
    from deltasync.store import Store

    from_store: list[int] = []  # steps whose object the store fetched (a second digest of those bytes)
    for method in ("read_object", "fetch_object"):
        original = getattr(Store, method)

        def counted(self: Any, manifest: Any, *a: Any, _original: Any = original, **kw: Any) -> Any:
            from_store.append(manifest.step)
            return _original(self, manifest, *a, **kw)

        setattr(Store, method, counted)

    from rollout_loader import Follower, StateDictTarget

    target = StateDictTarget(verify="full")
    rdma = {"secret": SECRET, "controller": address, "capacity_bytes": 1 << 20, "announce_wait_s": 2.0}
    with RdmaConsumer(url, rdma=rdma, consumer_id="c0", plan_wait_s=30.0) as consumer:
        out.put(("c0", "ready"))
        held = {}

        def on_step(step: int) -> None:  # the one follow loop; the consumer pushes each announced step to it
            consumer.applied(step)
            held[step] = _digests({n: target.replica.tensors[n] for n in target.replica.checksums})

        with Follower(consumer.reader, target, notifier=consumer, on_step=on_step) as follower:
            follower.wait_for(STEPS[-1], timeout_s=30.0)
        out.put(("c0", {"held": held, "arrived": dict(consumer.arrived), "from_store": from_store}))


class Peers:
    def __init__(self, tmp_path: Path) -> None:
        from deltasync.rdma.controller import Controller

        self.url = str(tmp_path / "store")
        self.controller = Controller(trainers=1, consumers=1, secret=SECRET)
        self.out = CTX.Queue()
        self.stop = CTX.Event()
        self.procs: list[Any] = []
        self.got: dict[str, list[Any]] = {}

    def start(self, target: Any, *args: Any) -> None:
        p = CTX.Process(target=target, args=(self.controller.address, self.url, *args, self.out), daemon=True)
        p.start()
        self.procs.append(p)

    def wait(self, who: str, timeout_s: float = 60.0) -> Any:
        deadline = time.monotonic() + timeout_s
        while not self.got.get(who):
            assert time.monotonic() < deadline, f"no report from {who}; exit codes {[p.exitcode for p in self.procs]}"
            try:
                name, item = self.out.get(timeout=1.0)
            except queue.Empty:
                continue
            self.got.setdefault(name, []).append(item)
        return self.got[who].pop(0)

    def close(self) -> None:
        self.stop.set()
        for p in self.procs:
            p.join(15)
            if p.is_alive():
                p.kill()
                p.join()
        self.controller.close()
        self.out.close()
        self.out.join_thread()


@pytest.fixture
def peers(tmp_path: Path) -> Any:
    p = Peers(tmp_path)
    yield p
    p.close()


def _follow(peers: Peers, **trainer_opts: Any) -> tuple[dict, dict, dict]:
    peers.start(consumer_peer)
    peers.start(trainer_peer, trainer_opts, peers.stop)
    assert peers.wait("c0") == "ready"
    consumer = peers.wait("c0")
    peers.stop.set()
    trainer = peers.wait("trainer")
    truth = dict(peers.wait("truth") for _ in STEPS)
    return consumer, trainer, truth


def test_state_dict_consumer_follows_a_publisher_over_nixl_bit_exactly(peers):
    consumer, trainer, truth = _follow(peers)
    assert consumer["held"] == truth  # every step, every tensor, byte for byte
    assert consumer["arrived"] == {s: "rdma" for s in STEPS}
    assert consumer["from_store"] == []  # opened where they landed, hashed once there against the manifest
    assert trainer == {"announced": STEPS, "store_only": []}
    assert peers.controller.versions == {"c0": STEPS[-1]}
    _objects_equal_store(peers.url)


def test_a_step_the_ring_cannot_hold_comes_from_the_store(peers):
    """The anchor (~200 KB) is larger than a 64 KiB slot: never announced, read from the store; deltas fit."""
    consumer, trainer, truth = _follow(peers, slot_bytes=64 << 10)
    assert consumer["held"] == truth
    assert consumer["arrived"][1].startswith("store: ")
    assert {s: how for s, how in consumer["arrived"].items() if s > 1} == {s: "rdma" for s in STEPS[1:]}
    assert consumer["from_store"] == [1]  # once: the failed ring read is not retried by the store's read
    assert trainer == {"announced": STEPS[1:], "store_only": [1]}


def _objects_equal_store(url: str) -> None:
    from deltasync.store import Store

    with Store(url) as store:
        assert store.steps() == STEPS
        for s in STEPS:
            m = store.manifest(s)
            assert "blake3:" + blake3.blake3(store.fetch_object(m).read_bytes()).hexdigest() == m.objects[0].digest


def _store_holds_truth(url: str, truth: dict[int, dict[str, str]]) -> None:
    from deltasync.follow.reader import StreamReader

    with StreamReader(url) as reader:
        assert reader.steps() == STEPS
        for s in STEPS:
            assert _digests(reader.state_dict(s)) == truth[s]


def test_every_step_commits_when_the_rdma_path_fails(tmp_path, monkeypatch):
    """The ring raises on every offer (a bug, a dead NIC): each step is still committed, none announced."""
    from deltasync.errors import RdmaError
    from deltasync.rdma.controller import Controller
    from deltasync.rdma.outbox import Outbox

    def broken(self: Any, step: int, data: Any, **kw: Any) -> Any:
        raise RdmaError("the NIC is gone")

    monkeypatch.setattr(Outbox, "offer", broken)
    url = str(tmp_path / "store")
    with Controller(trainers=1, consumers=0, secret=SECRET) as controller:
        truth, stats = _publish(url, {"secret": SECRET, "controller": controller.address, "slot_bytes": 1 << 20,
                                      "plan_wait_s": 10.0}, None)
    assert stats.announced == [] and [s for s, _ in stats.store_only] == STEPS
    assert all("the NIC is gone" in why for _, why in stats.store_only)
    _store_holds_truth(url, truth)


def test_every_step_commits_without_a_controller(tmp_path):
    """Nobody listens at the controller's address: no plan ever comes, every step goes through the store."""
    import socket

    with socket.socket() as s:  # a port nobody serves
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = str(tmp_path / "store")
    truth, stats = _publish(url, {"secret": SECRET, "controller": f"tcp://127.0.0.1:{port}", "slot_bytes": 1 << 20,
                                  "plan_wait_s": 0.2}, None)
    assert stats.announced == [] and [s for s, _ in stats.store_only] == STEPS
    _store_holds_truth(url, truth)


def test_only_a_reader_holding_the_manifest_asks_the_ring(tmp_path):
    """A step object read through the store (a sharded step's part, never offered over RDMA, or by a reader
    without the manifest) never asks the ring, so never waits for an announcement (issue 19, item 4): the ring is
    the reader's object source, and the store knows nothing of it."""
    from deltasync.follow.reader import StreamReader
    from deltasync.store import Store

    class Ring:  # stands beside the real ring of the tests above: records whether it was asked at all
        id, arrived, asked = "c0", {}, []

        def held(self, step: int, **kw: Any) -> Any:
            self.asked.append(step)
            time.sleep(30)  # what an announcement that never comes costs
            raise AssertionError("unreachable")

    ring = Ring()
    with Store(str(tmp_path)) as store:
        transport = StreamReader(store, objects=ring).store.transport
        for key in ("steps/000000000003/rank-00001-of-00004.safetensors", "steps/000000000004/delta.safetensors"):
            transport.put(key, b"part bytes")
            assert transport.get(key) == b"part bytes"
            transport.get_file(key, tmp_path / "copy")
            assert (tmp_path / "copy").read_bytes() == b"part bytes"
    assert ring.asked == [] and ring.arrived == {}


def test_a_reader_asks_its_object_source_first_with_the_manifest_then_the_store(tmp_path):
    """``StreamReader(objects=...)`` asks the source once per single-object step it opens, with the manifest's
    name, size and digest (read independently here from the stored manifest); a source that has nothing sends
    the read to the store, which serves the same bytes."""
    import json

    import torch

    from deltasync.follow.reader import StreamReader
    from deltasync.publish.publisher import DeltaPublisher

    url = str(tmp_path / "store")
    state = _model()
    with DeltaPublisher(url, state, anchor_every=1000) as pub:
        for step in STEPS[:3]:
            if step > 1:
                _train_step(state, step)
            with torch.no_grad():
                pub.publish(step)
    truth = _digests(state)

    class Empty:  # a ring that missed every step
        asked: list[tuple[int, dict[str, Any]]] = []

        def held(self, step: int, **kw: Any) -> None:
            self.asked.append((step, kw))
            return None

    source = Empty()
    with StreamReader(url, objects=source) as reader:
        assert _digests(reader.state_dict(STEPS[2])) == truth
    expected = []
    for step in STEPS[:3]:
        doc = json.loads((tmp_path / "store" / "steps" / f"{step:012d}" / "manifest.json").read_text())
        expected.append((step, {"name": doc["object"], "nbytes": doc["object_bytes"], "digest": doc["object_digest"]}))
    assert source.asked == expected


def test_commits_go_on_when_the_controller_goes_away_after_the_plan(tmp_path):
    """The controller planned, then went away (a crash, a partition): the announcements queue where nobody takes
    them, and once ZMQ's queue is full (a thousand steps later: offered here at once) a blocking send would hold
    every later commit for ever. Each commit goes on in bounded time; those steps go by the store (stats say
    why), and the store holds every one."""
    import threading

    import torch

    from deltasync.errors import RdmaTimeoutError
    from deltasync.follow.reader import StreamReader
    from deltasync.publish.publisher import DeltaPublisher
    from deltasync.rdma.controller import Controller

    url = str(tmp_path / "store")
    state = _model()
    controller = Controller(trainers=1, consumers=0, secret=SECRET)
    rdma = {"secret": SECRET, "controller": controller.address, "slot_bytes": 1 << 20, "plan_wait_s": 30.0}
    truth: dict[int, dict[str, str]] = {}
    with DeltaPublisher(url, state, anchor_every=1000, on_backlog="block", rdma=rdma) as pub:
        with torch.no_grad():
            pub.publish(1)
        pub.flush()
        truth[1] = _digests(state)
        assert pub.rdma.stats.announced == [1]
        controller.close()
        with pytest.raises(RdmaTimeoutError):  # a long run's announcements fill ZMQ's queue (1000) for nobody
            for _ in range(2000):
                pub.rdma.link.ready(pub.rdma.outbox.offer(1, b"x" * 64))
        done: list[int] = []

        def publish() -> None:
            for step in (2, 3):
                _train_step(state, step)
                with torch.no_grad():
                    pub.publish(step)
                pub.flush()
                truth[step] = _digests(state)
                done.append(step)

        thread = threading.Thread(target=publish, daemon=True)
        thread.start()
        thread.join(60)
        assert done == [2, 3], "a commit waited for a controller that went away"
        why = dict(pub.rdma.stats.store_only)
        assert sorted(why) == [2, 3] and all("RdmaTimeoutError" in w for w in why.values()), why
    with StreamReader(url) as reader:
        assert {s: _digests(reader.state_dict(s)) for s in (1, 2, 3)} == truth
