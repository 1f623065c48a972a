"""A trainer rank's side of the fast path: one NIXL agent, one outbox ring, one link to the controller.

``RdmaTrainer`` is a sink of the publisher's commit announcement (``DeltaPublisher(..., rdma=...)``,
deltasync/publish/sinks.py): once a step is committed to the store (the store is the history and the safety
net, so it comes first), ``committed`` offers its object: the bytes go into the next ring slot and the slot is
announced to the controller. Nothing here ever fails a commit: an RDMA problem (no plan yet, an object larger
than a slot, a multi-part step, a controller gone) is logged and counted (``stats``), and the consumers read
that step from the store. Registration with the controller happens on the first offer, from the object's own
header (every publisher's first step is an anchor naming every tensor), so the trainer needs no tensor list.

    with DeltaPublisher(url, model, rdma="tcp://controller:5555") as pub:   # or rdma={...RdmaOptions fields}
        pub.publish(step)
    pub.rdma.stats   # steps announced, and those that went by the store only (and why)
"""

from __future__ import annotations

import logging
import time
import uuid
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from deltasync.errors import DeltaSyncError
from deltasync.format.objects import StepObject
from deltasync.rdma.agent import Agent
from deltasync.rdma.link import TrainerLink
from deltasync.rdma.messages import PartMeta, TensorMeta, TrainerHello
from deltasync.rdma.options import RdmaOptions, rdma_options  # noqa: F401 - re-exported
from deltasync.rdma.outbox import Outbox, SlotInfo

if TYPE_CHECKING:
    from deltasync.format.documents import Manifest

log = logging.getLogger(__name__)


@dataclass
class TrainerStats:
    """What happened to each committed step on the fast path."""

    announced: list[int] = field(default_factory=list)
    store_only: list[tuple[int, str]] = field(default_factory=list)  # (step, why)


class RdmaTrainer:
    """One trainer rank on the fast path (see the module docstring). Close it when the publisher closed."""

    def __init__(self, options: RdmaOptions) -> None:
        self.options = options
        self.agent = Agent(f"trainer-{options.rank}-{uuid.uuid4().hex[:8]}")
        try:
            self.outbox = Outbox(self.agent, slots=options.slots, slot_bytes=options.slot_bytes,
                                 chunk_bytes=options.chunk_bytes, max_inflight_bytes=options.max_inflight_bytes,
                                 ack_deadline_s=options.ack_deadline_s, device=options.device)
            self.link = TrainerLink(options.controller, rank=options.rank, secret=options.secret)
        except BaseException:
            self.agent.close()
            raise
        self.planned = False
        self.registered = False
        self.stats = TrainerStats()

    @property
    def object_bytes(self) -> int:
        """The largest object a ring slot holds: the publisher hands over the bytes of objects up to this size."""
        return self.outbox.capacity

    def committed(self, step: int, manifest: Manifest | None, data: bytes | None) -> None:
        """The publisher committed ``step`` (its ``manifest``; ``data``: its object's bytes, None when larger than a
        slot): offer the object, announced with the manifest's digest (the writer hashed it once, while writing).
        A sharded step (one object per rank, ``manifest`` None or multi-part) goes by the store only."""
        if manifest is None or manifest.is_multipart:
            self.skip(step, "a multi-part step (one object per rank) goes by the store")
            return
        if data is None:
            self.skip(step, f"object of {manifest.object_bytes} bytes larger than a ring slot "
                            f"({self.outbox.capacity})")
            return
        self.offer(step, data, digest=manifest.objects[0].digest)

    def offer(self, step: int, data: bytes | memoryview, *, digest: str | None = None) -> SlotInfo | None:
        """Put a committed step's object in the ring and announce it; None (logged) when it goes by store only.
        ``digest``: the object's prefixed digest when known (the manifest's), so that it is not computed again."""
        try:
            if not self.registered:
                self._register(data, where=f"step {step}")
            self._poll()
            if not self.planned:
                self.skip(step, "no plan from the controller yet")
                return None
            info = self.outbox.offer(step, data, digest=digest)
            self.link.ready(info)
        except (DeltaSyncError, OSError) as e:  # RingFullError, a controller gone: the store has the step
            self.skip(step, f"{type(e).__name__}: {e}")
            return None
        self.stats.announced.append(step)
        return info

    def _register(self, data: bytes | memoryview, *, where: str) -> None:
        """Say hello with the tensors the object's header names, then wait ``plan_wait_s`` for the plan."""
        with StepObject(bytes(data), where=f"rdma trainer {where}") as obj:
            tensors = {n: TensorMeta(h.numel, h.torch_dtype.itemsize) for n, h in obj.header.tensors.items()}
        self.link.hello(TrainerHello(rank=self.options.rank, metadata=self.agent.metadata(), ring=self.outbox.layout(),
                                     tensors=tensors, parts=[PartMeta(n, 0, m.numel) for n, m in tensors.items()]))
        self.registered = True
        deadline = time.monotonic() + self.options.plan_wait_s
        while True:
            self._poll()
            if self.planned or time.monotonic() >= deadline:
                return
            time.sleep(0.01)

    def _poll(self) -> None:
        consumers = self.link.poll()
        if consumers is not None:
            self.outbox.set_consumers(consumers)
            self.planned = True
            log.info("%s: planned; consumers reading this ring: %s", self.agent.name, consumers)

    def skip(self, step: int, why: str) -> None:
        self.stats.store_only.append((step, why))
        log.warning("%s: step %d goes through the store only: %s", self.agent.name, step, why)

    def close(self) -> None:
        """Let consumers still reading finish (acks polled until every slot is free or its deadline passed)."""
        try:
            deadline = time.monotonic() + self.options.ack_deadline_s
            while self.outbox.in_flight_bytes() and time.monotonic() < deadline:
                self.outbox.poll()
                time.sleep(0.005)
        finally:
            self.outbox.close()
            self.link.close()
            self.agent.close()
