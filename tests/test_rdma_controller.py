"""The controller's protocol without NIXL: plans once from hellos, forwards announcements to the consumers
that read the announcing rank, advances an engine only when all its consumers applied, and answers hostile
or unexpected messages with a refusal while it keeps serving everyone else."""

from __future__ import annotations

import hashlib
import time
from concurrent.futures import ThreadPoolExecutor

import msgspec
import pytest
import zmq

from deltasync.errors import ConfigError, ControlMessageError, ControlRefusedError, FormatError, RdmaTimeoutError
from deltasync.rdma import auth
from deltasync.rdma.controller import MAX_APPLIED_RECORDS, Controller
from deltasync.rdma.link import ConsumerLink, TrainerLink
from deltasync.rdma.messages import (
    MAX_MESSAGE_BYTES,
    ConsumerHello,
    MetadataRequest,
    PartMeta,
    StepReady,
    TensorMeta,
    TrainerHello,
    decode_message,
    to_controller,
)
from deltasync.rdma.outbox import RingLayout, SlotInfo

TENSORS = {"w": TensorMeta(100, 2), "b": TensorMeta(10, 4)}
SECRET = "a-test-cluster-secret-of-more-than-32-characters"


def trainer_link(address: str, rank: int = 0, secret: str = SECRET) -> TrainerLink:
    return TrainerLink(address, rank=rank, secret=secret)


def consumer_link(address: str, consumer_id: str, secret: str = SECRET) -> ConsumerLink:
    return ConsumerLink(address, consumer_id=consumer_id, secret=secret)


def _ring(agent: str) -> RingLayout:
    return RingLayout(agent=agent, addr=1 << 20, device=0, mem_type="DRAM", slots=2, slot_bytes=4096, chunk_bytes=1024)


def _trainer(rank: int, agent: str) -> TrainerHello:
    return TrainerHello(rank=rank, metadata=b"nixl-metadata-" + agent.encode(), ring=_ring(agent), tensors=TENSORS,
                        parts=[PartMeta(n, 0, m.numel) for n, m in TENSORS.items()])


def _slot(agent: str, step: int) -> SlotInfo:
    return SlotInfo(agent=agent, step=step, slot=step % 2, offset=(step % 2) * 4096, length=10,
                    digest="sha256:" + hashlib.sha256(b"%d" % step).hexdigest(), generation=step)


@pytest.fixture
def controller():
    with Controller(trainers=1, consumers=2, secret=SECRET) as c:
        yield c


def test_plan_announce_and_engine_version_after_every_consumer(controller):
    with trainer_link(controller.address) as t, consumer_link(controller.address, "c0") as c0, \
            consumer_link(controller.address, "c1") as c1:
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


def raw_peer(ctx: zmq.Context, address: str, name: str, secret: str = SECRET) -> zmq.Socket:
    """A DEALER that speaks as ``name`` with the cluster's keys and sends whatever it likes."""
    raw = ctx.socket(zmq.DEALER)
    raw.setsockopt(zmq.LINGER, 0)
    auth.connect_as(raw, secret.encode(), name)
    raw.connect(address)
    return raw


def test_hostile_messages_are_refused_and_the_controller_keeps_serving(controller):
    ctx = zmq.Context()
    raw = raw_peer(ctx, controller.address, "consumer:c9")
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
        raw.send(msgspec.msgpack.encode({"type": "Applied", "id": "c9", "step": 3}))  # well-formed, but no plan
        assert raw.poll(10_000)
        assert "not that registered consumer" in msgspec.msgpack.decode(raw.recv())["reason"]
    finally:
        raw.close()
        ctx.term()
    with trainer_link(controller.address) as t:  # still serving
        t.send(_trainer(0, "trainer-a"))
        with pytest.raises(RdmaTimeoutError):  # no plan until both consumers said hello
            t.receive(0.3)


def test_inconsistent_metadata_refuses_every_waiting_peer():
    with Controller(trainers=2, consumers=1, secret=SECRET) as controller, trainer_link(controller.address) as t0, \
            trainer_link(controller.address, 1) as t1, consumer_link(controller.address, "c") as c:
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
        decode_message(b"\x00" * (MAX_MESSAGE_BYTES + 1), to_controller, where="test")
    assert issubclass(ControlMessageError, FormatError)


