"""The controller's protocol without NIXL: plans once from hellos, forwards announcements to the consumers
that read the announcing rank, advances an engine only when all its consumers applied, and answers hostile
or unexpected messages with a refusal while it keeps serving everyone else."""

from __future__ import annotations

import hashlib
from concurrent.futures import ThreadPoolExecutor

import msgspec
import pytest
import zmq

from deltasync.errors import ConfigError, FormatError, RdmaTimeoutError
from deltasync.rdma.controller import (
    MAX_MESSAGE_BYTES,
    ConsumerHello,
    ConsumerLink,
    Controller,
    ControlMessageError,
    ControlRefusedError,
    PartMeta,
    TensorMeta,
    TrainerHello,
    TrainerLink,
    _to_controller,
    decode_message,
)
from deltasync.rdma.outbox import RingLayout, SlotInfo

TENSORS = {"w": TensorMeta(100, 2), "b": TensorMeta(10, 4)}


def _ring(agent: str) -> RingLayout:
    return RingLayout(agent=agent, addr=1 << 20, device=0, mem_type="DRAM", slots=2, slot_bytes=4096, chunk_bytes=1024)


def _trainer(rank: int, agent: str) -> TrainerHello:
    return TrainerHello(rank=rank, metadata=b"nixl-metadata-" + agent.encode(), ring=_ring(agent), tensors=TENSORS,
                        parts=[PartMeta(n, 0, m.numel) for n, m in TENSORS.items()])


def _slot(agent: str, step: int) -> SlotInfo:
    return SlotInfo(agent=agent, step=step, slot=step % 2, offset=(step % 2) * 4096, length=10,
                    sha256=hashlib.sha256(b"%d" % step).hexdigest(), generation=step)


@pytest.fixture
def controller():
    with Controller(trainers=1, consumers=2) as c:
        yield c


def test_plan_announce_and_engine_version_after_every_consumer(controller):
    with TrainerLink(controller.address) as t, ConsumerLink(controller.address) as c0, \
            ConsumerLink(controller.address) as c1:
        with ThreadPoolExecutor(3) as pool:  # each waits for the plan, made once all three said hello
            f0 = pool.submit(c0.register, ConsumerHello(id="c0", engine="e", agent="agent-c0", needs=["w"]))
            f1 = pool.submit(c1.register, ConsumerHello(id="c1", engine="e", agent="agent-c1", needs=["w", "b"]))
            ft = pool.submit(t.register, _trainer(0, "trainer-a"))
            plans = {"c0": f0.result(30), "c1": f1.result(30)}
            assert ft.result(30).consumers == ["agent-c0", "agent-c1"]
        for cid, needs in (("c0", {"w"}), ("c1", {"w", "b"})):
            got = plans[cid]
            assert [r.source.ring.agent for r in got.reads] == ["trainer-a"]
            assert got.reads[0].source.metadata == b"nixl-metadata-trainer-a"
            assert {p.name for r in got.reads for p in r.parts} == needs
        t.ready(_slot("trainer-a", 1))
        assert c0.wait_step(1, timeout_s=10) == {0: _slot("trainer-a", 1)}
        assert c1.wait_step(1, timeout_s=10) == {0: _slot("trainer-a", 1)}
        c0.applied(1)
        with pytest.raises(RdmaTimeoutError):  # c1 has not applied step 1: the engine stays where it was
            c0._next(0.5)
        assert controller.versions == {}
        c1.applied(1)
        c0._next(10)
        assert c0.versions == {"e": 1} and controller.versions == {"e": 1}
        t.send(_trainer(0, "trainer-b"))  # a restarted rank: consumers refetch its metadata
        assert t.consumers(10) == ["agent-c0", "agent-c1"]
        fresh = c0.fetch_metadata(0, timeout_s=10)
        assert fresh.ring.agent == "trainer-b" and fresh.metadata == b"nixl-metadata-trainer-b"


def test_hostile_messages_are_refused_and_the_controller_keeps_serving(controller):
    ctx = zmq.Context()
    raw = ctx.socket(zmq.DEALER)
    raw.setsockopt(zmq.LINGER, 0)
    raw.connect(controller.address)
    try:
        bad = [b"\xff\x00garbage", msgspec.msgpack.encode({"type": "Applied", "id": "../x", "step": 1}),
               msgspec.msgpack.encode({"type": "Applied", "id": "c0", "step": -1}),
               msgspec.msgpack.encode({"type": "Nope"}),
               msgspec.msgpack.encode({"type": "ConsumerHello", "id": "c9", "engine": "e", "agent": "a",
                                       "needs": ["w"] * 200_000})]
        for frame in bad:
            raw.send(frame)
            assert raw.poll(10_000), frame[:40]
            reply = msgspec.msgpack.decode(raw.recv())
            assert reply["type"] == "Refused" and "invalid control message" in reply["reason"], reply
        raw.send(msgspec.msgpack.encode({"type": "Applied", "id": "c0", "step": 3}))  # well-formed, but no plan
        assert raw.poll(10_000)
        assert "not that registered consumer" in msgspec.msgpack.decode(raw.recv())["reason"]
    finally:
        raw.close()
        ctx.term()
    with TrainerLink(controller.address) as t:  # still serving
        t.send(_trainer(0, "trainer-a"))
        with pytest.raises(RdmaTimeoutError):  # no plan until both consumers said hello
            t.receive(0.3)


def test_inconsistent_metadata_refuses_every_waiting_peer():
    with Controller(trainers=2, consumers=1) as controller, TrainerLink(controller.address) as t0, \
            TrainerLink(controller.address) as t1, ConsumerLink(controller.address) as c:
        t0.send(_trainer(0, "t0"))
        other = _trainer(1, "t1")
        t1.send(TrainerHello(rank=1, metadata=other.metadata, ring=other.ring, tensors={"w": TensorMeta(100, 4)},
                             parts=[PartMeta("w", 0, 100)]))
        with pytest.raises(ControlRefusedError, match="describes 'w'"):
            c.register(ConsumerHello(id="c", engine="e", agent="ca", needs=["w"]), timeout_s=10)
        for link in (t0, t1):
            with pytest.raises(ControlRefusedError, match="no plan"):
                link.receive(10)
    assert issubclass(ControlRefusedError, ConfigError)


def test_decode_bounds_size_before_parsing():
    with pytest.raises(ControlMessageError, match="at most"):
        decode_message(b"\x00" * (MAX_MESSAGE_BYTES + 1), _to_controller, where="test")
    assert issubclass(ControlMessageError, FormatError)
