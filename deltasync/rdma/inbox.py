"""The consumer's inbox: READ an announced ring slot into one registered local buffer and check it.

A read uses descriptor lists prepared once per trainer ring (the ring cut into ``chunk_bytes`` chunks, the
local buffer likewise), picks the chunks covering the slot's header and object, and waits with a timeout. The
bytes are accepted only when the slot header's generation, step and length equal the announcement's and the
object's SHA-256 equals the announced one; anything else raises a :class:`~deltasync.rdma.agent.RdmaError`
subclass and the caller reads the step from the object store instead. Nothing is applied from an unchecked
read. The read's notification is the acknowledgement that frees the slot on the trainer (outbox.py).
"""

from __future__ import annotations

import hashlib
import logging
import math
from dataclasses import dataclass

import numpy as np
import torch

from deltasync.errors import RdmaError, StaleMetadataError, StaleSlotError
from deltasync.rdma.agent import Agent, PreparedSide, Region
from deltasync.rdma.outbox import HEADER, RingLayout, SlotInfo

log = logging.getLogger(__name__)


@dataclass
class _Ring:
    layout: RingLayout
    local: PreparedSide
    remote: PreparedSide


class Inbox:
    """One registered buffer of ``capacity_bytes`` on ``agent``, and the trainer rings connected to it.

    A returned view aliases the buffer: it is valid until the next ``read`` (copy it to keep it).
    """

    def __init__(self, agent: Agent, *, capacity_bytes: int = 64 << 20, device: str = "cpu") -> None:
        self.agent = agent
        self._buffer = torch.zeros(capacity_bytes, dtype=torch.uint8, device=device)
        self.region = agent.register(self._buffer)
        self._rings: dict[str, _Ring] = {}

    def connect(self, layout: RingLayout, metadata: bytes) -> None:
        """Load a trainer's metadata and prepare reads of its ring (again, if that agent restarted)."""
        layout.check(f"ring of {layout.agent!r}")
        self.disconnect(layout.agent)
        name = self.agent.add_remote(metadata)
        if name != layout.agent:
            self.agent.remove_remote(name)
            raise StaleMetadataError(f"metadata is for agent {name!r}, the ring layout names {layout.agent!r}")
        chunk = layout.chunk_bytes
        local_bytes = self.region.nbytes - self.region.nbytes % chunk
        remote_chunks = self.agent.prepare(_ring_chunks(layout), layout.mem_type, remote=name)
        local_chunks = self.agent.prepare(self.region.chunks(chunk, nbytes=local_bytes), self.region.mem_type)
        self._rings[name] = _Ring(layout, local_chunks, remote_chunks)
        log.info("%s: connected to ring of %s (%d slots of %d bytes)", self.agent.name, name, layout.slots,
                 layout.slot_bytes)

    def disconnect(self, agent: str) -> None:
        ring = self._rings.pop(agent, None)
        if ring is not None:
            self.agent.release(ring.local)
            self.agent.release(ring.remote)
        self.agent.remove_remote(agent)

    def connected(self) -> list[str]:
        return list(self._rings)

    def read(self, info: SlotInfo, *, timeout_s: float = 10.0) -> memoryview:
        """The announced object's bytes, checked; raises an ``RdmaError`` subclass when they cannot be had."""
        where = self.transfer(info, timeout_s=timeout_s)
        return self._checked(info, where)

    def transfer(self, info: SlotInfo, *, timeout_s: float = 10.0) -> str:
        """Only the READ of the slot into the buffer, nothing checked (what a raw transfer costs: benchmarks)."""
        where = f"{self.agent.name}: step {info.step} from {info.agent} slot {info.slot}"
        ring = self._rings.get(info.agent)
        if ring is None:
            raise StaleMetadataError(f"{where}: no metadata for {info.agent!r} (connected: {sorted(self._rings)}); "
                                     "the trainer restarted or was never connected")
        lay = ring.layout
        if info.slot >= lay.slots or info.offset != info.slot * lay.slot_bytes:
            raise RdmaError(f"{where}: slot {info.slot} at offset {info.offset} is not in a ring of {lay.slots} "
                            f"slots of {lay.slot_bytes} bytes")
        total = HEADER.size + info.length
        if total > lay.slot_bytes or total > ring.local.count * lay.chunk_bytes:
            raise RdmaError(f"{where}: {info.length} bytes do not fit a slot ({lay.slot_bytes}) or this inbox "
                            f"({ring.local.count * lay.chunk_bytes})")
        count = math.ceil(total / lay.chunk_bytes)
        first = info.slot * (lay.slot_bytes // lay.chunk_bytes)
        self.agent.read(ring.local, list(range(count)), ring.remote, list(range(first, first + count)),
                        notif=info.ack(), timeout_s=timeout_s, where=where)
        return where

    def _checked(self, info: SlotInfo, where: str) -> memoryview:
        total = HEADER.size + info.length
        data = self._buffer[:total]
        if not data.is_cpu:
            data = data.cpu()  # checked on the host; a GPU consumer would hash on the device (docs/RDMA.md)
        raw = memoryview(data.numpy())
        generation, step, length, _ = HEADER.unpack(raw[:HEADER.size])
        if (generation, step, length) != (info.generation, info.step, info.length):
            raise StaleSlotError(f"{where}: slot holds generation {generation} (step {step}, {length} bytes), "
                                 f"announced generation {info.generation} (step {info.step}, {info.length} bytes): "
                                 "overwritten")
        body = raw[HEADER.size:total]
        digest = hashlib.sha256(body).hexdigest()
        if digest != info.sha256:
            raise StaleSlotError(f"{where}: SHA-256 {digest[:16]}… differs from the announced "
                                 f"{info.sha256[:16]}… (overwritten while read)")
        return body

    def close(self) -> None:
        for name in list(self._rings):
            self.disconnect(name)


def _ring_chunks(layout: RingLayout) -> np.ndarray:
    region = Region(addr=layout.addr, nbytes=layout.slots * layout.slot_bytes, device=layout.device,
                    mem_type=layout.mem_type)
    return region.chunks(layout.chunk_bytes)
