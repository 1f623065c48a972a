"""A consumer's side of the fast path: follow a stream whose trainer announces each step over NIXL.

``RdmaConsumer(url, rdma=...)`` registers with the controller (one NIXL agent, one registered inbox) and
gives a ``StreamReader`` (``.reader``) whose store reads step objects from the announced ring slot first
(hashed once, as they land in the inbox, against the manifest's SHA-256; opened in place, no copy) and from
the store on any ``RdmaError``. So a target applies with the existing code::

    with RdmaConsumer(url, rdma="tcp://controller:5555", consumer_id="rollout-0") as consumer:
        target = StateDictTarget()
        for step in consumer.follow(target, until=100):
            ...                       # the step is applied, verified and acknowledged

or hand ``consumer.reader`` to ``rollout_loader.Follower`` with ``on_step=consumer.applied``. Manifests
always come from the store (small; the commit marker); the ring carries the objects.

``follow`` learns of new steps from announcements (no store polling on the hot path) and also polls the
store every ``poll_s``, so a lost announcement or a trainer without RDMA only costs latency.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any, Protocol

from typing_extensions import Self

from deltasync.errors import RdmaError, StaleMetadataError, WaitTimeoutError
from deltasync.format.objects import StepObject
from deltasync.rdma.agent import Agent
from deltasync.rdma.controller import ConsumerHello, ConsumerLink
from deltasync.rdma.inbox import Inbox, Lease
from deltasync.rdma.trainer import RdmaOptions, rdma_options
from deltasync.reader import StreamReader
from deltasync.store import Store

log = logging.getLogger(__name__)


class Target(Protocol):
    @property
    def step(self) -> int | None: ...

    def apply(self, obj: StepObject) -> None: ...


class RingReader:
    """The NIXL half of a consumer: its agent, inbox and controller link; reads a step's announced slot.

    Used by the consumer's transport (``deltasync.transports.nixl``) from whichever thread reads the store;
    one lock keeps the ZMQ socket and the inbox buffer to one caller at a time.
    """

    def __init__(self, options: RdmaOptions, *, consumer_id: str, engine: str,
                 needs: list[str] | None = None) -> None:
        self.options = options
        self.id = consumer_id
        self.agent = Agent(f"{consumer_id}-{uuid.uuid4().hex[:8]}")
        try:
            self.inbox = Inbox(self.agent, capacity_bytes=options.capacity_bytes, device=options.device)
            self.link = ConsumerLink(options.controller)
        except BaseException:
            self.agent.close()
            raise
        self._lock = threading.RLock()
        self._connected_plan: object | None = None
        self.arrived: dict[int, str] = {}  # step -> "rdma" or "store: <why>"
        self.link.hello(ConsumerHello(id=consumer_id, engine=engine, agent=self.agent.name, needs=list(needs or []),
                                      everything=needs is None))

    def wait_plan(self, timeout_s: float) -> bool:
        """Wait up to ``timeout_s`` for the controller's plan (it comes once every peer said hello)."""
        deadline = time.monotonic() + timeout_s
        while True:
            self.poll()
            if self.link.plan is not None or time.monotonic() >= deadline:
                return self.link.plan is not None
            time.sleep(0.01)

    def poll(self) -> None:
        """Take waiting control messages; connect to the rings of a (new) plan."""
        with self._lock:
            self.link.poll()
            plan = self.link.plan
            if plan is not None and plan is not self._connected_plan:
                for read in plan.reads:
                    self.inbox.connect(read.source.ring, read.source.metadata)
                self._connected_plan = plan

    def newest(self) -> int | None:
        with self._lock:
            return self.link.newest_announced()

    def wait_message(self, timeout_s: float) -> None:
        """Block up to ``timeout_s`` for a control message (instead of spinning)."""
        with self._lock:
            self.link.pending(timeout_s)

    def read(self, step: int) -> bytes:
        """``step``'s object from its announced slot, checked, as ``bytes`` (a copy); an ``RdmaError`` when it
        cannot be had there. ``lease`` gives the same bytes without the copy."""
        lease = self.lease(step)
        try:
            return bytes(lease.view())
        finally:
            lease.release()

    def lease(self, step: int, *, sha256: str | None = None) -> Lease:
        """``step``'s object from its announced slot, checked (against ``sha256`` too: the manifest's) and
        held in the inbox until the lease is released; an ``RdmaError`` when it cannot be had there.

        Waits up to ``announce_wait_s`` for the announcement unless a later step was announced already (then
        this one was lost, or its slot is long reused): the store is faster than waiting.
        """
        with self._lock:
            deadline = time.monotonic() + self.options.announce_wait_s
            while True:
                self.poll()
                info = self.link.announced(step)
                if info is not None:
                    break
                newest = self.link.newest_announced()
                if newest is not None and newest > step:
                    raise RdmaError(f"{self.id}: step {step} was not announced; step {newest} was")
                if time.monotonic() >= deadline:
                    raise RdmaError(f"{self.id}: step {step} not announced within {self.options.announce_wait_s:g} s")
                self.link.pending(0.001)
            timeout_s = self.options.read_timeout_s
            try:
                return self.inbox.lease(info, timeout_s=timeout_s, sha256=sha256)
            except StaleMetadataError:  # the trainer restarted: its new agent's metadata, then read again
                rank = min(self.link.ranks)
                fresh = self.link.fetch_metadata(rank, timeout_s=timeout_s)
                self.inbox.connect(fresh.ring, fresh.metadata)
                return self.inbox.lease(info, timeout_s=timeout_s, sha256=sha256)

    def applied(self, step: int) -> None:
        """Tell the controller ``step`` is applied and verified here (the engine's version counts it)."""
        with self._lock:
            self.link.applied(step)
            self.link.forget_through(step)

    def close(self) -> None:
        with self._lock:
            try:
                self.inbox.close()
                self.link.close()
            finally:
                self.agent.close()


