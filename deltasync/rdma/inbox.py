"""The consumer's inbox: READ an announced ring slot into one registered local buffer and check it.

A read uses descriptor lists prepared once per trainer ring (the ring cut into ``chunk_bytes`` chunks, the
local buffer likewise), picks the chunks covering the slot's header and object, and waits with a timeout. The
bytes are accepted only when the slot header's generation, step and length equal the announcement's and the
object's digest equals the expected one (the manifest's, when the caller has it, and the announcement's);
anything else raises a :class:`~deltasync.rdma.agent.RdmaError` subclass and the caller reads the step from
the object store instead. Nothing is applied from an unchecked read.

**Hashed once, while it lands.** A read larger than ``piece_bytes`` is cut into several READs, posted and waited
for in order by one landing thread (UCX over shared memory copies inside the post call); the calling thread
hashes each piece (single-threaded BLAKE3: its worker threads would only take the transfer's cores) as soon as it
landed while the next one moves, so the digest (the one check: the reader does not hash again, see
``RingReader.held``) overlaps the transfer. No bytes are handed out before the whole digest matched. A read that
fails (a piece's READ, its deadline, the header, the digest) posts no piece after the failure, waits for and
drops every request it posted, and holds nothing; ``close`` ends the landing thread.

**Zero copy.** ``lease`` returns a :class:`SlotLease`: the checked bytes stay where they landed, and no later read
lands on them until the lease is released; a step object opens straight on ``SlotLease.view()``. Each view (and
``SlotLease.check``) re-reads the slot header the READ brought with the object: if the memory under a lease ever
changed (a bug, a stray write), the generation no longer matches and the object is refused
(``StaleSlotError``) rather than decoded. ``read`` is a lease released at once (its view is valid until the
next read).

Acknowledgement: a one-piece read carries it as the READ's notification, delivered once its bytes landed; a
read of several pieces sends it once every piece is done (the trainer may then reuse the slot: it is read).
"""

from __future__ import annotations

import itertools
import logging
import math
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from deltasync.errors import RdmaError, StaleMetadataError, StaleSlotError
from deltasync.format import digest as digests
from deltasync.rdma.agent import Agent, PreparedSide, Region
from deltasync.rdma.outbox import HEADER, RingLayout, SlotInfo

log = logging.getLogger(__name__)

PIECE_BYTES = 8 << 20  # one READ request per piece: hashing a piece overlaps the READs of the next ones


@dataclass
class _Ring:
    layout: RingLayout
    local: PreparedSide
    remote: PreparedSide


@dataclass(eq=False)
class SlotLease:
    """A checked object held where it landed in the inbox (zero copy) until ``release``; see the module doc.

    ``wait_s``/``hash_s``: time spent waiting for READs and hashing (they overlap), for benchmarks."""

    inbox: Inbox
    info: SlotInfo
    offset: int
    total: int
    digest: str = ""  # prefixed: what the landed bytes hashed to
    wait_s: float = 0.0
    hash_s: float = 0.0
    released: bool = field(default=False)

    def view(self) -> memoryview:
        """The object's bytes in the inbox, after checking they are still the ones that were checked."""
        self.check()
        return self.inbox._host(self.offset + HEADER.size, self.offset + self.total)

    def check(self) -> None:
        """``StaleSlotError`` unless the slot header under this lease still names its generation and step."""
        if self.released:
            raise RdmaError(f"{self.inbox.agent.name}: step {self.info.step}: the lease was released")
        self.inbox._check_header(self.info, self.offset, f"{self.inbox.agent.name}: step {self.info.step} (held)")

    def release(self) -> None:
        self.inbox._release(self)


