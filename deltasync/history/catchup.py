"""Write catch-up deltas: one object that takes a follower from a step A straight to a later step B
(docs/FORMAT.md section 5g).

Why a separate writer, not the publisher: a catch-up is built from what the store already holds, so writing it
costs the trainer nothing (no accelerator memory, no host memory, no time in the training loop), it can run on
any machine that can read and write the store (beside a mirror, on a CPU node), it can be added to a stream that
exists, and a writer that dies leaves only an uncommitted folder. What it costs instead: catch-ups appear a few
seconds after their step is committed, and each one is read back from the store (the objects it spans).

How one is built: the objects on the cheapest way from A to B (steps' deltas, anchors' own deltas, shorter
catch-ups already written: ``StreamReader.chain``) are opened, and each tensor's patches are merged (XOR at equal
positions, zeros dropped: XOR patches compose), encoded with the stream's codecs and written as one delta object
whose header is step B's (every tensor, its checksum, the state checksum). Memory: the objects of the way (read
into memory from a remote store), the encoded catch-up twice (its tensors' blobs, then the object) and one
tensor's decoded patches (traced: 20 MB of objects + 2 x 8.9 MB + patches for a 64-step catch-up of a 5M-element
model; bench/README.md); nothing the size of the model.
Where no way of deltas joins A to B (an anchor without its own delta between them), nothing is written.

Which pairs (the policy; readers take whatever exists): for each distance ``d`` in ``distances``, the first
committed step of each window of ``d`` step numbers, from the first committed step of the window before (aligned
spans chain like a skip list); and for each consumer whose heartbeat holds a step at least ``min_lag`` behind the
newest, the catch-up from that step to the newest, written again as the newest advances (the one before is
deleted once the new one is committed and ``grace_s`` old).

Example::

    write_catchups("s3://bucket/run-7")                      # one pass
    CatchupWriter("s3://bucket/run-7", signing_key="trainer.key", stream_id="run-7").follow()   # keeps up
"""

from __future__ import annotations

import io
import logging
import threading
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from deltasync.errors import ConfigError, DeltaSyncError, StepExistsError, StepNotFoundError
from deltasync.follow.consumers import read_heartbeats
from deltasync.follow.reader import StreamReader
from deltasync.format import digest as digests
from deltasync.format.codecs import encode_patch
from deltasync.format.documents import CatchupManifest, ManifestStats, StepHeader, TensorHeader
from deltasync.format.objects import StepObject, write_delta
from deltasync.format.patch import Patch
from deltasync.history.replay import check_layout
from deltasync.signing import SigningKey, StreamSigner
from deltasync.store import open_store
from deltasync.store.location import StoreLocation, Where
from deltasync.trust import TrustedKeys, own_trust, writer_signer

log = logging.getLogger(__name__)

__all__ = ["CatchupOptions", "CatchupReport", "CatchupWriter", "merge_patches", "write_catchups"]

LEFTOVER_S = 3600.0  # an uncommitted catch-up folder older than this is removed (its writer is long gone)