class RdmaConsumer:
    """Follow ``url`` with reads over NIXL where announced (see the module docstring).

    ``rdma``: the controller's address or ``RdmaOptions``. ``consumer_id`` names this reader to the
    controller; ``engine`` groups the consumers whose acknowledgements advance one engine's version (default:
    its own); ``needs`` lists the tensors it needs (None: all). ``plan_wait_s``: wait that long for the plan
    now (the trainer must have said hello); steps before the plan are read from the store.
    """

    def __init__(self, url: str, *, rdma: str | RdmaOptions | dict, consumer_id: str | None = None,
                 engine: str | None = None, needs: list[str] | None = None,
                 storage_options: dict[str, Any] | None = None, plan_wait_s: float = 0.0) -> None:
        from deltasync.transports import open_transport
        from deltasync.transports.nixl import NixlTransport

        options = rdma_options(rdma)
        consumer_id = consumer_id or f"consumer-{uuid.uuid4().hex[:8]}"
        self.ring = RingReader(options, consumer_id=consumer_id, engine=engine or consumer_id, needs=needs)
        try:
            backing = open_transport(url, storage_options)
            self.store = Store(url, transport=NixlTransport(backing, consumer=self.ring), storage_options=storage_options)
            self.reader = StreamReader(self.store, memory_object_bytes=options.capacity_bytes)
            if plan_wait_s:
                self.ring.wait_plan(plan_wait_s)
        except BaseException:
            self.ring.close()
            raise

    @property
    def arrived(self) -> dict[int, str]:
        """How each step's object came: ``"rdma"``, or ``"store: <why>"``."""
        return self.ring.arrived

    def applied(self, step: int) -> None:
        self.ring.applied(step)

    def follow(self, target: Target, *, until: int | None = None, timeout_s: float = 60.0, poll_s: float = 0.05,
               on_step: Callable[[int], None] | None = None) -> Iterator[int]:
        """Apply each new step to ``target`` (the chain from the step it holds), acknowledge it, yield it;
        stop after ``until``. ``WaitTimeoutError`` when no new step comes for ``timeout_s``."""
        last_poll = 0.0
        quiet_since = time.monotonic()
        while until is None or target.step is None or target.step < until:
            self.ring.poll()
            newest = self.ring.newest()
            now = time.monotonic()
            if (newest is None or target.step is not None and newest <= target.step) and now - last_poll >= poll_s:
                last_poll = now
                latest = self.reader.latest_step()
                newest = max(newest if newest is not None else -1, latest if latest is not None else -1)
            if newest is None or newest < 0 or target.step is not None and newest <= target.step:
                if now - quiet_since > timeout_s:
                    raise WaitTimeoutError(f"{self.reader.url}: no step after {target.step} within {timeout_s:g} s")
                self.ring.wait_message(min(poll_s, 0.01))
                continue
            for s in self.reader.chain(newest, start=target.step):
                with self.reader.open(s) as obj:
                    target.apply(obj)
                self.applied(s)
                if on_step is not None:
                    on_step(s)
                yield s
            quiet_since = time.monotonic()

    def close(self) -> None:
        try:
            self.reader.close()
            self.store.close()
        finally:
            self.ring.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
