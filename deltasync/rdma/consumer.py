"""A consumer's side of the fast path: follow a stream whose trainer announces each step over NIXL.

``RdmaConsumer(url, rdma=...)`` registers with the controller (one NIXL agent, one registered inbox) and is
two things a follower already knows:

- a :class:`~deltasync.notify.Notifier`: the trainer's announcements are pushed to whoever follows, so a step
  is fetched as soon as it is announced (after its manifest is found committed: an announcement is a hint);
- an object source (:class:`~deltasync.follow.reader.ObjectSource`, its ``RingReader``) that its ``StreamReader``
  (``.reader``) asks first: a step's object comes from the announced ring slot (hashed once, as it lands in
  the inbox, against the manifest's digest; opened in place, no copy), and from the store on any
  ``RdmaError``.

One follow loop serves every path::

    with RdmaConsumer(url, rdma="tcp://controller:5555", consumer_id="rollout-0") as consumer:
        follower = Follower(consumer.reader, StateDictTarget(), notifier=consumer, on_step=consumer.applied)
        follower.wait_for(100)        # each step applied, verified and acknowledged

Manifests always come from the store (small; the commit marker); the ring carries the objects.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from typing import Any

from typing_extensions import Self

from deltasync.errors import DeltaSyncError, RdmaError, StaleMetadataError
from deltasync.follow.reader import StreamReader
from deltasync.notify import Announcements
from deltasync.rdma.agent import Agent
from deltasync.rdma.inbox import Inbox, SlotLease
from deltasync.rdma.link import ConsumerLink
from deltasync.rdma.messages import ConsumerHello
from deltasync.rdma.trainer import RdmaOptions, rdma_options
from deltasync.store import Store
from deltasync.store.location import StoreLocation, Where

log = logging.getLogger(__name__)


class RingReader:
    """The NIXL half of a consumer: its agent, inbox and controller link; reads a step's announced slot.

    The object source (:class:`~deltasync.follow.reader.ObjectSource`) its ``StreamReader`` asks first, from whichever
    thread reads; one lock keeps the ZMQ socket and the inbox buffer to one caller at a time.
    """

    def __init__(self, options: RdmaOptions, *, consumer_id: str, engine: str,
                 needs: list[str] | None = None) -> None:
        self.options = options
        self.id = consumer_id
        self.agent = Agent(f"{consumer_id}-{uuid.uuid4().hex[:8]}")
        try:
            self.inbox = Inbox(self.agent, capacity_bytes=options.capacity_bytes, device=options.device)
            self.link = ConsumerLink(options.controller, consumer_id=consumer_id, secret=options.secret)
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

    def lease(self, step: int, *, digest: str | None = None) -> SlotLease:
        """``step``'s object from its announced slot, checked (against ``digest`` too: the manifest's) and
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
                return self.inbox.lease(info, timeout_s=timeout_s, digest=digest)
            except StaleMetadataError:  # the trainer restarted: its new agent's metadata, then read again
                rank = min(self.link.ranks)
                fresh = self.link.fetch_metadata(rank, timeout_s=timeout_s)
                self.inbox.connect(fresh.ring, fresh.metadata)
                return self.inbox.lease(info, timeout_s=timeout_s, digest=digest)

    def held(self, step: int, *, name: str, nbytes: int, digest: str) -> SlotLease | None:
        """Step ``step``'s object held in the inbox, checked against the manifest's ``nbytes`` and ``digest``
        (the only hash of these bytes: the reader opens them as they are); None (why recorded in ``arrived``)
        where the store must serve it. The reader releases the lease once the object is closed."""
        try:
            lease = self.lease(step, digest=digest)
        except DeltaSyncError as e:  # RdmaError and the rest: the store has the step
            self._missed(step, e)
            return None
        if lease.info.length != nbytes:  # the digest matched, so this cannot happen short of a collision
            lease.release()
            self._missed(step, RdmaError(f"{lease.info.length} bytes, manifest says {nbytes}"))
            return None
        self.arrived[step] = "rdma"
        return lease

    def _missed(self, step: int, e: Exception) -> None:
        self.arrived[step] = f"store: {type(e).__name__}"
        log.info("%s: step %d from the store: %s", self.id, step, e)

    def applied(self, step: int) -> None:
        """Tell the controller ``step`` is applied and verified here (the engine's version counts it)."""
        with self._lock:
            try:
                self.link.applied(step)
            except RdmaError as e:  # the step is applied: a lost acknowledgement costs the slot its deadline
                log.warning("%s: step %d applied, not acknowledged: %s", self.id, step, e)
            self.link.forget_through(step)

    def close(self) -> None:
        with self._lock:
            try:
                self.inbox.close()
                self.link.close()
            finally:
                self.agent.close()


class RdmaConsumer(Announcements):
    """Read ``url`` over NIXL where announced, and push announced steps to subscribers (module docstring).

    ``rdma``: the controller's address or ``RdmaOptions``. ``consumer_id`` names this reader to the
    controller; ``engine`` groups the consumers whose acknowledgements advance one engine's version (default:
    its own); ``needs`` lists the tensors it needs (None: all). ``plan_wait_s``: wait that long for the plan
    now (the trainer must have said hello); steps before the plan are read from the store.
    """

    def __init__(self, url: Where, *, rdma: str | RdmaOptions | dict, consumer_id: str | None = None,
                 engine: str | None = None, needs: list[str] | None = None,
                 storage_options: dict[str, Any] | None = None, plan_wait_s: float = 0.0) -> None:
        super().__init__()
        options = rdma_options(rdma)
        consumer_id = consumer_id or f"consumer-{uuid.uuid4().hex[:8]}"
        self.ring = RingReader(options, consumer_id=consumer_id, engine=engine or consumer_id, needs=needs)
        self._stop = threading.Event()
        try:
            self.store = Store(StoreLocation.of(url, storage_options))
            self.reader = StreamReader(self.store, memory_object_bytes=options.capacity_bytes, objects=self.ring)
            if plan_wait_s:
                self.ring.wait_plan(plan_wait_s)
        except BaseException:
            self.ring.close()
            raise
        self._listener = threading.Thread(target=self._listen, name="deltasync-rdma-announcements", daemon=True)
        self._listener.start()

    @property
    def arrived(self) -> dict[int, str]:
        """How each step's object came: ``"rdma"``, or ``"store: <why>"``."""
        return self.ring.arrived

    @property
    def alive(self) -> bool:
        """Whether the controller's plan is here (announcements then come; polling slows to a safety net)."""
        return self.ring.link.plan is not None

    def applied(self, step: int) -> None:
        """Acknowledge ``step`` as applied and verified here (a ``Follower``'s ``on_step``)."""
        self.ring.applied(step)

    def _listen(self) -> None:
        """Take control messages as they come and push each newly announced step to the subscribers."""
        while not self._stop.is_set():
            try:
                self.ring.wait_message(0.05)
                self.ring.poll()
                newest = self.ring.newest()
            except Exception as e:  # noqa: BLE001 - the store path goes on; say why announcements stopped
                log.warning("%s: announcements stopped: %s: %s (following the store alone)", self.ring.id,
                            type(e).__name__, e)
                return
            if newest is not None:
                self._announce(newest)

    def close(self) -> None:
        self._stop.set()
        self._listener.join(timeout=5)
        try:
            self.reader.close()
            self.store.close()
        finally:
            self.ring.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
