"""The controller: gathers metadata once, plans once, then per step only announces and counts.

Control messages travel over ZMQ (a ROUTER here, a DEALER per trainer rank and per consumer) as msgpack
encoded msgspec structs. Every message comes from a peer and is decoded as hostile input: its size is
bounded before decoding, its fields are typed and range-checked, and one that fails is answered with
``Refused`` and otherwise ignored (one bad peer never stops the controller).

At start each trainer rank sends ``TrainerHello`` (its NIXL metadata, its ring, the tensors and parts it holds)
and each consumer ``ConsumerHello`` (engine, agent, the checkpoint tensors it needs). Once all expected peers
said hello, :func:`deltasync.rdma.schedule.plan` runs once: each consumer gets ``ConsumerPlan`` (which ranks
to read, their rings and metadata), each rank ``TrainerPlan`` (the consumer agents whose acknowledgements free
its slots). Per step a rank sends ``StepReady`` (its ``SlotInfo``), forwarded to the consumers that read that
rank; consumers send ``Applied`` once the step is applied and verified (over RDMA or from the store), and an
engine's version advances (``EngineVersion``) only when every consumer of that engine applied the step. A
rank that restarts says hello again: its new metadata is served to consumers on ``MetadataRequest``.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import defaultdict
from typing import Annotated

import msgspec
import zmq
from typing_extensions import Self

from deltasync.errors import (
    ControlMessageError,
    ControlRefusedError,
    RdmaError,
    RdmaTimeoutError,
    ScheduleError,
)
from deltasync.format.names import PEER_NAME, whole
from deltasync.rdma.outbox import AgentName, RingLayout, SlotInfo, Step
from deltasync.rdma.schedule import (
    Consumer,
    Part,
    Schedule,
    TensorInfo,
    TrainerRank,
    plan,
)

log = logging.getLogger(__name__)

MAX_MESSAGE_BYTES = 16 << 20  # a hello carries NIXL metadata (KBs) and a tensor list (~100 B per tensor)
MAX_TENSORS = 100_000
Name = Annotated[str, msgspec.Meta(pattern=whole(PEER_NAME))]
TensorName = Annotated[str, msgspec.Meta(min_length=1, max_length=1024)]
Rank = Annotated[int, msgspec.Meta(ge=0, lt=1 << 20)]
Count = Annotated[int, msgspec.Meta(ge=0, le=1 << 42)]
Metadata = Annotated[bytes, msgspec.Meta(min_length=1, max_length=8 << 20)]






# --- messages: peers -> controller ---


class TensorMeta(msgspec.Struct, frozen=True, array_like=True):
    numel: Count
    itemsize: Annotated[int, msgspec.Meta(ge=1, le=16)]


class PartMeta(msgspec.Struct, frozen=True, array_like=True):
    name: TensorName
    start: Count
    stop: Count


class TrainerHello(msgspec.Struct, frozen=True, kw_only=True, tag=True):
    rank: Rank
    metadata: Metadata
    ring: RingLayout
    tensors: Annotated[dict[TensorName, TensorMeta], msgspec.Meta(max_length=MAX_TENSORS)]
    parts: Annotated[list[PartMeta], msgspec.Meta(max_length=MAX_TENSORS)]


class ConsumerHello(msgspec.Struct, frozen=True, kw_only=True, tag=True):
    id: Name
    engine: Name
    agent: AgentName
    needs: Annotated[list[TensorName], msgspec.Meta(max_length=MAX_TENSORS)]
    everything: bool = False  # needs every tensor the trainer ranks hold (a whole-model consumer)


class StepReady(msgspec.Struct, frozen=True, kw_only=True, tag=True):
    rank: Rank
    slot: SlotInfo


class Applied(msgspec.Struct, frozen=True, kw_only=True, tag=True):
    id: Name
    step: Step


class MetadataRequest(msgspec.Struct, frozen=True, kw_only=True, tag=True):
    rank: Rank


# --- messages: controller -> peers ---


class TrainerPlan(msgspec.Struct, frozen=True, kw_only=True, tag=True):
    consumers: Annotated[list[AgentName], msgspec.Meta(max_length=1 << 16)]


class RankMetadata(msgspec.Struct, frozen=True, kw_only=True, tag=True):
    rank: Rank
    ring: RingLayout
    metadata: Metadata


class PlannedRead(msgspec.Struct, frozen=True, kw_only=True):
    source: RankMetadata
    parts: Annotated[list[PartMeta], msgspec.Meta(max_length=MAX_TENSORS)]


class ConsumerPlan(msgspec.Struct, frozen=True, kw_only=True, tag=True):
    reads: Annotated[list[PlannedRead], msgspec.Meta(max_length=1 << 16)]


class EngineVersion(msgspec.Struct, frozen=True, kw_only=True, tag=True):
    engine: Name
    step: Step


class Refused(msgspec.Struct, frozen=True, kw_only=True, tag=True):
    reason: Annotated[str, msgspec.Meta(max_length=2000)]


ToController = TrainerHello | ConsumerHello | StepReady | Applied | MetadataRequest
ToPeer = TrainerPlan | ConsumerPlan | RankMetadata | StepReady | EngineVersion | Refused
_encoder = msgspec.msgpack.Encoder()
_to_controller = msgspec.msgpack.Decoder(ToController)
_to_peer = msgspec.msgpack.Decoder(ToPeer)


def decode_message(frame: bytes, decoder: msgspec.msgpack.Decoder, *, where: str) -> object:
    """One control message, validated; :class:`ControlMessageError` naming ``where`` otherwise."""
    if len(frame) > MAX_MESSAGE_BYTES:
        raise ControlMessageError(f"{where}: {len(frame)} bytes, expected at most {MAX_MESSAGE_BYTES}")
    try:
        return decoder.decode(frame)
    except (msgspec.ValidationError, msgspec.DecodeError) as e:
        raise ControlMessageError(f"{where}: invalid control message: {e}") from None


def _socket(ctx: zmq.Context, kind: int) -> zmq.Socket:
    sock = ctx.socket(kind)
    sock.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES + 1024)  # larger frames are dropped by ZMQ itself
    sock.setsockopt(zmq.LINGER, 0)
    return sock


class Controller:
    """Serve ``trainers`` ranks and ``consumers`` consumers on ``address`` from a background thread.

    ``address`` like ``tcp://127.0.0.1:0`` binds a free port; ``self.address`` is the bound one. ``versions``
    maps each engine to the newest step all of its consumers applied; ``applied`` records (consumer, step) in
    arrival order.
    """

    def __init__(self, address: str = "tcp://127.0.0.1:0", *, trainers: int, consumers: int) -> None:
        self.expected_trainers, self.expected_consumers = trainers, consumers
        self._ctx = zmq.Context()
        self._sock = _socket(self._ctx, zmq.ROUTER)
        self._sock.bind(address)
        self.address = self._sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self._trainers: dict[int, tuple[bytes, TrainerHello]] = {}
        self._consumers: dict[str, tuple[bytes, ConsumerHello]] = {}
        self.schedule: Schedule | None = None
        self.versions: dict[str, int] = {}
        self.applied: list[tuple[str, int]] = []
        self._latest: dict[str, int] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="deltasync-rdma-controller", daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
        self._sock.close()
        self._ctx.term()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _serve(self) -> None:
        while not self._stop.is_set():
            if not self._sock.poll(50):
                continue
            frames = self._sock.recv_multipart()
            if len(frames) != 2:
                log.warning("controller: dropping a message of %d frames", len(frames))
                continue
            peer, frame = frames
            try:
                self._handle(peer, decode_message(frame, _to_controller, where=f"controller: peer {peer.hex()}"))
            except (ControlMessageError, ControlRefusedError, ScheduleError) as e:
                log.warning("%s", e)
                self._send(peer, Refused(reason=str(e)[:2000]))
            except Exception:  # a bug here must not silence the controller for every other peer
                log.exception("controller: failed to handle a message from %s", peer.hex())

    def _send(self, peer: bytes, message: object) -> None:
        self._sock.send_multipart([peer, _encoder.encode(message)])

    def _handle(self, peer: bytes, msg: object) -> None:
        if isinstance(msg, TrainerHello):
            self._trainer_hello(peer, msg)
        elif isinstance(msg, ConsumerHello):
            self._consumer_hello(peer, msg)
        elif isinstance(msg, StepReady):
            self._step_ready(peer, msg)
        elif isinstance(msg, Applied):
            self._applied(peer, msg)
        elif isinstance(msg, MetadataRequest):
            if msg.rank not in self._trainers:
                raise ControlRefusedError(f"controller: no trainer rank {msg.rank} has registered")
            self._send(peer, _rank_metadata(self._trainers[msg.rank][1]))

    def _trainer_hello(self, peer: bytes, msg: TrainerHello) -> None:
        if self.schedule is not None and msg.rank not in self.schedule.rank_bytes:
            raise ControlRefusedError(f"controller: trainer rank {msg.rank} is not in the static schedule")
        if self.schedule is None and msg.rank not in self._trainers and len(self._trainers) == self.expected_trainers:
            raise ControlRefusedError(f"controller: already {self.expected_trainers} trainer ranks; {msg.rank} is one too many")
        try:
            msg.ring.check(f"controller: trainer rank {msg.rank}")
        except RdmaError as e:
            raise ControlRefusedError(str(e)) from None
        restarted = msg.rank in self._trainers
        self._trainers[msg.rank] = (peer, msg)
        log.info("controller: trainer rank %d %s as agent %s", msg.rank, "re-registered" if restarted else "registered",
                 msg.ring.agent)
        if self.schedule is None:
            self._maybe_plan()
        else:
            self._send(peer, self._trainer_plan(msg.rank))

    def _consumer_hello(self, peer: bytes, msg: ConsumerHello) -> None:
        if self.schedule is not None and msg.id not in self.schedule.reads:
            raise ControlRefusedError(f"controller: consumer {msg.id!r} is not in the static schedule")
        if self.schedule is None and msg.id not in self._consumers and len(self._consumers) == self.expected_consumers:
            raise ControlRefusedError(f"controller: already {self.expected_consumers} consumers; {msg.id!r} is one too many")
        self._consumers[msg.id] = (peer, msg)
        if self.schedule is None:
            self._maybe_plan()
            return
        self._send(peer, self._consumer_plan(msg.id))
        for read in self.schedule.reads[msg.id]:  # its agent may be new: the ranks it reads must know
            self._send(self._trainers[read.rank][0], self._trainer_plan(read.rank))

    def _maybe_plan(self) -> None:
        if len(self._trainers) < self.expected_trainers or len(self._consumers) < self.expected_consumers:
            return
        try:
            self.schedule = self._plan()
        except ScheduleError as e:  # every peer waits for a plan: each hears why there is none
            log.error("%s", e)
            for peer, _ in [*self._trainers.values(), *self._consumers.values()]:
                self._send(peer, Refused(reason=f"no plan: {e}"[:2000]))
            return
        log.info("controller: planned %d consumer(s) over %d trainer rank(s)", len(self._consumers), len(self._trainers))
        for rank, (peer, _) in self._trainers.items():
            self._send(peer, self._trainer_plan(rank))
        for cid, (peer, _) in self._consumers.items():
            self._send(peer, self._consumer_plan(cid))

    def _plan(self) -> Schedule:
        tensors: dict[str, TensorInfo] = {}
        for rank, (_, hello) in sorted(self._trainers.items()):
            for name, meta in hello.tensors.items():
                info = TensorInfo(meta.numel, meta.itemsize)
                if tensors.setdefault(name, info) != info:
                    raise ScheduleError(f"trainer rank {rank} describes {name!r} as {info}, another rank as "
                                        f"{tensors[name]}")
        ranks = [TrainerRank(r, h.ring.agent, tuple(Part(p.name, p.start, p.stop) for p in h.parts))
                 for r, (_, h) in sorted(self._trainers.items())]
        consumers = [Consumer(c.id, c.engine, frozenset(tensors) if c.everything else frozenset(c.needs))
                     for _, c in self._consumers.values()]
        return plan(tensors, ranks, consumers)

    def _trainer_plan(self, rank: int) -> TrainerPlan:
        assert self.schedule is not None
        agents = sorted({self._consumers[cid][1].agent for cid, reads in self.schedule.reads.items()
                         if cid in self._consumers and any(r.rank == rank for r in reads)})
        return TrainerPlan(consumers=agents)

    def _consumer_plan(self, cid: str) -> ConsumerPlan:
        assert self.schedule is not None
        return ConsumerPlan(reads=[
            PlannedRead(source=_rank_metadata(self._trainers[r.rank][1]),
                        parts=[PartMeta(p.name, p.start, p.stop) for p in r.parts])
            for r in self.schedule.reads[cid]])

    def _step_ready(self, peer: bytes, msg: StepReady) -> None:
        known = self._trainers.get(msg.rank)
        if known is None or known[0] != peer or known[1].ring.agent != msg.slot.agent or self.schedule is None:
            raise ControlRefusedError(f"controller: step {msg.slot.step} announced for rank {msg.rank} by a peer that "
                                      "is not its registered trainer (or before the plan)")
        for cid, reads in self.schedule.reads.items():
            if cid in self._consumers and any(r.rank == msg.rank for r in reads):
                self._send(self._consumers[cid][0], msg)

    def _applied(self, peer: bytes, msg: Applied) -> None:
        known = self._consumers.get(msg.id)
        if known is None or known[0] != peer or self.schedule is None:
            raise ControlRefusedError(f"controller: {msg.id!r} reported step {msg.step} but is not that registered consumer")
        if msg.step <= self._latest.get(msg.id, -1):
            return  # a repeat, or an older step applied late: versions never go back
        self._latest[msg.id] = msg.step
        self.applied.append((msg.id, msg.step))
        engine = known[1].engine
        members = self.schedule.engines[engine]
        version = min(self._latest.get(cid, -1) for cid in members)
        if version > self.versions.get(engine, -1):
            self.versions[engine] = version
            log.info("controller: engine %s at step %d (all %d consumers applied it)", engine, version, len(members))
            for cid in members:
                if cid in self._consumers:
                    self._send(self._consumers[cid][0], EngineVersion(engine=engine, step=version))


def _rank_metadata(hello: TrainerHello) -> RankMetadata:
    return RankMetadata(rank=hello.rank, ring=hello.ring, metadata=hello.metadata)


class _Link:
    """A peer's connection to the controller: send a message, receive validated replies with a timeout."""

    def __init__(self, address: str) -> None:
        self._ctx = zmq.Context()
        self._sock = _socket(self._ctx, zmq.DEALER)
        self._sock.connect(address)
        self.address = address

    def send(self, message: object) -> None:
        self._sock.send(_encoder.encode(message))

    def pending(self, timeout_s: float) -> bool:
        """Whether a message is waiting, waiting up to ``timeout_s`` (millisecond resolution) for one."""
        return bool(self._sock.poll(max(int(timeout_s * 1000), 0)))

    def receive(self, timeout_s: float) -> object:
        """The next message; :class:`RdmaTimeoutError` if none comes, :class:`ControlRefusedError` on a refusal."""
        if not self._sock.poll(int(timeout_s * 1000)):
            raise RdmaTimeoutError(f"no message from the controller at {self.address} within {timeout_s:g} s")
        msg = decode_message(self._sock.recv(), _to_peer, where=f"controller at {self.address}")
        if isinstance(msg, Refused):
            raise ControlRefusedError(f"controller at {self.address} refused: {msg.reason}")
        return msg

    def close(self) -> None:
        self._sock.close()
        self._ctx.term()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class TrainerLink(_Link):
    """A trainer rank's side: register once (and again after a restart), then announce each offered step."""

    def register(self, hello: TrainerHello, *, timeout_s: float = 60.0) -> TrainerPlan:
        self.hello(hello)
        return self._expect(TrainerPlan, timeout_s)

    def hello(self, hello: TrainerHello) -> None:
        """Register without waiting for the plan (``poll`` picks it up later)."""
        self.rank = hello.rank
        self.send(hello)

    def poll(self) -> list[str] | None:
        """Take every waiting message without blocking; the newest consumer list if one came.

        A refusal (a step announced before the plan, say) is logged: the trainer goes on, consumers read the
        store."""
        newest = None
        while True:
            try:
                msg = self.receive(0.0)
            except RdmaTimeoutError:
                return newest
            except (ControlRefusedError, ControlMessageError) as e:
                log.warning("trainer rank %d: %s", self.rank, e)
                continue
            if isinstance(msg, TrainerPlan):
                newest = msg.consumers

    def ready(self, slot: SlotInfo) -> None:
        self.send(StepReady(rank=self.rank, slot=slot))

    def consumers(self, timeout_s: float = 0.0) -> list[str] | None:
        """A newer consumer list, if the controller sent one (a consumer re-registered)."""
        try:
            return self._expect(TrainerPlan, timeout_s).consumers
        except RdmaTimeoutError:
            return None

    def _expect(self, kind: type, timeout_s: float) -> TrainerPlan:
        msg = self.receive(timeout_s)
        if not isinstance(msg, kind):
            raise ControlMessageError(f"controller at {self.address}: expected {kind.__name__}, got {type(msg).__name__}")
        return msg