def _planned(controller):
    """A trainer and two consumers registered and planned: (trainer link, c0 link, c1 link)."""
    t, c0, c1 = trainer_link(controller.address), consumer_link(controller.address, "c0"), \
        consumer_link(controller.address, "c1")
    with ThreadPoolExecutor(3) as pool:
        waits = [pool.submit(c0.register, ConsumerHello(id="c0", engine="e", agent="agent-c0", needs=["w"])),
                 pool.submit(c1.register, ConsumerHello(id="c1", engine="e", agent="agent-c1", needs=["w"])),
                 pool.submit(t.register, _trainer(0, "trainer-a"))]
        for w in waits:
            w.result(30)
    return t, c0, c1


def test_a_process_without_the_secret_gets_nothing():
    with Controller(trainers=1, consumers=1, secret=SECRET) as controller:
        intruder = trainer_link(controller.address, secret="another-secret-of-more-than-32-characters!")
        try:
            intruder.send(_trainer(0, "intruder"))  # the handshake fails: nothing is delivered, nothing answered
            with pytest.raises(RdmaTimeoutError):
                intruder.receive(1.0)
        finally:
            intruder.close()
        assert controller._trainers == {}
        with consumer_link(controller.address, "c0") as c, trainer_link(controller.address) as t:
            c.hello(ConsumerHello(id="c0", engine="e", agent="agent-c0", needs=["w"]))
            assert t.register(_trainer(0, "trainer-a"), timeout_s=30).consumers == ["agent-c0"]


def test_every_message_must_come_from_the_key_of_the_name_it_speaks_for(controller):
    t, c0, c1 = _planned(controller)
    ctx = zmq.Context()
    as_c1 = raw_peer(ctx, controller.address, "consumer:c1")
    try:
        def refused(message) -> str:
            as_c1.send(msgspec.msgpack.encode(message))
            assert as_c1.poll(10_000)
            reply = msgspec.msgpack.decode(as_c1.recv())
            assert reply["type"] == "Refused", reply
            return reply["reason"]

        # a consumer re-registering as a planned trainer rank after the plan
        assert "not trainer:0's" in refused(_trainer(0, "evil"))
        # announcing for a rank, reporting for another consumer, taking over another consumer's id
        assert "not trainer:0's" in refused(StepReady(rank=0, slot=_slot("trainer-a", 5)))
        assert "not consumer:c0's" in refused({"type": "Applied", "id": "c0", "step": 7})
        assert "not consumer:c0's" in refused({"type": "ConsumerHello", "id": "c0", "engine": "e",
                                               "agent": "evil", "needs": ["w"]})
        # the real peers are untouched: announcements reach both consumers, the versions advance
        t.ready(_slot("trainer-a", 1))
        assert c0.wait_step(1, timeout_s=10) == {0: _slot("trainer-a", 1)}
        assert c1.wait_step(1, timeout_s=10) == {0: _slot("trainer-a", 1)}
        c0.applied(1)
        c1.applied(1)
        c0._next(10)
        assert controller.versions == {"e": 1} and controller._consumers["c0"][1].agent == "agent-c0"
        # c1 itself may come back (a restart), but only as planned: same engine
        assert "planned for another engine" in refused({"type": "ConsumerHello", "id": "c1", "engine": "other",
                                                        "agent": "agent-c1b", "needs": ["w"]})
    finally:
        as_c1.close()
        ctx.term()
        for link in (t, c0, c1):
            link.close()


def test_metadata_only_for_registered_consumers(controller):
    t, c0, c1 = _planned(controller)
    try:
        with consumer_link(controller.address, "c7") as stranger:  # holds the secret, never registered
            stranger.send(MetadataRequest(rank=0))
            with pytest.raises(ControlRefusedError, match="registered consumers only"):
                stranger.receive(10)
        t.send(MetadataRequest(rank=0))  # a trainer rank is no consumer either
        with pytest.raises(ControlRefusedError, match="registered consumers only"):
            t.receive(10)
        assert c0.fetch_metadata(0, timeout_s=10).ring.agent == "trainer-a"
    finally:
        for link in (t, c0, c1):
            link.close()


