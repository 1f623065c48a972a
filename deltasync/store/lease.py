"""The writer lease (docs/FORMAT.md section 5): one publisher per stream, fenced at each commit.

``writer.json`` names the stream's writer and when its claim expires. Every write of it is a
compare-and-swap on the version that writer read (``Transport.put(if_version=...)``; create-only where
there is none), so of two writers racing for a stream one wins; a writer proves it still holds the lease
right before each manifest (``hold``), and a writer that lost it commits nothing.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Protocol, TypeVar

from deltasync.errors import FormatError, WriterConflictError
from deltasync.format.documents import Lease, decode, encode
from deltasync.transports.base import Transport

T = TypeVar("T")

log = logging.getLogger(__name__)

WRITER = "writer.json"
DEFAULT_TTL_S = 120.0


class LeaseStore(Protocol):
    """What the lease needs of a store (``deltasync.store.Store`` is one): where it is, its transport, its retry
    policy and a delete. A part of the store, the lease knows no more of it than this."""

    url: str
    transport: Transport

    def call(self, what: str, fn: Callable[[], T], *, landed: Callable[[], bool] | None = None) -> T: ...

    def delete(self, rel: str, *, recursive: bool = False) -> None: ...


class WriterLease:
    """The lease of one store's stream, as this process's writers hold it (``Store`` delegates here)."""

    def __init__(self, store: LeaseStore) -> None:
        self.store = store
        self._held: dict[str, tuple[Lease, float]] = {}  # owner -> (lease as last written, its lifetime)

    def read(self) -> tuple[Lease | None, str | None]:
        """The lease and its version tag (for compare-and-swap), or (None, None) where there is none.

        A lease that does not parse counts as held by an unknown writer: taking it needs ``take_over``.
        """
        store = self.store
        try:
            data, version = store.call(f"read {WRITER}", lambda: store.transport.get_versioned(WRITER))
        except FileNotFoundError:
            return None, None
        try:
            return decode(data, Lease, where=f"{store.url}/{WRITER}"), version
        except FormatError as e:
            log.warning("%s", str(e))
            return Lease(owner="(unreadable writer.json)", expires_unix_s=float("inf")), version

    def current(self) -> Lease | None:
        return self.read()[0]

    def _write(self, lease: Lease, version: str | None) -> None:
        """Replace the lease if it is still at ``version`` (None: if there is none): a compare-and-swap."""
        store = self.store
        data = encode(lease)
        try:
            # a write whose reply was lost may have happened: the lease then holds these very bytes (owner and
            # expiry, this attempt's), which is this writer's success, not another writer's lease
            store.call(f"write {WRITER}", lambda: store.transport.put(
                WRITER, data, if_absent=version is None, if_version=version),
                landed=lambda: store.transport.get(WRITER) == bytes(data))
        except FileExistsError:
            held = self.current()
            raise WriterConflictError(
                f"{store.url}: writer {held.owner if held else None!r} took the stream at the same time as "
                f"{lease.owner!r}"
            ) from None

    def acquire(self, owner: str, *, ttl_s: float, take_over: bool = False) -> Lease:
        """Become the stream's only writer, or raise ``WriterConflictError`` naming the holder."""
        held, version = self.read()
        now = time.time()
        if held and held.owner != owner and held.expires_unix_s > now and not take_over:
            left = "" if held.expires_unix_s == float("inf") else f" for {held.expires_unix_s - now:.0f}s more"
            raise WriterConflictError(
                f"{self.store.url}: stream is held by writer {held.owner!r}{left}; "
                f"stop it, wait for its lease to expire, or take over explicitly (take_over=True, CLI --take-over)"
            )
        if held and held.owner != owner:
            log.warning("%s: taking the stream over from writer %r", self.store.url, held.owner)
        lease = Lease(owner=owner, expires_unix_s=now + ttl_s)
        self._write(lease, version)
        self._held[owner] = (lease, ttl_s)
        return lease

    def renew(self, owner: str, *, ttl_s: float) -> Lease:
        """Extend ``owner``'s lease (compare-and-swap: fails if anybody else wrote it meanwhile)."""
        held, version = self.read()
        self._require(owner, held)
        lease = Lease(owner=owner, expires_unix_s=time.time() + ttl_s)
        self._write(lease, version)
        self._held[owner] = (lease, ttl_s)
        return lease

    def check(self, owner: str) -> None:
        """Raise ``WriterConflictError`` unless ``owner`` holds the stream (one read)."""
        self._require(owner, self.current())

    def hold(self, owner: str) -> None:
        """Prove that ``owner`` holds the stream now: a read, plus a renewal (compare-and-swap) when its lease
        has less than a third of its lifetime left or ran out (nobody may take a live lease without
        ``take_over``; an expired one could be taken at any moment)."""
        held = self.current()
        self._require(owner, held)
        assert held is not None
        _, ttl_s = self._held.get(owner, (None, DEFAULT_TTL_S))
        if held.expires_unix_s - time.time() < ttl_s / 3:
            self.renew(owner, ttl_s=ttl_s)

    def release(self, owner: str) -> None:
        held = self.current()
        if held is not None and held.owner == owner:
            self.store.delete(WRITER)
        self._held.pop(owner, None)

    def _require(self, owner: str, held: Lease | None) -> None:
        if held is None or held.owner != owner:
            raise WriterConflictError(
                f"{self.store.url}: writer {owner!r} lost the stream to "
                f"{held.owner if held else 'nobody (lease deleted)'!r}"
            )