class ConsumerLink(_Link):
    """A consumer's side: register, wait for a step's announcements, report applied steps, refetch metadata."""

    def register(self, hello: ConsumerHello, *, timeout_s: float = 60.0) -> ConsumerPlan:
        self.hello(hello)
        msg = self._next(timeout_s)
        if not isinstance(msg, ConsumerPlan):
            raise ControlMessageError(f"controller at {self.address}: expected ConsumerPlan, got {type(msg).__name__}")
        return msg

    def hello(self, hello: ConsumerHello) -> None:
        """Register without waiting for the plan (it arrives with ``poll``, as ``plan``)."""
        self.id = hello.id
        self.versions: dict[str, int] = {}
        self._ready: dict[int, dict[int, SlotInfo]] = defaultdict(dict)
        self.ranks: set[int] = set()
        self.plan: ConsumerPlan | None = None
        self.send(hello)

    def poll(self) -> None:
        """Take every waiting message without blocking (plans, announcements, versions); refusals are logged."""
        while True:
            try:
                self._next(0.0)
            except RdmaTimeoutError:
                return
            except (ControlRefusedError, ControlMessageError) as e:
                log.warning("%s: %s", self.id, e)

    def announced(self, step: int) -> SlotInfo | None:
        """``step``'s slot, once every planned rank announced it (the first rank's: ranks serve one object)."""
        got = self._ready.get(step, {})
        if not self.ranks or len(got) < len(self.ranks):
            return None
        return got[min(got)]

    def forget_through(self, step: int) -> None:
        """Drop announcements of ``step`` and older (handled; keeps the bounded table free for new ones)."""
        for old in [s for s in self._ready if s <= step]:
            del self._ready[old]

    def newest_announced(self) -> int | None:
        """The newest step every planned rank announced."""
        full = [s for s, got in self._ready.items() if self.ranks and len(got) >= len(self.ranks)]
        return max(full) if full else None

    def wait_step(self, step: int, *, timeout_s: float) -> dict[int, SlotInfo]:
        """Every planned rank's ``SlotInfo`` for ``step``. :class:`RdmaTimeoutError` when one does not come
        in time (a lost announcement); :class:`RdmaError` when a later step was announced instead."""
        deadline = time.monotonic() + timeout_s
        while len(self._ready.get(step, {})) < len(self.ranks):
            later = [s for s in self._ready if s > step and len(self._ready[s]) == len(self.ranks)]
            if later:
                raise RdmaError(f"{self.id}: step {step} was not announced by every rank; step {min(later)} was")
            left = deadline - time.monotonic()
            if left <= 0:
                raise RdmaTimeoutError(f"{self.id}: step {step} not announced within {timeout_s:g} s")
            self._next(left)
        got = self._ready.pop(step)
        for older in [s for s in self._ready if s < step]:
            del self._ready[older]
        return got

    def applied(self, step: int) -> None:
        self.send(Applied(id=self.id, step=step))

    def fetch_metadata(self, rank: int, *, timeout_s: float = 10.0) -> RankMetadata:
        """The rank's current metadata and ring (after a trainer restart: its new agent)."""
        self.send(MetadataRequest(rank=rank))
        deadline = time.monotonic() + timeout_s
        while True:
            msg = self._next(max(deadline - time.monotonic(), 0.0))
            if isinstance(msg, RankMetadata) and msg.rank == rank:
                return msg

    def _next(self, timeout_s: float) -> object:
        """Receive one message, filing announcements and versions as they pass."""
        msg = self.receive(timeout_s)
        if isinstance(msg, StepReady):
            if len(self._ready) < 1024:  # bounded: a flood of announcements cannot grow memory
                self._ready[msg.slot.step][msg.rank] = msg.slot
        elif isinstance(msg, EngineVersion):
            self.versions[msg.engine] = msg.step
        elif isinstance(msg, ConsumerPlan):
            self.plan = msg
            self.ranks = {r.source.rank for r in msg.reads}
        return msg
