"""The controller: gathers metadata once, plans once, then per step only announces and counts.

At start each trainer rank sends ``TrainerHello`` (its NIXL metadata, its ring, the tensors and parts it holds)
and each consumer ``ConsumerHello`` (engine, agent, the checkpoint tensors it needs). Once all expected peers
said hello, :func:`deltasync.rdma.schedule.plan` runs once: each consumer gets ``ConsumerPlan`` (which ranks
to read, their rings and metadata), each rank ``TrainerPlan`` (the consumer agents whose acknowledgements free
its slots). Per step a rank sends ``StepReady`` (its ``SlotInfo``), forwarded to the consumers that read that
rank; consumers send ``Applied`` once the step is applied and verified (over RDMA or from the store), and an
engine's version advances (``EngineVersion``) only when every consumer of that engine applied the step. A
rank that restarts says hello again: its new metadata is served to consumers on ``MetadataRequest``. A
message that fails its checks (:mod:`deltasync.rdma.messages`) is answered ``Refused`` and otherwise ignored:
one bad peer never stops the controller.

Peers prove who they are (:mod:`deltasync.rdma.auth`): every connection is CurveZMQ under keys derived from
the cluster secret, and each message is accepted only from the key of the name it speaks for (``trainer:<rank>``
for a hello or an announcement of that rank, ``consumer:<id>`` for that consumer's hello and reports). Only a
registered consumer is answered metadata; a restart re-registers under the same name's key only; every
per-peer record is bounded (peers by the plan, the log of applied steps by :data:`MAX_APPLIED_RECORDS`).
"""

from __future__ import annotations

import logging
import threading
from collections import deque

from typing_extensions import Self

from deltasync.errors import ControlMessageError, ControlRefusedError, RdmaError, ScheduleError
from deltasync.rdma import auth
from deltasync.rdma.messages import (
    Applied,
    ConsumerHello,
    ConsumerPlan,
    EngineVersion,
    MetadataRequest,
    PartMeta,
    PlannedRead,
    RankMetadata,
    Refused,
    StepReady,
    TrainerHello,
    TrainerPlan,
    decode_message,
    encoder,
    socket,
    to_controller,
    zmq,  # pyzmq, or the error that names the rdma extra
)
from deltasync.rdma.schedule import (
    Consumer,
    Schedule,
    TensorInfo,
    TensorSlice,
    TrainerRank,
    plan,
)

log = logging.getLogger(__name__)

MAX_APPLIED_RECORDS = 10_000  # the controller's log of (consumer, step) arrivals, newest kept