class Inbox:
    """One registered buffer of ``capacity_bytes`` on ``agent``, and the trainer rings connected to it.

    Reads land at the first chunk-aligned place no lease holds; ``piece_bytes`` sets how a read is cut
    into READs that are hashed while the next ones land.
    """

    def __init__(self, agent: Agent, *, capacity_bytes: int = 64 << 20, device: str = "cpu",
                 piece_bytes: int = PIECE_BYTES) -> None:
        self.agent = agent
        self.piece_bytes = piece_bytes
        self._buffer = torch.empty(capacity_bytes, dtype=torch.uint8, device=device)
        self._buffer.fill_(0)  # every page touched now, at start: not by the first reads that land there
        self._np = self._buffer.numpy() if self._buffer.is_cpu else None
        self.region = agent.register(self._buffer)
        self._rings: dict[str, _Ring] = {}
        self._leases: dict[int, SlotLease] = {}
        self._lock = threading.Lock()  # leases are released from any thread (a finalizer)
        self._landing: ThreadPoolExecutor | None = None
        self._closed = False

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

    def read(self, info: SlotInfo, *, timeout_s: float = 10.0, digest: str | None = None) -> memoryview:
        """The announced object's bytes, checked; a view valid until the next read (copy it to keep it)."""
        lease = self.lease(info, timeout_s=timeout_s, digest=digest)
        try:
            return lease.view()
        finally:
            lease.release()

    def lease(self, info: SlotInfo, *, timeout_s: float = 10.0, digest: str | None = None) -> SlotLease:
        """READ the announced object, check it (header, then its digest, with the announced algorithm, against
        ``digest`` when given, which must also be the announced one: algorithm and value) and hold it in place;
        raises an ``RdmaError`` subclass otherwise."""
        where = f"{self.agent.name}: step {info.step} from {info.agent} slot {info.slot}"
        if digest is not None and not digests.matches(digest, info.digest):
            raise StaleSlotError(f"{where}: announced digest {info.digest[:23]}… is not the expected "
                                 f"{digest[:23]}… (another object)")
        ring, count = self._ring_for(info, where)
        lease = self._reserve(info, ring.layout.chunk_bytes, count, where)
        try:
            self._land(ring, lease, count, time.monotonic() + timeout_s, where)
        except BaseException:
            self._release(lease)
            raise
        return lease

    def transfer(self, info: SlotInfo, *, timeout_s: float = 10.0) -> str:
        """Only one READ of the slot into free inbox memory, nothing checked (a raw transfer: benchmarks)."""
        where = f"{self.agent.name}: step {info.step} from {info.agent} slot {info.slot}"
        ring, count = self._ring_for(info, where)
        lease = self._reserve(info, ring.layout.chunk_bytes, count, where)
        try:
            local, remote = self._indices(ring, lease, 0, count)
            self.agent.read(ring.local, local, ring.remote, remote, notif=info.ack(), timeout_s=timeout_s, where=where)
        finally:
            self._release(lease)
        return where

    def close(self) -> None:
        """Stop the landing thread (after the pieces it holds landed) and release every ring's prepared reads."""
        with self._lock:
            self._closed = True
            landing, self._landing = self._landing, None
        if landing is not None:  # first: its pieces use the prepared lists released below
            landing.shutdown(wait=True)
        for name in list(self._rings):
            self.disconnect(name)

    # --- where a read lands, and what holds it ---

    def _ring_for(self, info: SlotInfo, where: str) -> tuple[_Ring, int]:
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
        return ring, math.ceil(total / lay.chunk_bytes)

    def _reserve(self, info: SlotInfo, chunk: int, count: int, where: str) -> SlotLease:
        """A lease on the first chunk-aligned range of ``count`` chunks that no other lease holds."""
        size = count * chunk
        limit = self.region.nbytes - self.region.nbytes % chunk
        with self._lock:
            if self._closed:  # every read reserves first: a closed inbox reads nothing, connected again or not
                raise RdmaError(f"{where}: the inbox is closed")
            held = sorted((x.offset, x.offset + x.total) for x in self._leases.values())
            for start in itertools.chain([0], (-(-end // chunk) * chunk for _, end in held)):
                if start + size <= limit and all(end <= start or begin >= start + size for begin, end in held):
                    lease = SlotLease(self, info, start, HEADER.size + info.length)
                    self._leases[id(lease)] = lease
                    return lease
        raise RdmaError(f"{where}: no room in the inbox for {size} bytes ({len(held)} object(s) held open, "
                        f"{self.region.nbytes} bytes)")

    def _release(self, lease: SlotLease) -> None:
        with self._lock:
            lease.released = True
            self._leases.pop(id(lease), None)

    # --- the read itself: pieces posted together, each hashed once landed ---

    def _indices(self, ring: _Ring, lease: SlotLease, a: int, b: int) -> tuple[list[int], list[int]]:
        chunk = ring.layout.chunk_bytes
        local = lease.offset // chunk
        remote = lease.info.slot * (ring.layout.slot_bytes // chunk)
        return list(range(local + a, local + b)), list(range(remote + a, remote + b))

    def _land(self, ring: _Ring, lease: SlotLease, count: int, deadline: float, where: str) -> None:
        info, chunk = lease.info, ring.layout.chunk_bytes
        per = max(1, self.piece_bytes // chunk)
        pieces = [(a, min(a + per, count)) for a in range(0, count, per)]
        one = len(pieces) == 1

        stop = threading.Event()  # set once a piece failed or the caller gave up: later pieces are never posted

        def land(a: int, b: int) -> tuple[Any, Exception | None]:
            """Post one piece's READ and wait for it: the request (None when never posted), and why it failed (a
            posted request must still be dropped). A failure stops the pieces after it here, in the landing
            thread, so none is posted in the time the caller takes to see it."""
            if stop.is_set():
                return None, None
            local, remote = self._indices(ring, lease, a, b)
            try:
                handle = self.agent.post_read(ring.local, local, ring.remote, remote,
                                              notif=info.ack() if one else b"", where=where)
            except BaseException:
                stop.set()
                raise
            try:
                self.agent.wait(handle, deadline=deadline, where=where)
            except Exception as e:  # noqa: BLE001 - returned, raised by the caller once the request is dropped
                stop.set()
                return handle, e
            return handle, None

        # A post may do the copy itself (UCX over shared memory copies inside the call, the GIL released), so the
        # pieces are landed by one thread, in order, while this one hashes those already landed. That thread makes
        # every NIXL call of the read until the last piece landed (the agent is not thread-safe: NIXL's default
        # sync mode), this one none until then.
        landing: list[Future[tuple[Any, Exception | None]]] = []
        if one:
            landing.append(Future())
            landing[0].set_result(land(*pieces[0]))
        else:
            lander = self._lander(where)
            landing = [lander.submit(land, a, b) for a, b in pieces]
        digest = digests.hasher(digests.algorithm_of(info.digest), parallel=False)
        ok = False
        try:
            for (a, b), landed in zip(pieces, landing, strict=True):
                t0 = time.perf_counter()
                _, failed = landed.result()
                if failed is not None:
                    raise failed
                t1 = time.perf_counter()
                lo = lease.offset + a * chunk
                if a == 0:
                    self._check_header(info, lease.offset, where)
                    lo += HEADER.size
                digest.update(self._host(lo, lease.offset + min(b * chunk, lease.total)))
                lease.wait_s += t1 - t0
                lease.hash_s += time.perf_counter() - t1
            ok = True
        finally:
            if not ok:  # failed early: pieces not posted yet never are; the ones posted land (waited for)
                stop.set()
                for landed in landing:
                    landed.cancel()
            for landed in landing:  # once all are done the landing thread is idle: these calls are this thread's
                try:
                    handle, _ = landed.result()
                except Exception:  # noqa: BLE001 - cancelled, or its post failed: nothing to drop (raised above)
                    continue
                if handle is not None:
                    self.agent.drop(handle, where)
        if not one:  # every piece landed: the slot is read
            self.agent.notify(info.agent, info.ack())
        lease.digest = digests.join(digests.algorithm_of(info.digest), digest.hexdigest())
        if not digests.matches(lease.digest, info.digest):
            raise StaleSlotError(f"{where}: {lease.digest[:23]}… differs from the announced "
                                 f"{info.digest[:23]}… (overwritten while read)")

    def _lander(self, where: str) -> ThreadPoolExecutor:
        """The one thread that lands a read's pieces, in order (made at the first read of several pieces)."""
        with self._lock:
            if self._closed:
                raise RdmaError(f"{where}: the inbox is closed")
            if self._landing is None:
                self._landing = ThreadPoolExecutor(1, thread_name_prefix=f"inbox-{self.agent.name}")
            return self._landing

    def _check_header(self, info: SlotInfo, offset: int, where: str) -> None:
        generation, step, length, _ = HEADER.unpack(self._host(offset, offset + HEADER.size))
        if (generation, step, length) != (info.generation, info.step, info.length):
            raise StaleSlotError(f"{where}: slot holds generation {generation} (step {step}, {length} bytes), "
                                 f"announced generation {info.generation} (step {info.step}, {info.length} bytes): "
                                 "overwritten")

    def _host(self, lo: int, hi: int) -> memoryview:
        """Bytes ``lo:hi`` of the buffer on the host: a view (CPU), or a copy (a GPU consumer would hash and
        decode on the device: docs/RDMA.md)."""
        if self._np is not None:
            return memoryview(self._np[lo:hi])  # type: ignore[arg-type]  # numpy types ndarray as a Buffer on Python >= 3.12 only
        return memoryview(self._buffer[lo:hi].cpu().numpy())  # type: ignore[arg-type]  # as above


def _ring_chunks(layout: RingLayout) -> np.ndarray:
    region = Region(addr=layout.addr, nbytes=layout.slots * layout.slot_bytes, device=layout.device,
                    mem_type=layout.mem_type)
    return region.chunks(layout.chunk_bytes)
