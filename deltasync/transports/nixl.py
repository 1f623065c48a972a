"""The NIXL transport: the object store, with each step's object also moving over RDMA (docs/RDMA.md).

A ``NixlTransport`` wraps the transport of the stream's store (every step is still committed there: the
store is the history and the safety net) and adds the hot path on one side:

- **trainer** (``NixlTransport.trainer``): ``put`` of a step object keeps its bytes; once ``put`` of that
  step's manifest succeeded (the commit), the bytes go into the outbox ring and the slot is announced
  through the controller (``deltasync.rdma.trainer``). An RDMA failure never fails the commit: the step is
  simply read from the store.
- **consumer** (``deltasync.rdma.consumer.RdmaConsumer`` builds it): ``StreamReader`` asks
  ``read_verified`` first, with the manifest's size and SHA-256: the announced slot is read, hashed once as
  it lands and held in the inbox, and the step object opens on it in place (no copy, no second hash). On any
  ``RdmaError`` the step comes from the backing store. Only a reader holding the step's manifest asks the
  ring, and only for a single-object step (a sharded step's parts go by the store without waiting for an
  announcement that never comes); ``get`` is the store's.

Trainer side, with the publisher unchanged::

    with NixlTransport.trainer(url, rdma="tcp://controller:5555") as transport:
        with DeltaPublisher(Store(url, transport=transport), model) as pub:
            ...

Everything but step objects (manifests, hints, leases, heartbeats) passes straight through.
"""

from __future__ import annotations

import builtins
import logging
import re
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from typing_extensions import Self

from deltasync.errors import DeltaSyncError, FormatError, RdmaError
from deltasync.format.documents import Manifest, decode
from deltasync.transports.base import Data, Entry, Transport, as_buffer

if TYPE_CHECKING:
    from deltasync.rdma.consumer import RingReader
    from deltasync.rdma.inbox import SlotLease
    from deltasync.rdma.trainer import RdmaOptions, RdmaTrainer

log = logging.getLogger(__name__)

OBJECT_KEY = re.compile(r"\Asteps/(\d{12})/([A-Za-z0-9][A-Za-z0-9._-]*\.safetensors)\Z")
MANIFEST_KEY = re.compile(r"\Asteps/(\d{12})/manifest\.json\Z")
MAX_PENDING = 4  # objects put but not yet committed (a failed commit leaves one behind; the oldest go)