def test_per_peer_records_are_bounded(controller):
    t, c0, c1 = _planned(controller)
    try:
        for step in range(MAX_APPLIED_RECORDS + 500):
            c0.applied(step)
        deadline = time.monotonic() + 60
        # c0 and c1 are separate connections: c1's report may overtake c0's, so send it once c0's have landed
        while controller._latest.get("c0") != MAX_APPLIED_RECORDS + 499:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        c1.applied(MAX_APPLIED_RECORDS + 499)
        while controller.versions.get("e") != MAX_APPLIED_RECORDS + 499:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        assert len(controller.applied) == MAX_APPLIED_RECORDS
        assert ("c1", MAX_APPLIED_RECORDS + 499) in controller.applied
        assert set(controller._latest) == {"c0", "c1"}
    finally:
        for link in (t, c0, c1):
            link.close()


def test_a_secret_is_required_and_never_shown(monkeypatch):
    from deltasync.rdma.options import RdmaOptions

    monkeypatch.delenv(auth.SECRET_ENV, raising=False)
    with pytest.raises(ConfigError, match="set DELTASYNC_RDMA_SECRET"):
        Controller(trainers=1, consumers=1)
    with pytest.raises(ConfigError, match="set DELTASYNC_RDMA_SECRET"):
        trainer_link("tcp://127.0.0.1:1", secret=None)
    with pytest.raises(ConfigError, match="32 to 4096 characters, got 5 characters"):
        RdmaOptions(controller="tcp://h:1", secret="short")
    options = RdmaOptions(controller="tcp://h:1", secret=SECRET)
    assert SECRET not in repr(options)
    monkeypatch.setenv(auth.SECRET_ENV, SECRET)
    with Controller(trainers=1, consumers=0) as controller, TrainerLink(controller.address, rank=0) as t:
        assert t.register(_trainer(0, "trainer-a"), timeout_s=30).consumers == []
    assert auth.public_key(SECRET.encode(), "trainer:0") != auth.public_key(SECRET.encode() + b"x", "trainer:0")


def test_without_the_rdma_extra_the_error_names_it():
    import subprocess
    import sys

    code = ("import sys; sys.modules['zmq'] = None\n"
            "from deltasync.errors import MissingDependencyError\n"
            "try:\n    from deltasync.rdma.controller import Controller\n"
            "except MissingDependencyError as e:\n    print(e)\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and "install it with pip install 'deltasync[rdma]'" in r.stdout, r.stdout + r.stderr


def test_a_controller_that_went_away_never_blocks_a_peer():
    """A controller that planned and then went away (a crash, a partition) takes no more messages: ZMQ queues a
    thousand, then a blocking send would wait for ever: inside the publisher's commit announcement (every later
    commit), inside an engine's update (its pause). Each send beyond the queue is an ``RdmaTimeoutError`` at
    once; the callers fall back to the store (tests/test_transport_nixl.py)."""
    import threading

    controller = Controller(trainers=1, consumers=1, secret=SECRET)
    t, c = trainer_link(controller.address), consumer_link(controller.address, "c0")
    threads: list[threading.Thread] = []
    try:
        with ThreadPoolExecutor(2) as pool:
            fc = pool.submit(c.register, ConsumerHello(id="c0", engine="e", agent="agent-c0", needs=["w"]))
            assert pool.submit(t.register, _trainer(0, "trainer-a")).result(30).consumers == ["agent-c0"]
            fc.result(30)
        controller.close()
        outcome: dict[str, object] = {}

        def flood(name: str, send) -> None:  # noqa: ANN001 - a link's send of one step
            try:
                for step in range(5000):
                    send(step)
                outcome[name] = "all sent"
            except RdmaTimeoutError as e:
                outcome[name] = e

        threads += [threading.Thread(target=flood, args=("trainer", lambda s: t.ready(_slot("trainer-a", s))),
                                    daemon=True),
                   threading.Thread(target=flood, args=("consumer", c.applied), daemon=True)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(60)
        assert not any(thread.is_alive() for thread in threads), "a send blocked on a controller that went away"
        for name in ("trainer", "consumer"):
            assert isinstance(outcome[name], RdmaTimeoutError), outcome
            assert controller.address in str(outcome[name]) and "queued" in str(outcome[name])
    finally:
        controller.close()
        if not any(thread.is_alive() for thread in threads):  # a socket blocked in another thread is left be
            t.close()
            c.close()
