"""The consumer's view of a stream: list steps, wait for one, open it, rebuild the weights of any step."""

from __future__ import annotations

import logging
import time
import weakref
from collections import OrderedDict
from collections.abc import Callable, Collection
from pathlib import Path
from typing import Any, Protocol

import torch

from deltasync.errors import (
    FormatError,
    StepNotFoundError,
    WaitTimeoutError,
)
from deltasync.format.objects import StepObject
from deltasync.format.parts import PartedObject
from deltasync.node_cache import NodeCache
from deltasync.stages.apply import Replica, Verify
from deltasync.store import Manifest, Part, Store
from deltasync.trust import SignedStep, TrustedKeys, newest_trusted

# deltas up to this size are fetched from a remote store into memory and opened from there (no cache file);
# anchors and larger deltas go through the download cache and are read from the file
MEMORY_OBJECT_BYTES = 64 << 20

log = logging.getLogger(__name__)


class _CachedObject(StepObject):
    """A step object opened from the store's download cache: closing it (or dropping it) lets the cached
    file go, so that a long-running reader keeps only the objects it has open."""

    def __init__(self, path: Path, *, where: str, release: Callable[[], None]) -> None:
        self._release = weakref.finalize(self, release)  # runs once: on close, or when dropped unclosed
        try:
            super().__init__(path, where=where)
        except BaseException:
            self._release()
            raise

    def close(self) -> None:
        super().close()
        self._release()


class HeldBytes(Protocol):
    """A step object's bytes held in memory by an :class:`ObjectSource`, checked against the manifest already."""

    def view(self) -> memoryview:
        """The object's bytes, in place (no copy)."""

    def check(self) -> None:
        """Raise (a ``DeltaSyncError``) if the bytes changed since they were checked."""

    def release(self) -> None:
        """Let the source reuse the memory (called once, when the object opened on it is closed or dropped)."""


class ObjectSource(Protocol):
    """Where a :class:`StreamReader` asks for a step's object before the store (``objects=``): the NIXL inbox of
    an ``RdmaConsumer``. Manifests always come from the store (they are the commit); only the object may come
    from elsewhere, and only bytes that match the manifest's size and SHA-256 are accepted.
    """

    def held(self, step: int, *, name: str, nbytes: int, sha256: str) -> HeldBytes | None:
        """Step ``step``'s single object ``name`` held in memory, its ``nbytes`` bytes already checked against
        ``sha256`` (the manifest's: the only hash of these bytes, the reader opens them as they are), or None
        (never raising: why is the source's to record) where the store must serve it."""


class _HeldObject(StepObject):
    """A step object opened in place on bytes an :class:`ObjectSource` holds for it (the NIXL inbox), already
    checked against the manifest's size and SHA-256 there. The holder's ``check`` runs again after every read of
    the bytes, so a change under the object is refused rather than decoded; closing (or dropping) the object
    releases the bytes."""

    def __init__(self, held: HeldBytes, *, where: str) -> None:
        self._held = held
        self._release = weakref.finalize(self, held.release)
        try:
            super().__init__(held.view(), where=where)
        except BaseException:
            self._release()
            raise

    def _read_into(self, key: str, out: Any) -> None:
        super()._read_into(key, out)
        self._held.check()

    def close(self) -> None:
        super().close()
        self._release()


MANIFEST_CACHE_BYTES = 64 << 20  # what a reader keeps of parsed manifests (estimated: _manifest_cost)
RECORDS = 4  # manifests (and signatures) kept as stored: the newest few a watch read
RECORD_BYTES = 1 << 20


def _manifest_cost(m: Manifest) -> int:
    """About what a parsed manifest holds in memory, from its shape (measured with tracemalloc on 256-part
    manifests: ~230 bytes per tensor range of a part, ~600 per part; rounded up). Counting is what makes it
    cheap: encoding the manifest again to measure it cost 50 ms a manifest of 256 parts."""
    parts = m.objects
    ranges = sum(len(p.tensors) for p in parts if p.tensors is not None)
    return 4096 + 800 * len(parts) + 320 * ranges + 400 * len(m.aliases or ())