class Controller:
    """Serve ``trainers`` ranks and ``consumers`` consumers on ``address`` from a background thread.

    ``address`` like ``tcp://127.0.0.1:0`` binds a free port; ``self.address`` is the bound one. ``secret``:
    the cluster secret every peer holds (default ``$DELTASYNC_RDMA_SECRET``; :class:`ConfigError` without
    one). ``versions`` maps each engine to the newest step all of its consumers applied; ``applied`` records
    (consumer, step) in arrival order (the newest :data:`MAX_APPLIED_RECORDS`).

    Example: ``with Controller("tcp://0.0.0.0:5555", trainers=8, consumers=16) as c: ...``
    """

    def __init__(self, address: str = "tcp://127.0.0.1:0", *, trainers: int, consumers: int,
                 secret: str | None = None) -> None:
        self.expected_trainers, self.expected_consumers = trainers, consumers
        self._secret = auth.cluster_secret(secret, where="controller")
        self._ctx = zmq.Context()
        self._sock = socket(self._ctx, zmq.ROUTER)
        try:
            self._auth = auth.serve(self._ctx, self._sock, self._secret)
            self._sock.bind(address)
        except BaseException:
            self._sock.close()
            stop = getattr(getattr(self, "_auth", None), "stop", None)
            if stop is not None:
                stop()
            self._ctx.term()
            raise
        self.address = self._sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self._trainers: dict[int, tuple[bytes, TrainerHello]] = {}
        self._consumers: dict[str, tuple[bytes, ConsumerHello]] = {}
        self.schedule: Schedule | None = None
        self.versions: dict[str, int] = {}
        self.applied: deque[tuple[str, int]] = deque(maxlen=MAX_APPLIED_RECORDS)
        self._latest: dict[str, int] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="deltasync-rdma-controller", daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
        self._sock.close()
        self._auth.stop()  # type: ignore[attr-defined]
        self._ctx.term()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _serve(self) -> None:
        while not self._stop.is_set():
            if not self._sock.poll(50):
                continue
            frames = self._sock.recv_multipart(copy=False)
            if len(frames) != 2:
                log.warning("controller: dropping a message of %d frames", len(frames))
                continue
            peer, frame = frames[0].bytes, frames[1]
            key = frame.get("User-Id")  # the sender's public key, as the CURVE handshake proved it
            try:
                msg = decode_message(frame.bytes, to_controller, where=f"controller: peer {peer.hex()}")
                self._check_sender(key, msg)  # type: ignore[arg-type]  # pyzmq: User-Id is a str property
                self._handle(peer, msg)
            except (ControlMessageError, ControlRefusedError, ScheduleError) as e:
                log.warning("%s", e)
                self._send(peer, Refused(reason=str(e)[:2000]))
            except Exception:  # a bug here must not silence the controller for every other peer
                log.exception("controller: failed to handle a message from %s", peer.hex())

    def _send(self, peer: bytes, message: object) -> None:
        self._sock.send_multipart([peer, encoder.encode(message)])

    def _check_sender(self, key: str, msg: object) -> None:
        """Refuse a message whose sender's key is not the key of the name it speaks for."""
        if isinstance(msg, (TrainerHello, StepReady)):
            name = auth.trainer_name(msg.rank)
        elif isinstance(msg, (ConsumerHello, Applied)):
            name = auth.consumer_name(msg.id)
        else:  # MetadataRequest: answered to registered consumers only (_handle)
            return
        if key != auth.public_key(self._secret, name):
            raise ControlRefusedError(f"controller: a {type(msg).__name__} for {name} from a peer whose key is not "
                                      f"{name}'s (expected the key the cluster secret gives {name})")

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
            if not any(known == peer for known, _ in self._consumers.values()):
                raise ControlRefusedError("controller: metadata is served to registered consumers only")
            if msg.rank not in self._trainers:
                raise ControlRefusedError(f"controller: no trainer rank {msg.rank} has registered")
            self._send(peer, _rank_metadata(self._trainers[msg.rank][1]))

    def _trainer_hello(self, peer: bytes, msg: TrainerHello) -> None:
        if self.schedule is not None and msg.rank not in self.schedule.rank_bytes:
            raise ControlRefusedError(f"controller: trainer rank {msg.rank} is not in the static schedule")
        if self.schedule is None and msg.rank not in self._trainers and len(self._trainers) == self.expected_trainers:
            raise ControlRefusedError(f"controller: already {self.expected_trainers} trainer ranks; {msg.rank} is one "
                                      "too many")
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
        if self.schedule is not None and msg.id not in self.schedule.engines.get(msg.engine, ()):
            raise ControlRefusedError(f"controller: consumer {msg.id!r} was planned for another engine than "
                                      f"{msg.engine!r}; it may come back only as it was planned")
        if self.schedule is None and msg.id not in self._consumers and len(self._consumers) == self.expected_consumers:
            raise ControlRefusedError(f"controller: already {self.expected_consumers} consumers; {msg.id!r} is one too "
                                      "many")
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
        log.info("controller: planned %d consumer(s) over %d trainer rank(s)", len(self._consumers),
                 len(self._trainers))
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
        ranks = [TrainerRank(r, h.ring.agent, tuple(TensorSlice(p.name, p.start, p.stop) for p in h.parts))
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
            raise ControlRefusedError(f"controller: {msg.id!r} reported step {msg.step} but is not that registered "
                                      "consumer")
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

