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
    CatchupError,
    DeltaSyncError,
    FormatError,
    StepNotFoundError,
    WaitTimeoutError,
)
from deltasync.follow.chain_plan import cheapest_chain
from deltasync.format.documents import CatchupManifest
from deltasync.format.objects import StepObject
from deltasync.format.parts import PartedObject
from deltasync.stages.apply import Replica, Verify
from deltasync.store import Manifest, Part, Store, catchup_dir, open_store
from deltasync.store.location import StoreLocation, Where
from deltasync.store.node_cache import NodeCache
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
    from elsewhere, and only bytes that match the manifest's size and digest are accepted.
    """

    def held(self, step: int, *, name: str, nbytes: int, digest: str) -> HeldBytes | None:
        """Step ``step``'s single object ``name`` held in memory, its ``nbytes`` bytes already checked against
        ``digest`` (the manifest's, prefixed with its algorithm: the only hash of these bytes, the reader opens them
        as they are), or None (never raising: why is the source's to record) where the store must serve it."""


class _HeldObject(StepObject):
    """A step object opened in place on bytes an :class:`ObjectSource` holds for it (the NIXL inbox), already
    checked against the manifest's size and digest there. The holder's ``check`` runs again after every read of
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
CATCHUP_LIST_S = 30.0  # a listing of catch-ups is reused this long (new ones appear within it)
CATCHUPS_KEPT = 4096  # checked catch-ups kept per reader (a manifest each: about 1 KiB)


def _manifest_cost(m: Manifest) -> int:
    """About what a parsed manifest holds in memory, from its shape (measured with tracemalloc on 256-part
    manifests: ~230 bytes per tensor range of a part, ~600 per part; rounded up). Counting is what makes it
    cheap: encoding the manifest again to measure it cost 50 ms a manifest of 256 parts."""
    parts = m.objects
    ranges = sum(len(p.tensors) for p in parts if p.tensors is not None)
    return 4096 + 800 * len(parts) + 320 * ranges + 400 * len(m.aliases or ())


class StreamReader:
    """Read a deltasync stream from any fsspec URL. Objects are verified (size, digest: BLAKE3, SHA-256
    in older streams) before use.

    From a remote store, a delta of at most ``memory_object_bytes`` (default 64 MiB) is fetched into memory
    and opened from there; anchors and larger deltas are downloaded into a cache (``cache_dir``, else a
    temporary folder) and read from the file, which is deleted again when the object is closed. ``node_cache``
    (a folder or ``deltasync.NodeCache``; default ``DELTASYNC_NODE_CACHE``) shares downloads with the host's
    other processes (deltasync/store/node_cache.py). ``close()``
    (or a ``with`` block) removes the cache; a reader that is dropped or still open at interpreter exit is
    cleaned up too. A reader made from a ``Store`` leaves closing that store to its owner.

    ``trusted_keys`` (a ``TrustedKeys``: the public keys made by ``deltasync keygen`` and the stream they sign
    for, ``TrustedKeys.load(files, stream_id=...)``): every step this reader reads must be signed by one of them
    for that stream, over its manifest as stored (docs/FORMAT.md section 5e); otherwise ``UnsignedStepError``,
    ``UntrustedKeyError`` or ``SignatureError`` names the step, and nothing of it is read. Such a reader's
    newest step (``latest_step``) is the newest a trusted key signed: a forged manifest does not exist for it,
    and a chain's signatures are accepted oldest first (``chain``).

    ``objects`` (an :class:`ObjectSource`: an ``RdmaConsumer``'s NIXL inbox) is asked first for the object of a
    single-object step this reader opens, with the manifest's size and digest; where it has none, the store
    serves it. Manifests always come from the store.
    """

    def __init__(
        self,
        url: Where,
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
        self.store, self._owns_store = open_store(url, storage_options, cache_dir=cache_dir, node_cache=node_cache)
        self.refused: dict[int, str]  # with trusted keys: steps that do not count as committed, and why
        # catch-up deltas (docs/FORMAT.md section 5g): the last listing, those checked, those refused (and why)
        self.catchups = True  # False: chains never go through catch-ups (a transport that holds steps only)
        self._catchup_listing: tuple[float, dict[int, dict[int, int]]] | None = None
        self._catchups: OrderedDict[tuple[int, int], tuple[CatchupManifest, SignedStep | None]] = OrderedDict()
        self.refused_catchups: dict[tuple[int, int], str] = {}

    @property
    def url(self) -> str:
        return self.store.url

    @property
    def location(self) -> StoreLocation:
        """Where the stream is: the store's URL and options (what an engine reading the same stream is sent)."""
        return self.store.location

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
        self._catchups = OrderedDict()
        self.refused_catchups = {}

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
        from deltasync.follow.watch import PollPolicy, StepWatch

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
        that delta (a few bytes instead of the dense anchor), and a step that ``chain`` reached by a catch-up delta
        from ``base`` (docs/FORMAT.md section 5g) opens as that catch-up (``CatchupError`` where it turns out
        unusable: it is refused from then on, and the next ``chain`` takes another way).
        """
        m = self.manifest(step)
        if base is not None and m.delta is not None and m.delta.base_step == base:
            m = m.as_delta()
        elif base is not None and m.base_step != base and (step, base) in self._catchups:
            return self._open_catchup(step, base)
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
        """``open(step)`` without the digest check, for a reader that hashes the object's bytes as it reads
        them (``StepObject.read_tensors_hashed``) and then calls ``store.check_digest``: nothing read from it
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
        held = self.objects.held(m.step, name=part.object, nbytes=part.object_bytes, digest=part.digest)
        if held is not None and len(held.view()) != part.object_bytes:  # a source of another's making: not believed
            log.warning("%s step %d: the object source held %d bytes for %s, the manifest says %d: read from the "
                        "store", self.url, m.step, len(held.view()), part.object, part.object_bytes)
            held.release()
            return None
        return held

    def fetch_bytes(self, m: Manifest) -> bytes:
        """A single-object step's object fetched into memory, checked against its manifest's size and digest."""
        return self.store.read_object(m)

    def chain(self, step: int, *, start: int | None = None, max_walk: int = 64, catchup: bool = True,
              anchors: bool = True) -> list[int]:
        """Steps to open, in order, to reach ``step``: the way of fewest bytes from the nearest anchor, or from
        ``start`` (the step a consumer holds; not included) through steps' deltas, anchors' own deltas and (with
        ``catchup``) catch-up deltas (docs/FORMAT.md sections 6 and 5g). Open each step with ``open(s, base=<the
        step before it>)``. At most ``max_walk`` manifests below the nearest anchor are read looking for a way
        from ``start``.

        Catch-ups are listed (one listing, reused for ``CATCHUP_LIST_S``) only when ``step`` is more than one
        object from ``start``; each one on the chosen way is read and checked (its manifest, its signature with
        trusted keys, its state checksums against the steps') before the way is final, and one that fails is
        refused (logged) and the way planned again without it. ``anchors=False``: only ways from ``start``
        (``StepNotFoundError`` where there is none), for a writer that merges what lies between.
        """
        use = catchup and self.catchups and self.objects is None  # over NIXL each step arrives as itself
        for _ in range(8):  # each round refuses a catch-up or learns its true size; then the plain chain
            hops = cheapest_chain(step, start=start, max_walk=max_walk, anchors=anchors,
                                  manifest=self.manifest,
                                  catchups=self._catchups_into(step, start) if use else None)
            if all(h.base is None or h.kind != "catchup" or self._checked_catchup(h.step, h.base, h.nbytes)
                   for h in hops):
                break
        else:
            hops = cheapest_chain(step, start=start, max_walk=max_walk, anchors=anchors, manifest=self.manifest)
        chosen = [h.step for h in hops]
        if self.trusted is not None and chosen:  # the keys of the whole chain, oldest first (FORMAT.md section 5e)
            held = [start] if start is not None and start < chosen[0] and start in self._manifests else []
            signed = [signed for x in held + chosen if (signed := self.signed(x)) is not None]
            signed += [s for h in hops if h.kind == "catchup" and h.base is not None
                       and (s := self._catchups[(h.step, h.base)][1]) is not None]
            self.trusted.accept_chain(signed, where=self.url)
        return chosen

    # --- catch-up deltas (docs/FORMAT.md section 5g) ---

    def _catchups_into(self, step: int, start: int | None) -> Callable[[int], list[tuple[int, int]]]:
        """For the planner: the catch-ups into a step, ``(base, bytes)``, known or listed (once, and only when
        ``step`` is more than one object from ``start``), refused ones left out."""
        def into(s: int) -> list[tuple[int, int]]:
            if s == step and start is not None:
                m = self.manifest(step, nearby=False)
                if start in (m.base_step, m.delta.base_step if m.delta is not None else None):
                    return []  # one object away: no listing
            listing = self._listing()
            return [(a, n) for a, n in listing.get(s, {}).items() if (s, a) not in self.refused_catchups]
        return into

    def _listing(self) -> dict[int, dict[int, int]]:
        now = time.monotonic()
        if self._catchup_listing is None or now - self._catchup_listing[0] > CATCHUP_LIST_S:
            found: dict[int, dict[int, int]] = {}
            for e in self.store.catchup_entries():
                if e.committed:
                    known = self._catchups.get((e.step, e.base_step))
                    nbytes = known[0].object_bytes if known else max(e.object_bytes, 8)
                    found.setdefault(e.step, {})[e.base_step] = nbytes
            self._catchup_listing = (now, found)
        return self._catchup_listing[1]

    def _checked_catchup(self, step: int, base: int, planned_bytes: int) -> bool:
        """Whether the catch-up ``base`` -> ``step`` is usable as planned: read and checked once (refused, and
        logged, where it is not), costing what its manifest says (False where that differs from the plan)."""
        try:
            cm = self.catchup(step, base)
        except DeltaSyncError as e:
            self.refuse_catchup(step, base, e)
            return False
        if cm.object_bytes != planned_bytes and self._catchup_listing is not None:
            self._catchup_listing[1].setdefault(step, {})[base] = cm.object_bytes
            return False
        return True

    def catchup(self, step: int, base: int) -> CatchupManifest:
        """The catch-up delta from ``base`` to ``step`` (docs/FORMAT.md section 5g), read and checked once (its
        manifest; its signature with trusted keys; its state checksums against the two steps' manifests), after
        which ``open(step, base=base)`` opens it. Raises ``StepNotFoundError`` (none committed), ``FormatError``
        or ``SignatureError``; it does not refuse it (``chain`` does)."""
        hit = self._catchups.get((step, base))
        if hit is None:
            hit = self._read_catchup(step, base)
            self._catchups[(step, base)] = hit
            while len(self._catchups) > CATCHUPS_KEPT:
                self._catchups.popitem(last=False)
        return hit[0]

    def _read_catchup(self, step: int, base: int) -> tuple[CatchupManifest, SignedStep | None]:
        cm, digest, _ = self.store.catchup_record(step, base)
        where = f"{self.url} catch-up {base}->{step}"
        signed = None
        if self.trusted is not None:
            signed = self.trusted.check_catchup(self.store.catchup_signature(step, base), cm, manifest_sha256=digest,
                                                where=self.url)
        if cm.state_checksum != self.manifest(step, nearby=False).state_checksum:
            raise FormatError(f"{where}: its state checksum {cm.state_checksum[:16]}… is not step {step}'s "
                              f"{self.manifest(step).state_checksum[:16]}…")
        try:
            held = self.manifest(base, nearby=False).state_checksum
        except StepNotFoundError:
            held = None  # collected: the consumer still holds its bits, which step ``step``'s checksums prove after
        if held is not None and cm.base_state_checksum != held:
            raise FormatError(f"{where}: its base state checksum {cm.base_state_checksum[:16]}… is not step "
                              f"{base}'s {held[:16]}…")
        return cm, signed

    def refuse_catchup(self, step: int, base: int, why: BaseException | str) -> None:
        """Never use the catch-up ``base`` -> ``step`` again (it is logged once, with ``why``)."""
        if (step, base) not in self.refused_catchups and len(self.refused_catchups) < 100_000:
            self.refused_catchups[(step, base)] = str(why)
            log.warning("%s: not using the catch-up from step %d to step %d (taking the steps' own objects): %s%s",
                        self.url, base, step, f"{type(why).__name__}: " if isinstance(why, BaseException) else "", why)
        self._catchups.pop((step, base), None)

    def _open_catchup(self, step: int, base: int) -> StepObject:
        cm = self._catchups[(step, base)][0]
        m = cm.as_manifest(catchup_dir(step, base))
        where = f"{self.url} catch-up {base}->{step}"
        try:
            obj = self._agreeing(self._open_part(m, m.objects[0], where), m)
            if obj.header.state_checksum != cm.state_checksum:
                obj.close()
                raise FormatError(f"{where}: the object's state checksum disagrees with its manifest's")
            return obj
        except DeltaSyncError as e:
            self.refuse_catchup(step, base, e)
            raise CatchupError(f"{where}: unusable ({type(e).__name__}: {e}); refused, the next chain takes another "
                               "way") from e

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
            with self.open(s, base=rep.step) as obj:  # a catch-up from the step before, where the way took one
                rep.apply(obj, verify=verify)
        return rep

    def catch_up(self, replica: Replica, step: int | None = None, *, verify: Verify = "incremental") -> list[int]:
        """Advance ``replica`` to ``step`` (default: latest) by the way of fewest bytes (``chain``); returns the steps
        applied. A catch-up that turns out unusable on the way is refused and the rest planned again."""
        if step is None:
            step = self.wait_for(timeout_s=0)
        applied: list[int] = []
        for _ in range(8):  # a catch-up found unusable on the way is refused: plan again from where the replica is
            if step == replica.step:
                break
            try:
                for s in self.chain(step, start=replica.step):
                    with self.open(s, base=replica.step) as obj:
                        replica.apply(obj, verify=verify)
                    applied.append(s)
            except CatchupError:
                continue
        else:
            for s in self.chain(step, start=replica.step, catchup=False):
                with self.open(s, base=replica.step) as obj:
                    replica.apply(obj, verify=verify)
                applied.append(s)
        return applied

    def state_dict(self, step: int | None = None) -> dict[str, torch.Tensor]:
        """The weights of ``step`` as a state dict with every trainer name (aliases included)."""
        return self.replica(step).state_dict()


def open_reader(where: Where, storage_options: dict[str, Any] | None = None,
                **kwargs: Any) -> tuple[StreamReader, bool]:
    """The reader ``where`` is (a ``StreamReader`` given is used as it is), else one opened on the store or the
    location :meth:`~deltasync.store.location.StoreLocation.of` resolves (``kwargs``: the ``StreamReader``'s);
    and whether it was opened here (then the caller closes it). ``ConfigError`` for storage options beside a reader."""
    if isinstance(where, StreamReader):
        StoreLocation.of(where, storage_options)  # options beside a reader are refused, not ignored
        return where, False
    if isinstance(where, Store):
        StoreLocation.of(where, storage_options)
        return StreamReader(where, **kwargs), True
    return StreamReader(StoreLocation.of(where, storage_options), **kwargs), True
