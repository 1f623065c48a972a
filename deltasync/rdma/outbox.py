"""The trainer's outbox: a registered ring of K slots holding encoded step objects for consumers to READ.

Pull by default: the trainer copies each step's object (the same bytes the store receives) into the next
slot and announces ``SlotInfo``; consumers READ it with prepared handles and their READ carries a
notification (``ds-ack <step> <slot> <generation>``) that NIXL delivers only once all of the read's bytes
have landed, which is the acknowledgement. A slot is reused only once every registered consumer
acknowledged it or its deadline passed, so a dead or slow consumer delays the trainer by at most
``ack_deadline_s``, and then falls back to the object store. Bytes in flight (announced, not yet acknowledged
by all, deadline not passed) are bounded by ``max_inflight_bytes``.

Slot layout: a 32-byte header ``(generation, step, length, 0)`` as little-endian u64, then the object. Every
offer takes a new generation (a counter over the whole ring), written first, so a reader that raced an
overwrite sees a different generation or a different digest and never applies a mix of two objects.
"""

from __future__ import annotations

import logging
import re
import struct
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Annotated

import msgspec
import numpy as np
import torch

from deltasync.errors import RdmaError, RingFullError
from deltasync.format import digest as digests
from deltasync.format.names import PEER_NAME, whole
from deltasync.rdma.agent import Agent, MemType

log = logging.getLogger(__name__)

HEADER = struct.Struct("<QQQQ")
MAX_SLOTS = 1024
ACK = re.compile(rb"ds-ack (\d{1,19}) (\d{1,4}) (\d{1,19})")

# fields come from peers (hostile): the controller decodes them with these bounds
AgentName = Annotated[str, msgspec.Meta(pattern=whole(PEER_NAME))]
U64 = Annotated[int, msgspec.Meta(ge=0, le=(1 << 63) - 1)]  # msgspec bounds fit an int64
Step = Annotated[int, msgspec.Meta(ge=0, le=10**12 - 1)]
SlotIndex = Annotated[int, msgspec.Meta(ge=0, lt=MAX_SLOTS)]
Digest = Annotated[str, msgspec.Meta(pattern=whole(digests.PREFIXED))]  # "blake3:<hex>", "sha256:<hex>"


class RingLayout(msgspec.Struct, frozen=True, kw_only=True):
    """Where a trainer's ring lives, as a consumer needs it to prepare its reads (plain data, sent at start)."""

    agent: AgentName
    addr: U64
    device: Annotated[int, msgspec.Meta(ge=0, lt=1 << 16)]
    mem_type: MemType
    slots: Annotated[int, msgspec.Meta(ge=1, le=MAX_SLOTS)]
    slot_bytes: Annotated[int, msgspec.Meta(gt=HEADER.size, le=1 << 40)]
    chunk_bytes: Annotated[int, msgspec.Meta(ge=1, le=1 << 40)]

    def check(self, where: str) -> None:
        """Raise :class:`RdmaError` unless the numbers describe a ring a consumer can read."""
        if self.slot_bytes % self.chunk_bytes or self.addr + self.slots * self.slot_bytes >= 1 << 63:
            raise RdmaError(f"{where}: invalid ring layout {self!r}")


class SlotInfo(msgspec.Struct, frozen=True, kw_only=True):
    """One step's object in a trainer's ring: what a consumer reads, and what it must find there."""

    agent: AgentName
    step: Step
    slot: SlotIndex
    offset: U64
    length: Annotated[int, msgspec.Meta(ge=0, le=1 << 40)]
    digest: Digest
    generation: U64

    def ack(self) -> bytes:
        return b"ds-ack %d %d %d" % (self.step, self.slot, self.generation)




@dataclass
class _Slot:
    generation: int = 0
    step: int = -1
    length: int = 0
    waiting: set[str] = field(default_factory=set)
    deadline: float = 0.0

    def busy(self, now: float) -> bool:
        return bool(self.waiting) and now < self.deadline