class NixlTransport(Transport):
    """``backing`` plus the fast path of a trainer (``trainer=``) or a consumer (``consumer=``); see above."""

    def __init__(self, backing: Transport, *, trainer: RdmaTrainer | None = None,
                 consumer: RingReader | None = None) -> None:
        if (trainer is None) == (consumer is None):
            raise ValueError("a NixlTransport serves either a trainer or a consumer")
        self.backing = backing
        self.rdma_trainer = trainer
        self.consumer = consumer
        self.root = backing.root
        # a consumer must read objects through get (never in place); it hears of steps from the controller
        self.capabilities = replace(backing.capabilities,
                                    local_files=backing.capabilities.local_files and trainer is not None)
        self._pending: dict[int, tuple[str, bytes]] = {}

    @classmethod
    def trainer(cls, url: str, *, rdma: str | RdmaOptions | dict,
                storage_options: dict[str, Any] | None = None) -> NixlTransport:
        """The store at ``url`` for a publishing trainer rank, its committed steps offered over NIXL."""
        from deltasync.rdma.trainer import RdmaTrainer, rdma_options
        from deltasync.transports import open_transport

        side = RdmaTrainer(rdma_options(rdma))
        try:
            return cls(open_transport(url, storage_options), trainer=side)
        except BaseException:
            side.close()
            raise

    # --- the trainer's hook: objects kept, offered once their manifest committed ---

    def put(self, key: str, data: Data, *, if_absent: bool = False, if_version: str | None = None) -> None:
        obj = OBJECT_KEY.match(key) if self.rdma_trainer is not None else None
        payload = self._payload(data) if obj else None  # read first: a local backend may move a file away
        self.backing.put(key, data, if_absent=if_absent, if_version=if_version)
        if obj and payload is not None:
            self._pending[int(obj.group(1))] = (obj.group(2), payload)
            while len(self._pending) > MAX_PENDING:
                self._pending.pop(min(self._pending))
        committed = MANIFEST_KEY.match(key) if self.rdma_trainer is not None else None
        if committed:
            try:  # never raises: the commit happened, and a retried manifest put would find it taken
                self._offer(int(committed.group(1)), data)
            except Exception:
                log.exception("%s: offering step %s over NIXL failed; consumers read it from the store", self.root,
                              committed.group(1))

    def _payload(self, data: Data) -> bytes | None:
        assert self.rdma_trainer is not None
        size = Path(data).stat().st_size if isinstance(data, Path) else len(as_buffer(data))  # bytes have no nbytes
        if size > self.rdma_trainer.outbox.capacity:
            return None  # the offer says why (RingFullError) without holding the bytes
        return Path(data).read_bytes() if isinstance(data, Path) else bytes(as_buffer(data))

    def _offer(self, step: int, manifest_data: Data) -> None:
        assert self.rdma_trainer is not None
        pending = self._pending.pop(step, None)
        for old in [s for s in self._pending if s < step]:
            del self._pending[old]
        try:
            raw = manifest_data.read_bytes() if isinstance(manifest_data, Path) else as_buffer(manifest_data)
            manifest = decode(bytes(raw), Manifest, where=f"{self.root} step {step} manifest", max_bytes=len(raw))
        except (FormatError, OSError) as e:
            self.rdma_trainer.skip(step, f"manifest unreadable: {e}")
            return
        if pending is None:
            self.rdma_trainer.skip(step, f"object of {manifest.object_bytes} bytes larger than a ring slot "
                                           f"({self.rdma_trainer.outbox.capacity}) or not seen")
            return
        name, payload = pending
        objects = [(p.object, p.object_bytes) for p in manifest.objects] if hasattr(manifest, "objects") else [
            (manifest.object, manifest.object_bytes)]
        if objects != [(name, len(payload))]:  # a multi-part step (one object per rank) goes by the store here
            self.rdma_trainer.skip(step, f"the object put ({name}, {len(payload)} bytes) is not the step's only object "
                                    f"({objects[:3]})")
            return
        self.rdma_trainer.offer(step, payload, sha256=manifest.objects[0].object_sha256)  # hashed once, by the writer

    # --- the consumer's hook: a step's object from the ring, asked for by a reader that holds its manifest ---

    def get(self, key: str, *, start: int = 0, end: int | None = None) -> bytes:
        return self.backing.get(key, start=start, end=end)

    def get_file(self, key: str, local: Path) -> None:
        self.backing.get_file(key, local)

    def read_verified(self, step: int, name: str, nbytes: int, sha256: str) -> SlotLease | None:
        """Step ``step``'s object ``name`` held in the inbox, checked against the manifest's ``nbytes`` and
        ``sha256`` (the only hash of these bytes: the caller opens them as they are); None (why recorded)
        where the store must serve it. Release the lease once the object is closed."""
        if self.consumer is None:
            return None
        try:
            lease = self.consumer.lease(step, sha256=sha256)
        except (RdmaError, DeltaSyncError) as e:
            self._missed_ring(step, e)
            return None
        if lease.info.length != nbytes:  # the SHA-256 matched, so this cannot happen short of a collision
            lease.release()
            self._missed_ring(step, RdmaError(f"{lease.info.length} bytes, manifest says {nbytes}"))
            return None
        self.consumer.arrived[step] = "rdma"
        return lease

    def _missed_ring(self, step: int, e: Exception) -> None:
        assert self.consumer is not None
        self.consumer.arrived[step] = f"store: {type(e).__name__}"
        log.info("%s: step %d from the store: %s", self.consumer.id, step, e)

    # --- everything else is the backing store's ---

    def list(self, prefix: str = "") -> list[Entry]:
        return self.backing.list(prefix)

    def delete(self, key: str) -> None:
        self.backing.delete(key)

    def get_versioned(self, key: str) -> tuple[bytes, str]:
        return self.backing.get_versioned(key)

    def exists(self, key: str) -> bool:
        return self.backing.exists(key)

    def delete_tree(self, prefix: str) -> None:
        self.backing.delete_tree(prefix)

    def children(self, prefix: str = "") -> builtins.list[str]:
        return self.backing.children(prefix)

    def local_path(self, key: str) -> Path | None:
        return self.backing.local_path(key) if self.capabilities.local_files else None

    def close(self) -> None:
        """Close the trainer's fast path (waiting for reads in flight, at most the ack deadline) and the store."""
        try:
            if self.rdma_trainer is not None:
                self.rdma_trainer.close()
        finally:
            self.backing.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"NixlTransport({self.backing!r}, {'trainer' if self.rdma_trainer is not None else 'consumer'})"