class StreamReader:
    """Read a deltasync stream from any fsspec URL. Objects are verified (size, SHA-256) before use.

    From a remote store, a delta of at most ``memory_object_bytes`` (default 64 MiB) is fetched into memory
    and opened from there; anchors and larger deltas are downloaded into a cache (``cache_dir``, else a
    temporary folder) and read from the file, which is deleted again when the object is closed. ``node_cache``
    (a folder or ``deltasync.NodeCache``; default ``DELTASYNC_NODE_CACHE``) shares downloads with the host's
    other processes (deltasync/node_cache.py). ``close()``
    (or a ``with`` block) removes the cache; a reader that is dropped or still open at interpreter exit is
    cleaned up too. A reader made from a ``Store`` leaves closing that store to its owner.

    ``trusted_keys`` (a ``TrustedKeys``: the public keys made by ``deltasync keygen`` and the stream they sign
    for, ``TrustedKeys.load(files, stream_id=...)``): every step this reader reads must be signed by one of them
    for that stream, over its manifest as stored (docs/FORMAT.md section 5e); otherwise ``UnsignedStepError``,
    ``UntrustedKeyError`` or ``SignatureError`` names the step, and nothing of it is read. Such a reader's
    newest step (``latest_step``) is the newest a trusted key signed: a forged manifest does not exist for it,
    and a chain's signatures are accepted oldest first (``chain``).

    ``objects`` (an :class:`ObjectSource`: an ``RdmaConsumer``'s NIXL inbox) is asked first for the object of a
    single-object step this reader opens, with the manifest's size and SHA-256; where it has none, the store
    serves it. Manifests always come from the store.
    """

    def __init__(
        self,
        url: str | Store,
        *,
        storage_options: dict[str, Any] | None = None,
        cache_dir: str | Path | None = None,
        node_cache: NodeCache | str | Path | None = None,
        memory_object_bytes: int | None = None,
        trusted_keys: Any = None,
        objects: ObjectSource | None = None,
    ) -> None:
        # read when a reader is made (not when this module is imported): tests lower it to cover the cache path
        self.memory_object_bytes = MEMORY_OBJECT_BYTES if memory_object_bytes is None else memory_object_bytes
        self.objects = objects
        self._manifests: OrderedDict[int, tuple[Manifest, int, SignedStep | None]] = OrderedDict()
        self._manifest_bytes = 0
        # the last few manifests and signatures as stored (a mirror copies them byte for byte without a second GET)
        self._records: OrderedDict[int, tuple[Manifest, str, bytes, bytes | None]] = OrderedDict()
        # with keys, every manifest this reader returns is of a step a trusted key signed (docs/FORMAT.md 5e)
        self.trusted = None if trusted_keys is None else TrustedKeys.load(trusted_keys)
        self._owns_store = not isinstance(url, Store)
        self.store = url if isinstance(url, Store) else Store(url, storage_options=storage_options, cache_dir=cache_dir,
                                                                 node_cache=node_cache)
        self.refused: dict[int, str]  # with trusted keys: steps that do not count as committed, and why

    @property
    def url(self) -> str:
        return self.store.url

    @property
    def trusted(self) -> TrustedKeys | None:
        """The trust this reader checks every step with (None: origin unchecked)."""
        return self._trusted

    @trusted.setter
    def trusted(self, trust: Any) -> None:
        # committed manifests never change: kept to save a GET each, least recently used first out, bounded in
        # bytes (a version-2 manifest of 64 ranks x 300 tensors is megabytes: a count would not bound memory);
        # new trust: those read before it are read (and checked) again
        self._trusted = None if trust is None else TrustedKeys.load(trust)
        self._manifests.clear()
        self._records.clear()
        self._manifest_bytes = 0
        self.refused = {}

    def close(self) -> None:
        """Remove the downloaded objects and the cache folder (of the store this reader made)."""
        self._manifests.clear()
        self._manifest_bytes = 0
        if self._owns_store:
            self.store.close()

    def __enter__(self) -> StreamReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def steps(self) -> list[int]:
        return self.store.steps()

    def latest_step(self) -> int | None:
        """The newest committed step (a listing); with trusted keys, the newest one a trusted key signed (an
        unsigned or forged manifest past it is skipped and logged once: docs/FORMAT.md section 5e)."""
        if self.trusted is None:
            return self.store.latest_step()
        return newest_trusted(self.store.steps(), lambda s: self.manifest(s, nearby=False), refused=self.refused,
                              where=self.url)

    def manifest(self, step: int, *, nearby: bool = True) -> Manifest:
        """Step ``step``'s manifest, read once and kept (see ``Store.manifest`` for ``nearby``); with trusted keys,
        only once its signature proved it (``signed``)."""
        return self._entry(step, nearby=nearby)[0]

    def record(self, step: int) -> tuple[Manifest, str, bytes, bytes | None]:
        """Step ``step``'s manifest, the SHA-256 of its bytes, those bytes and its ``signature.json`` (None: none),
        as stored: from what this reader read last where it can (a mirror copies the step the watch just saw
        without reading it again), else read now. Nothing here is checked against trusted keys: a caller that
        copies checks it (the mirror does)."""
        hit = self._records.get(step)
        if hit is not None:  # an untrusted reader did not read the signature: read now
            return hit if self.trusted is not None else (*hit[:3], self.store.signature(step))
        m, digest, raw = self.store.manifest_record(step)
        return m, digest, raw, self.store.signature(step)

    def signed(self, step: int) -> SignedStep | None:
        """What step ``step``'s signature proved (its key, the model files it vouches for), None without trusted
        keys; raises what ``manifest`` raises."""
        return self._entry(step, nearby=False)[2]

    def _entry(self, step: int, *, nearby: bool) -> tuple[Manifest, int, SignedStep | None]:
        hit = self._manifests.get(step)
        if hit is not None:
            self._manifests.move_to_end(step)
            return hit
        signed = None
        m, digest, raw = self.store.manifest_record(step, nearby=nearby)
        signature = self.store.signature(step) if self.trusted is not None else None
        if len(raw) <= RECORD_BYTES:
            self._records[step] = (m, digest, raw, signature)
            while len(self._records) > RECORDS:
                self._records.popitem(last=False)
        if self.trusted is not None:  # checked once: only a manifest that passed is kept
            signed = self.trusted.check(signature, m, manifest_sha256=digest, where=self.url)
        entry = (m, _manifest_cost(m), signed)
        if entry[1] <= MANIFEST_CACHE_BYTES:
            self._manifests[step] = entry
            self._manifest_bytes += entry[1]
            while self._manifest_bytes > MANIFEST_CACHE_BYTES:
                _, (_, freed, _) = self._manifests.popitem(last=False)
                self._manifest_bytes -= freed
        return entry

    def wait_for(self, step: int | None = None, *, timeout_s: float = 60.0, poll_s: float = 0.05) -> int:
        """Block until ``step`` (or, with None, any step) is committed; returns the latest committed step."""
        from deltasync.watch import PollPolicy, StepWatch

        deadline = time.monotonic() + timeout_s
        watch = StepWatch(self, PollPolicy(fast_s=poll_s, idle_max_s=max(poll_s, 1.0)))  # one small read a poll
        try:
            while True:
                latest = watch.newest()
                if latest is not None and (step is None or latest >= step):
                    return latest
                left = deadline - time.monotonic()
                if left <= 0:
                    raise WaitTimeoutError(
                        f"{self.url}: step {step if step is not None else '(any)'} not committed within {timeout_s}s "
                        f"(latest: {latest})", url=self.url, step=step, found=latest,
                    )
                watch.wait(min(left, poll_s))
        finally:
            watch.close()

    def open(self, step: int, *, names: Collection[str] | None = None, base: int | None = None) -> StepObject:
        """Fetch, verify and open one step's object. Close it when done (a ``with`` block): a downloaded
        object is deleted once nobody has it open.

        A multi-part step (docs/FORMAT.md section 5b) opens as one ``PartedObject`` over its parts. With
        ``names``, only the parts that hold those tensors are fetched, and the object holds only them.
        ``base``: the step the consumer holds; an anchor step that carries its delta from ``base`` opens as
        that delta (a few bytes instead of the dense anchor).
        """
        m = self.manifest(step)
        if base is not None and m.delta is not None and m.delta.base_step == base:
            m = m.as_delta()
        where = f"{self.url} step {step}"
        if m.is_multipart:
            parts = [p for p in m.objects if names is None or not set(names).isdisjoint(p.tensors or ())]
            objects: list[StepObject] = []
            try:
                for p in parts:
                    objects.append(self._open_part(m, p, f"{where} part {p.object}"))
            except BaseException:
                for o in objects:
                    o.close()
                raise
            return PartedObject(m, objects, where=where, parts=parts, names=names)
        return self._agreeing(self._open_part(m, m.objects[0], where), m)

    def open_unhashed(self, step: int) -> StepObject | None:
        """``open(step)`` without the SHA-256 check, for a reader that hashes the object's bytes as it reads
        them (``StepObject.read_tensors_hashed``) and then calls ``store.check_sha256``: nothing read from it
        is proven before that. None where this cannot be done (a remote store, several parts, a reader
        with an object source, which holds checked objects): then ``open``."""
        m = self.manifest(step)
        if self.objects is not None:
            return None
        path = self.store.local_object_unhashed(m)
        return None if path is None else self._agreeing(StepObject(path, where=f"{self.url} step {step}"), m)

    def _agreeing(self, obj: StepObject, m: Manifest) -> StepObject:
        """``obj``, whose header names the manifest's step, kind and base, or a ``FormatError`` (``obj`` closed)."""
        h = obj.header
        if h.step != m.step or h.kind != m.kind or h.base_step != m.base_step or h.is_part:
            obj.close()
            part = " is a part of a multi-part step (format_version 2) and" if h.is_part else ""
            raise FormatError(
                f"{self.url} step {m.step}: object header (step {h.step}, {h.kind}){part} disagrees with its manifest "
                f"(step {m.step}, {m.kind}, format_version {m.format_version})"
            )
        return obj

    def _open_part(self, m: Manifest, part: Part, where: str) -> StepObject:
        """One object of a step: held by the object source (the NIXL inbox), read in place (local), fetched into
        memory (small remote deltas) or through the download cache."""
        held = self._held(m, part)
        if held is not None:
            return _HeldObject(held, where=where)
        if self.store.is_local:
            return StepObject(self.store.fetch_object(m, part=part), where=where)
        if m.kind == "delta" and part.object_bytes <= self.memory_object_bytes:
            return StepObject(self.store.read_object(m, part=part), where=where)
        path = self.store.fetch_object(m, part=part, hold=True)
        store = self.store
        return _CachedObject(path, where=where, release=lambda: store.release_object(m, part))

    def _held(self, m: Manifest, part: Part) -> HeldBytes | None:
        """The object's bytes from the object source (the NIXL consumer's inbox: hashed once as they landed,
        against this manifest), or None."""
        if self.objects is None or m.is_multipart:  # the ring carries single-object steps only
            return None
        return self.objects.held(m.step, name=part.object, nbytes=part.object_bytes, sha256=part.object_sha256)

    def fetch_bytes(self, m: Manifest) -> bytes:
        """A single-object step's object fetched into memory, checked against its manifest's size and SHA-256."""
        return self.store.read_object(m)

    def chain(self, step: int, *, start: int | None = None, max_walk: int = 64) -> list[int]:
        """Steps to open, in order, to reach ``step``: from the nearest anchor, or from ``start`` (the step a
        consumer holds; not included) where a path of deltas leads from it, crossing anchors by their own
        deltas (docs/FORMAT.md section 6; open each step with ``open(s, base=<the step before it>)``) and
        costing fewer bytes than the way from the anchor. At most ``max_walk`` manifests below the nearest
        anchor are read looking for such a path.
        """
        out: list[int] = []
        cost = 0  # bytes to fetch along ``out``, anchors by their own delta
        plain: tuple[list[int], int] | None = None  # the chain from the nearest anchor and its bytes
        s: int | None = step
        while s is not None and s != start:
            if plain is not None and (start is not None and s < start or len(out) - len(plain[0]) >= max_walk):
                break  # past the step held, or too far: no (short) path from it; the nearest anchor serves
            try:
                m = self.manifest(s)
            except StepNotFoundError as e:
                if plain is not None:
                    break  # a step below the nearest anchor is gone: the anchor still serves
                raise StepNotFoundError(f"{self.url}: the chain to step {step} is broken at step {s}: {e}",
                                        url=self.url, step=s) from None
            out.append(s)
            if m.kind == "anchor":
                if plain is None:
                    plain = (list(out), cost + m.object_bytes)
                if start is None or m.delta is None:
                    break
                cost += m.delta.object_bytes
                s = m.delta.base_step
            else:
                cost += m.object_bytes
                s = m.base_step
        if start is not None and s == start and (plain is None or cost <= plain[1]):
            chosen = out[::-1]
        else:
            chosen = (plain[0] if plain is not None else out)[::-1]
        if self.trusted is not None and chosen:  # the keys of the whole chain, oldest first (FORMAT.md section 5e)
            held = [start] if start is not None and start < chosen[0] and start in self._manifests else []
            self.trusted.accept_chain([signed for x in held + chosen if (signed := self.signed(x)) is not None],
                                      where=self.url)
        return chosen

    def replica(self, step: int | None = None, *, verify: Verify = "incremental", device: str = "cpu") -> Replica:
        """The exact weights of ``step`` (default: latest), from its nearest anchor plus deltas."""
        if step is None:
            step = self.latest_step()
            if step is None:
                raise StepNotFoundError(f"{self.url}: the stream has no committed steps", url=self.url)
        chain = self.chain(step)
        with self.open(chain[0]) as obj:
            rep = Replica.from_anchor(obj, device=device)
        for s in chain[1:]:
            with self.open(s) as obj:
                rep.apply(obj, verify=verify)
        return rep

    def catch_up(self, replica: Replica, step: int | None = None, *, verify: Verify = "incremental") -> list[int]:
        """Advance ``replica`` to ``step`` (default: latest) by the shortest chain; returns the steps applied."""
        if step is None:
            step = self.wait_for(timeout_s=0)
        if step == replica.step:
            return []
        chain = self.chain(step, start=replica.step)
        for s in chain:
            with self.open(s, base=replica.step) as obj:
                replica.apply(obj, verify=verify)
        return chain

    def state_dict(self, step: int | None = None) -> dict[str, torch.Tensor]:
        """The weights of ``step`` as a state dict with every trainer name (aliases included)."""
        return self.replica(step).state_dict()