class Outbox:
    """A ring of ``slots`` slots of ``slot_bytes`` each, registered once on ``agent``; see the module doc.

    ``set_consumers`` names the consumer agents whose acknowledgement frees a slot (the controller hands them
    out). Call ``poll`` now and then, or rely on ``offer``, which polls while it waits for a slot.
    """

    def __init__(self, agent: Agent, *, slots: int = 4, slot_bytes: int = 64 << 20, chunk_bytes: int = 1 << 20,
                 max_inflight_bytes: int | None = None, ack_deadline_s: float = 10.0, device: str = "cpu") -> None:
        if not 1 <= slots <= MAX_SLOTS or chunk_bytes <= 0 or slot_bytes % chunk_bytes or slot_bytes <= HEADER.size:
            raise ValueError(f"slots={slots}, slot_bytes={slot_bytes}, chunk_bytes={chunk_bytes}: need 1..{MAX_SLOTS} "
                             f"slots of a whole number of chunks, larger than the {HEADER.size}-byte header")
        self.agent = agent
        self.slot_bytes, self.chunk_bytes = slot_bytes, chunk_bytes
        self.max_inflight_bytes = max_inflight_bytes if max_inflight_bytes is not None else slots * slot_bytes
        self.ack_deadline_s = ack_deadline_s
        self._buffer = torch.zeros(slots * slot_bytes, dtype=torch.uint8, device=device)
        self.region = agent.register(self._buffer)
        self._slots = [_Slot() for _ in range(slots)]
        self._next = 0
        self._generation = 0
        self._consumers: frozenset[str] = frozenset()
        self.expired: list[tuple[int, frozenset[str]]] = []  # (step, consumers that never acknowledged it)

    @property
    def capacity(self) -> int:
        """The largest object a slot holds."""
        return self.slot_bytes - HEADER.size

    def layout(self) -> RingLayout:
        r = self.region
        return RingLayout(agent=self.agent.name, addr=r.addr, device=r.device, mem_type=r.mem_type,
                          slots=len(self._slots), slot_bytes=self.slot_bytes, chunk_bytes=self.chunk_bytes)

    def set_consumers(self, agents: Iterable[str]) -> None:
        """The consumer agents that read this ring from now on (slots already offered keep their waiters)."""
        self._consumers = frozenset(agents)

    def in_flight_bytes(self, now: float | None = None) -> int:
        now = time.monotonic() if now is None else now
        return sum(s.length for s in self._slots if s.busy(now))

    def poll(self) -> None:
        """Take in acknowledgements (READ notifications); ones for an overwritten generation are ignored."""
        for sender, messages in self.agent.notifications().items():
            for message in messages:
                m = ACK.fullmatch(message)
                if m is None:
                    log.warning("%s: ignoring an unexpected notification from %r (%d bytes)", self.agent.name, sender,
                                len(message))
                    continue
                _step, slot, generation = map(int, m.groups())
                if slot < len(self._slots) and self._slots[slot].generation == generation:
                    self._slots[slot].waiting.discard(sender)

    def offer(self, step: int, data: bytes | bytearray | memoryview, *, digest: str | None = None) -> SlotInfo:
        """Copy ``data`` (a step's encoded object) into the next slot and return what to announce.

        ``digest``: ``data``'s prefixed digest when the caller has it (the manifest's: the publisher hashed the object
        while writing it), announced as is; consumers check the bytes they read against it, so a wrong one
        only sends them to the store.

        Waits, polling acknowledgements, until the slot is free and the watermark admits ``data``: at most
        ``ack_deadline_s``, since a slot's deadline frees it from consumers that never acknowledged.
        Raises :class:`RingFullError` when ``data`` is larger than a slot.
        """
        view = memoryview(data).cast("B")
        if view.nbytes > self.capacity:
            raise RingFullError(f"{self.agent.name}: step {step} object is {view.nbytes} bytes, a ring slot holds "
                                f"{self.capacity}; this step goes through the store only")
        index = self._next
        slot = self._slots[index]
        pause = 1e-4
        while True:
            self.poll()
            now = time.monotonic()
            others = self.in_flight_bytes(now) - (slot.length if slot.busy(now) else 0)
            if not slot.busy(now) and others + view.nbytes <= self.max_inflight_bytes:
                break
            time.sleep(pause)
            pause = min(pause * 2, 5e-3)
        if slot.waiting:
            self.expired.append((slot.step, frozenset(slot.waiting)))
            log.warning("%s: slot %d reused for step %d; step %d was never acknowledged by %s (deadline passed)",
                        self.agent.name, index, step, slot.step, sorted(slot.waiting))
        self._generation += 1
        offset = index * self.slot_bytes
        raw = self._buffer[offset:offset + self.slot_bytes]
        # the new generation goes in first: a reader racing this write sees it, or a different digest
        _write(raw[:HEADER.size], HEADER.pack(self._generation, step, 0, 0))
        _write(raw[HEADER.size:HEADER.size + view.nbytes], view)
        _write(raw[:HEADER.size], HEADER.pack(self._generation, step, view.nbytes, 0))
        slot.generation, slot.step, slot.length = self._generation, step, view.nbytes
        slot.waiting = set(self._consumers)
        slot.deadline = time.monotonic() + self.ack_deadline_s
        self._next = (index + 1) % len(self._slots)
        return SlotInfo(agent=self.agent.name, step=step, slot=index, offset=offset, length=view.nbytes,
                        digest=digest or digests.compute(view, digests.write_algorithm()),
                        generation=self._generation)

    def close(self) -> None:
        """Nothing of its own to release: the agent deregisters the ring when it closes."""
        self._consumers = frozenset()


def _write(dst: torch.Tensor, data: bytes | memoryview) -> None:
    """Copy bytes into a slice of the (registered) ring buffer, on the host or on a device."""
    if dst.is_cpu:
        dst.numpy()[:] = np.frombuffer(data, np.uint8)
    else:
        dst.copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))
