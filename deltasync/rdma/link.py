"""A peer's side of the control plane: a trainer rank's link and a consumer's link to the controller."""

from __future__ import annotations

import logging
import time
from collections import defaultdict
from typing import TypeVar

from typing_extensions import Self

from deltasync.errors import ConfigError, ControlMessageError, ControlRefusedError, RdmaError, RdmaTimeoutError
from deltasync.rdma import auth
from deltasync.rdma.messages import (
    Applied,
    ConsumerHello,
    ConsumerPlan,
    EngineVersion,
    MetadataRequest,
    RankMetadata,
    Refused,
    StepReady,
    TrainerHello,
    TrainerPlan,
    decode_message,
    encoder,
    socket,
    to_peer,
    zmq,  # pyzmq, or the error that names the rdma extra
)
from deltasync.rdma.outbox import SlotInfo

log = logging.getLogger(__name__)

QUEUED = 1000  # ZMQ's default send high-water mark: messages queued for a controller before a send waits
SEND_WAIT_S = 5.0  # how long a send waits for room in that queue (a busy controller), once (a gone one)
MAX_ANNOUNCED = 1024  # steps a consumer keeps announcements of (and engines it keeps versions of): bounded


M = TypeVar("M")

class _Link:
    """A peer's connection to the controller as ``name`` (its CURVE key derives from ``secret`` and the name,
    see :mod:`deltasync.rdma.auth`): send a message, receive validated replies with a timeout."""

    def __init__(self, address: str, *, name: str, secret: str | None = None) -> None:
        key = auth.cluster_secret(secret, where=f"{name} at {address}")
        self._ctx = zmq.Context()
        self._sock = socket(self._ctx, zmq.DEALER)
        auth.connect_as(self._sock, key, name)
        self._sock.connect(address)
        self.address = address
        self._stalled = False  # the last send found no room: the next ones do not wait for it

    def send(self, message: object) -> None:
        """Queue ``message`` for the controller, waiting at most ``SEND_WAIT_S`` for room: a controller that went
        away (a crash, a partition) takes no more, and ZMQ would block a sender for ever once its queue is full
        (inside a publisher's commit, an engine's update). Then :class:`RdmaTimeoutError` (the caller falls back to
        the store), and at once for every later message until one is taken again."""
        data = encoder.encode(message)
        try:
            self._sock.send(data, zmq.NOBLOCK)
            self._stalled = False
            return
        except zmq.Again:
            pass
        if not self._stalled and self._sock.poll(int(SEND_WAIT_S * 1000), zmq.POLLOUT):  # a busy controller
            try:
                self._sock.send(data, zmq.NOBLOCK)
                return
            except zmq.Again:
                pass
        self._stalled = True
        raise RdmaTimeoutError(f"the controller at {self.address} takes no messages ({QUEUED} queued unsent: "
                               "gone or unreachable)")

    def pending(self, timeout_s: float) -> bool:
        """Whether a message is waiting, waiting up to ``timeout_s`` (millisecond resolution) for one."""
        return bool(self._sock.poll(max(int(timeout_s * 1000), 0)))

    def receive(self, timeout_s: float) -> object:
        """The next message; :class:`RdmaTimeoutError` if none comes, :class:`ControlRefusedError` on a refusal."""
        if not self._sock.poll(int(timeout_s * 1000)):
            raise RdmaTimeoutError(f"no message from the controller at {self.address} within {timeout_s:g} s")
        msg = decode_message(self._sock.recv(), to_peer, where=f"controller at {self.address}")
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
    """Trainer rank ``rank``'s side: register once (and again after a restart), then announce each offered step."""

    def __init__(self, address: str, *, rank: int, secret: str | None = None) -> None:
        super().__init__(address, name=auth.trainer_name(rank), secret=secret)
        self.rank = rank

    def register(self, hello: TrainerHello, *, timeout_s: float = 60.0) -> TrainerPlan:
        self.hello(hello)
        return self._expect(TrainerPlan, timeout_s)

    def hello(self, hello: TrainerHello) -> None:
        """Register without waiting for the plan (``poll`` picks it up later)."""
        if hello.rank != self.rank:
            raise ConfigError(f"trainer rank {self.rank}: a hello for rank {hello.rank} (a link speaks for one rank)")
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

    def _expect(self, kind: type[M], timeout_s: float) -> M:
        msg = self.receive(timeout_s)
        if not isinstance(msg, kind):
            raise ControlMessageError(f"controller at {self.address}: expected {kind.__name__}, got "
                                      f"{type(msg).__name__}")
        return msg


class ConsumerLink(_Link):
    """Consumer ``consumer_id``'s side: register, wait for a step's announcements, report applied steps,
    refetch metadata."""

    def __init__(self, address: str, *, consumer_id: str, secret: str | None = None) -> None:
        super().__init__(address, name=auth.consumer_name(consumer_id), secret=secret)
        self.id = consumer_id

    def register(self, hello: ConsumerHello, *, timeout_s: float = 60.0) -> ConsumerPlan:
        self.hello(hello)
        msg = self._next(timeout_s)
        if not isinstance(msg, ConsumerPlan):
            raise ControlMessageError(f"controller at {self.address}: expected ConsumerPlan, got {type(msg).__name__}")
        return msg

    def hello(self, hello: ConsumerHello) -> None:
        """Register without waiting for the plan (it arrives with ``poll``, as ``plan``)."""
        if hello.id != self.id:
            raise ConfigError(f"consumer {self.id!r}: a hello for {hello.id!r} (a link speaks for one consumer)")
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
        self.file(msg)
        return msg

    def file(self, msg: object) -> None:
        """Take in one validated message from the controller: an announcement (only from a rank of the plan,
        once a plan came; at most :data:`MAX_ANNOUNCED` steps and one slot per rank each), a version, a plan."""
        if isinstance(msg, StepReady):
            if self.ranks and msg.rank not in self.ranks:
                return  # not a rank this consumer reads
            if msg.slot.step in self._ready or len(self._ready) < MAX_ANNOUNCED:
                self._ready[msg.slot.step][msg.rank] = msg.slot
        elif isinstance(msg, EngineVersion):
            if msg.engine in self.versions or len(self.versions) < MAX_ANNOUNCED:
                self.versions[msg.engine] = max(msg.step, self.versions.get(msg.engine, -1))
        elif isinstance(msg, ConsumerPlan):
            self.plan = msg
            self.ranks = {r.source.rank for r in msg.reads}