@dataclass(frozen=True, kw_only=True)
class CatchupOptions:
    """Which catch-ups a writer keeps (the policy: docs/FORMAT.md section 5g).

    Args:
        distances: aligned spans, in step numbers (each >= 2): from the first committed step of one window of
            ``d`` steps to the first of the next. ``()``: none.
        consumers: also a catch-up from each lagging consumer's held step (its heartbeat) to the newest step.
        min_lag: a consumer that many steps behind the newest, or more, gets one.
        consumer_max_age_s: heartbeats older than this are not served (the consumer is gone).
        max_consumers: at most this many distinct held steps are served (the furthest behind first).
        horizon: only steps among the newest ``horizon`` step numbers get aligned catch-ups (older ones stay
            until garbage collection removes them), bounding a pass's work on a long stream.
        grace_s: a superseded consumer catch-up is deleted once it is this old (a reader may be fetching it).
        zstd_level: the codecs' zstd level (docs/FORMAT.md section 3).
    """

    distances: tuple[int, ...] = (4, 16, 64)
    consumers: bool = True
    min_lag: int = 4
    consumer_max_age_s: float = 86400.0
    max_consumers: int = 16
    horizon: int = 1024
    grace_s: float = 60.0
    zstd_level: int = 1

    def __post_init__(self) -> None:
        if any(isinstance(d, bool) or not isinstance(d, int) or d < 2 for d in self.distances):
            raise ConfigError(f"catch-up distances must be whole numbers of steps, at least 2, got {self.distances!r}")
        for name in ("min_lag", "max_consumers", "horizon"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < (2 if name == "min_lag" else 1):
                raise ConfigError(f"catch-up option {name} must be a whole number (at least "
                                  f"{2 if name == 'min_lag' else 1}), got {v!r}")
        if not 0 <= self.grace_s < 1e9 or not 0 <= self.consumer_max_age_s:
            raise ConfigError("catch-up options grace_s and consumer_max_age_s must be seconds, 0 or more")


@dataclass(kw_only=True)
class CatchupReport:
    """What one pass did: catch-ups written ``(base, step, bytes)`` with the bytes of the steps' own objects they
    replace, ``skipped`` pairs (no way of deltas between them), ``deleted`` pairs and leftovers, and its cost."""

    written: list[tuple[int, int, int]] = field(default_factory=list)
    replaced_bytes: list[int] = field(default_factory=list)  # per written: bytes of the way it was built from
    skipped: list[tuple[int, int]] = field(default_factory=list)
    deleted: list[tuple[int, int]] = field(default_factory=list)
    seconds: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def merge_patches(patches: Sequence[Patch], *, checksum: int) -> Patch:
    """The one patch that does what ``patches`` (changes of one tensor, each from the state the one before left)
    do together: XOR at equal positions, elements whose bits come back dropped. ``checksum``: the tensor's after
    them all (the last step's)."""
    first = patches[0]
    numel = first.numel
    if any(p.positions is None for p in patches):  # a dense one: accumulate in full (the tensor's size, once)
        acc = np.zeros(numel, first.xor.dtype)
        for p in patches:
            if p.positions is None:
                acc ^= p.xor
            else:
                acc[p.positions] ^= p.xor  # positions are unique within a patch: no lost update
        pos = np.flatnonzero(acc).astype(np.int64)
        return Patch(name=first.name, dtype=first.dtype, shape=first.shape, positions=pos, xor=acc[pos],
                     checksum=checksum)
    positions = np.concatenate([p.positions for p in patches if p.positions is not None])
    xor = np.concatenate([p.xor for p in patches])
    order = np.argsort(positions, kind="stable")
    positions, xor = positions[order], xor[order]
    if positions.size:
        starts = np.flatnonzero(np.r_[True, positions[1:] != positions[:-1]])
        positions, xor = positions[starts], np.bitwise_xor.reduceat(xor, starts)
        keep = xor != 0
        positions, xor = positions[keep], xor[keep]
    return Patch(name=first.name, dtype=first.dtype, shape=first.shape, positions=np.ascontiguousarray(positions),
                 xor=np.ascontiguousarray(xor), checksum=checksum)


class CatchupWriter:
    """Keeps a stream's catch-up deltas (docs/FORMAT.md section 5g): ``run_once`` writes what the policy wants and
    is missing, and deletes superseded consumer catch-ups and leftovers; ``follow`` does it after every new step.

    Args:
        url: the stream (a URL or an open ``Store``).
        options: the policy (``CatchupOptions``).
        signing_key: a signed stream's key (a path made by ``deltasync keygen``, or a ``SigningKey``): catch-ups are
            signed with it, and only steps it signed (or its endorser before the hand-over) are read, so that it
            never vouches for a step it could not prove.
        stream_id: the stream the key signs for (else ``stream.json``'s, checked against the key's own steps).
        trusted_keys: with a signing key, the keys whose steps it reads (default: its own); without, the reader's
            trust (unsigned catch-ups are then written from trusted steps).
        storage_options: the store's.

    Raises:
        ConfigError: a bad option, a key for another stream, or ``DELTASYNC_DIGEST`` set to an algorithm writers do
            not know.
    """

    def __init__(self, url: Where, *, options: CatchupOptions | None = None, signing_key: Any = None,
                 stream_id: str | None = None, trusted_keys: Any = None,
                 storage_options: dict[str, Any] | None = None) -> None:
        self.options = options or CatchupOptions()
        digests.write_algorithm()  # DELTASYNC_DIGEST: a typo fails here, not after a catch-up was built
        self.store, self._owns_store = open_store(url, storage_options)
        self.signer: StreamSigner | None = None
        trust: TrustedKeys | None = None if trusted_keys is None else TrustedKeys.load(trusted_keys)
        if signing_key is not None:
            key = signing_key if isinstance(signing_key, SigningKey) else SigningKey(signing_key)
            self.signer, _ = writer_signer(self.store, key, stream_id=stream_id)
            trust = trust or own_trust(key, self.signer.stream_id)
        self.reader = StreamReader(self.store, trusted_keys=trust)
        self._stop = threading.Event()

    def close(self) -> None:
        self._stop.set()
        self.reader.close()
        if self._owns_store:
            self.store.close()

    def __enter__(self) -> CatchupWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def stop(self) -> None:
        """Make ``follow`` return after the pass it is in."""
        self._stop.set()

    # --- the policy ---

    def wanted(self, steps: Sequence[int], newest: int) -> dict[tuple[int, int], str]:
        """The pairs ``(base, step)`` the policy wants now, each with why (pure but for the heartbeats read)."""
        opts = self.options
        out: dict[tuple[int, int], str] = {}
        recent = [s for s in steps if s > newest - opts.horizon]
        for d in sorted(opts.distances):
            firsts: dict[int, int] = {}
            for s in recent:
                firsts.setdefault(s // d, s)
            bounds = sorted(firsts.values())
            for a, b in zip(bounds, bounds[1:], strict=False):
                if b - a <= 2 * d:
                    out.setdefault((a, b), f"aligned, distance {d}")
        if opts.consumers:
            now = time.time()
            committed = set(steps)
            held = sorted({c.step for c in read_heartbeats(self.store)
                           if 0 <= now - c.updated_unix_s <= opts.consumer_max_age_s and c.step in committed
                           and newest - c.step >= opts.min_lag})
            for h in held[: opts.max_consumers]:
                out.setdefault((h, newest), "a consumer holds the base")
        return out

    # --- one pass ---

    def run_once(self) -> CatchupReport:
        """Write the catch-ups the policy wants that are missing; delete superseded ones and leftovers."""
        t0 = time.perf_counter()
        report = CatchupReport()
        newest = self.reader.latest_step()
        if newest is None:
            return report
        steps = self.reader.steps()
        entries = {(e.base_step, e.step): e for e in self.store.catchup_entries()}
        wanted = self.wanted(steps, newest)
        for (a, b), why in sorted(wanted.items(), key=lambda kv: (kv[0][1], -kv[0][0])):
            e = entries.get((a, b))
            if e is not None and e.committed:
                continue
            try:
                written = self.write(a, b)
            except StepExistsError:
                continue  # another writer committed it meanwhile
            if written is None:
                report.skipped.append((a, b))
                continue
            report.written.append((a, b, written[0]))
            report.replaced_bytes.append(written[1])
            log.info("%s: wrote the catch-up %d->%d (%s): %d bytes for %d of the steps' own", self.store.url, a, b, why,
                     written[0], written[1])
        for (a, b), e in entries.items():
            stale = e.age_s is not None and e.age_s >= (self.options.grace_s if e.committed else LEFTOVER_S)
            superseded = e.committed and b < newest and b > newest - self.options.horizon and (a, b) not in wanted
            if stale and (superseded or not e.committed):
                self.store.delete_catchup(b, a)
                report.deleted.append((a, b))
        report.seconds = time.perf_counter() - t0
        return report

    def write(self, base: int, step: int) -> tuple[int, int] | None:
        """Build and commit the catch-up ``base`` -> ``step``; returns (its bytes, the bytes of the objects it was
        built from), or None where no way of deltas joins the two. ``StepExistsError`` where it is committed."""
        try:
            chain = self.reader.chain(step, start=base, anchors=False)
        except StepNotFoundError:
            return None
        if len(chain) < 2:
            return None  # one object already: nothing to merge
        objects: list[StepObject] = []
        try:
            held = base
            for s in chain:
                objects.append(self.reader.open(s, base=held))
                held = s
            if objects[0].header.base_step != base or any(o.header.kind != "delta" for o in objects):
                return None
            for o in objects[1:]:
                check_layout(objects[0], o)
            data, digest, header = self._merged(base, step, objects)
            source_bytes = sum(o.nbytes for o in objects)
        finally:
            for o in objects:
                o.close()
        self._commit(base, step, data, digest, header)
        return data.nbytes, source_bytes

    def _merged(self, base: int, step: int, objects: list[StepObject]) -> tuple[memoryview, str, StepHeader]:
        """The catch-up object's bytes, their digest (taken as they were written) and header: each tensor's
        patches merged and encoded, step ``step``'s checksums."""
        last = objects[-1].header
        tensors: dict[str, TensorHeader] = {}
        encoded = {}
        for name, t in last.tensors.items():
            patches = [o.patch(name) for o in objects if o.header.tensors[name].changed]
            merged = merge_patches(patches, checksum=int(t.checksum, 16)) if patches else None
            if merged is None or merged.changed == 0:
                tensors[name] = TensorHeader(dtype=t.dtype, shape=t.shape, changed=0, checksum=t.checksum)
                continue
            enc = encode_patch(merged, zstd_level=self.options.zstd_level)
            encoded[name] = enc
            tensors[name] = TensorHeader(dtype=t.dtype, shape=t.shape, changed=merged.changed, checksum=t.checksum,
                                         positions=enc.positions_chain, values=enc.values_chain)
        header = StepHeader(kind="delta", step=step, base_step=base, state_checksum=last.state_checksum,
                            tensors=tensors, aliases=dict(last.aliases))
        buf = io.BytesIO()
        written = write_delta(buf, header, encoded)
        return buf.getbuffer(), written.digest, header  # no second copy of the object, no second pass to hash it

    def _commit(self, base: int, step: int, data: memoryview, digest: str, header: StepHeader) -> None:
        numel, changed = header.numel, header.changed
        m = CatchupManifest.of(kind="catchup", step=step, base_step=base, digest=digest,
                               object=f"catchup-{digests.hex_of(digest)[:16]}.safetensors", object_bytes=data.nbytes,
                               state_checksum=self.reader.manifest(step).state_checksum,
                               base_state_checksum=self.reader.manifest(base).state_checksum,
                               created_unix_s=time.time(),
                               stats=ManifestStats(numel=numel, changed=changed,
                                                   density=changed / numel if numel else 0.0))
        self.store.commit_catchup(m, data, signer=self.signer)

    # --- keeping up ---

    def follow(self, *, poll_s: float = 5.0, passes: int | None = None) -> None:
        """Run a pass, then another after each new step (polled every ``poll_s``), until ``stop()`` (or ``passes``
        passes). A pass that fails is logged and tried again at the next step: catch-ups are optional."""
        seen: int | None = None
        done = 0
        while not self._stop.is_set() and (passes is None or done < passes):
            try:
                newest = self.reader.latest_step()
                if newest != seen:
                    self.run_once()
                    seen = newest
                    done += 1
            except DeltaSyncError as e:
                log.warning("%s: catch-up pass failed (%s: %s); trying again", self.store.url, type(e).__name__, e)
            self._stop.wait(poll_s)


def write_catchups(url: Where, *, options: CatchupOptions | None = None, signing_key: Any = None,
                   stream_id: str | None = None, trusted_keys: Any = None,
                   storage_options: dict[str, Any] | None = None) -> CatchupReport:
    """One pass of a :class:`CatchupWriter` over the stream at ``url`` (see it for the arguments).

    Example: ``write_catchups("s3://bucket/run-7", options=CatchupOptions(distances=(8, 32)))``.
    """
    with CatchupWriter(StoreLocation.of(url, storage_options), options=options, signing_key=signing_key,
                       stream_id=stream_id, trusted_keys=trusted_keys) as w:
        return w.run_once()

