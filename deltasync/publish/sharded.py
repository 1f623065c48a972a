"""Sharded trainers (FSDP2, any ``DTensor`` state dict): every rank publishes its own shard, no gather.

Each rank diffs and encodes the contiguous element range its shard covers against its own snapshot of
that shard, and uploads the result as one part of the step (docs/FORMAT.md section 5b). Only small
metadata crosses ranks, over a gloo group of the publisher's own (so that it never interleaves with the
trainer's collectives): whether each rank captured the step (and as what kind), each tensor's partial
checksum (``mix64-sum`` adds up over ranges), then each part's name, size and digest. Rank 0 holds the
stream's lease and writes the manifest last; any failure on any rank fails the step on all of them.

``refuse_nonfinite`` (publish/finite.py): each rank checks its own shards as it diffs them, and the ranks agree on
the step before anything is written: a step that any rank refuses is refused on every rank, each raising the same
``NonFiniteStepError`` naming every rank's tensors, and every rank puts its snapshot back at the last published
bits, so the next step is a delta from the last good one (no forced anchor).

The step runs on the trainer's thread, with the same collectives in the same order on every rank: ranks
cannot disagree about which steps they publish or what kind each one is.
"""

from __future__ import annotations

import io
import logging
import math
import pickle
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from deltasync.errors import (
    ConfigError,
    DeltaSyncError,
    PublishError,
    TensorMismatchError,
)
from deltasync.format import digest as digests
from deltasync.format._bits import dtype_name
from deltasync.format.checksum import MASK64, format_checksum, state_checksum
from deltasync.format.codecs import encode_patch
from deltasync.format.documents import (
    Kind,
    Manifest,
    ManifestStats,
    Part,
    StepHeader,
    TensorHeader,
    digest_version_fields,
)
from deltasync.format.objects import write_anchor, write_delta
from deltasync.format.patch import Patch
from deltasync.publish.finite import refusal, refused_tensors
from deltasync.publish.names import NameMap, source_state
from deltasync.stages.diff import Snapshot, SnapshotDevice
from deltasync.threads import parallel_map

if TYPE_CHECKING:
    from deltasync.publish.options import PublishOptions
    from deltasync.signing import StreamSigner
    from deltasync.store import Store

log = logging.getLogger(__name__)

__all__ = ["LocalShards", "ShardGroup", "is_sharded", "local_shards"]


def _dtensor_type() -> type | None:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # a torch without DTensor: nothing is sharded
        return None
    return DTensor


def is_sharded(state: Mapping[str, Any]) -> bool:
    """Whether a state dict holds ``DTensor``s (an FSDP2 / DTensor model): then every rank publishes."""
    dtensor = _dtensor_type()
    return dtensor is not None and any(isinstance(t, dtensor) for t in state.values())


@dataclass(kw_only=True)
class LocalShards:
    """What this rank publishes: its tensors' local shards (flat, contiguous) with their global ranges, the
    full dtype and shape of every tensor of the model, and aliases (tied names, published once)."""

    tensors: dict[str, torch.Tensor]
    ranges: dict[str, tuple[int, int]]
    shapes: dict[str, tuple[int, ...]]
    dtypes: dict[str, torch.dtype]
    aliases: dict[str, str] = field(default_factory=dict)


def local_shards(source: Any, rank: int, names: NameMap | None = None) -> LocalShards:
    """This rank's share of a module's or state dict's tensors, by canonical name.

    ``Shard(0)`` shards (on any mesh dimension) are contiguous element ranges of the row-major tensor; a
    shard replicated over some mesh dimensions is written by the ranks at coordinate 0 on those; plain
    tensors (and fully replicated DTensors) by rank 0. Any other placement is a ``ConfigError``.
    """
    sd = source_state(source, names)
    dtensor = _dtensor_type()
    out = LocalShards(tensors={}, ranges={}, shapes={}, dtypes={})
    seen: dict[int, str] = {}  # id of the tensor object (a tied DTensor is one object under two names)
    for name, t in sd.items():
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"state entry {name!r} is a {type(t).__name__}, not a tensor")
        if id(t) in seen and t.numel():
            out.aliases[name] = seen[id(t)]
            continue
        seen[id(t)] = name
        out.shapes[name], out.dtypes[name] = tuple(t.shape), t.dtype
        if dtensor is not None and isinstance(t, dtensor):
            local, (start, stop), owner = _shard_range(name, t)
        else:
            local, (start, stop), owner = t.detach(), (0, t.numel()), rank == 0
        if owner and (stop > start or math.prod(t.shape) == 0):
            local = local.detach()
            out.tensors[name] = (local if local.is_contiguous() else local.contiguous()).reshape(-1)
            out.ranges[name] = (start, stop)
    return out


def _shard_range(name: str, t: Any) -> tuple[torch.Tensor, tuple[int, int], bool]:
    """A DTensor's local shard, its global element range, and whether this rank writes it."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    mesh, placements = t.device_mesh, t.placements
    owner = True
    for dim, p in enumerate(placements):
        if isinstance(p, Replicate):
            owner = owner and mesh.get_local_rank(dim) == 0  # one writer per replica group
        elif not (isinstance(p, Shard) and p.dim == 0):
            raise ConfigError(
                f"tensor {name!r} is placed {placements} on its mesh; deltasync publishes Shard(0) and Replicate() "
                f"placements per rank (gather other layouts first)"
            )
    local = t.to_local()
    shape, offset = compute_local_shape_and_global_offset(t.shape, mesh, placements)
    if tuple(local.shape) != tuple(shape):
        raise ConfigError(f"tensor {name!r}: local shard has shape {tuple(local.shape)}, its placements give "
                          f"{tuple(shape)}")
    row = math.prod(t.shape[1:]) if t.dim() else 1
    start = (offset[0] if t.dim() else 0) * row
    return local, (start, start + local.numel()), owner


class ShardGroup:
    """The publisher's own gloo group over the trainer's ranks, for small metadata only.

    ``sent_bytes`` counts the pickled bytes this rank contributed to collectives (what crosses ranks).
    """

    def __init__(self, *, timeout_s: float = 600.0) -> None:
        if not dist.is_available() or not dist.is_initialized():
            raise ConfigError("a sharded (DTensor) model publishes from every rank: initialise torch.distributed first")
        self.group = dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s))
        self.rank = dist.get_rank(self.group)
        self.world_size = dist.get_world_size(self.group)
        self._root = dist.get_global_rank(self.group, 0)
        self.sent_bytes = 0

    def all_gather(self, obj: Any) -> list[Any]:
        self.sent_bytes += len(pickle.dumps(obj))
        out: list[Any] = [None] * self.world_size
        dist.all_gather_object(out, obj, group=self.group)
        return out

    def broadcast(self, obj: Any) -> Any:
        """Rank 0's ``obj`` on every rank."""
        if self.rank == 0:
            self.sent_bytes += len(pickle.dumps(obj))
        box = [obj]
        dist.broadcast_object_list(box, src=self._root, group=self.group)
        return box[0]

    def destroy(self) -> None:
        try:
            dist.destroy_process_group(self.group)
        except (AssertionError, RuntimeError, ValueError):  # already gone with the default group
            pass


@dataclass(kw_only=True)
class ShardedCapture:
    """One rank's captured step, before the ranks agreed on it."""

    step: int
    kind: Kind
    base_step: int | None
    shards: LocalShards
    changes: list[Patch]
    checksums: dict[str, int]  # this rank's partial checksums, global indices
    capture_s: float
    built: bool = False  # the snapshot was made by this capture
    before: tuple[dict[str, int], set[str]] | None = None  # the snapshot's checksums and nonfinite before the diff
    refused: list[str] = field(default_factory=list)  # tensors that refuse the step (refuse_nonfinite)


def capture(snapshot: Snapshot | None, shards: LocalShards, *, step: int, kind: Kind, base_step: int | None,
            device: SnapshotDevice, max_chunk_bytes: int, dtype: torch.dtype | None,
            refuse_nonfinite: bool = False) -> tuple[Snapshot, ShardedCapture]:
    """Diff this rank's shards against its snapshot (made on the first call); returns both. With
    ``refuse_nonfinite`` the capture names the tensors that refuse the step (``refused``) and can be taken back
    (:func:`take_back`)."""
    t0 = time.perf_counter()
    offsets = {n: r[0] for n, r in shards.ranges.items()}
    before = None
    if snapshot is None:
        snapshot = Snapshot(shards.tensors, device=device, max_chunk_bytes=max_chunk_bytes, dtype=dtype,
                            offsets=offsets, track_finite=refuse_nonfinite)
        changes: list[Patch] = []
    else:
        if snapshot.offsets != offsets:
            raise TensorMismatchError("the model's sharding changed since the last publish (shard ranges differ)")
        before = dict(snapshot.checksums), set(snapshot.nonfinite)
        changes = [c for c in snapshot.diff(shards.tensors) if c.changed]
    refused = refused_tensors(snapshot, None if before is None else before[1]) if refuse_nonfinite else []
    return snapshot, ShardedCapture(step=step, kind=kind, base_step=base_step, shards=shards, changes=changes,
                                    checksums=dict(snapshot.checksums), capture_s=time.perf_counter() - t0,
                                    built=before is None, before=before, refused=refused)


def take_back(snapshot: Snapshot, cap: ShardedCapture) -> Snapshot | None:
    """The snapshot as it was before ``cap``'s diff (its patches XORed in again), or None when ``cap`` made it."""
    if cap.before is None:
        return None
    snapshot.undo(cap.changes, *cap.before)
    return snapshot


def write_part(dest: Any, cap: ShardedCapture, snapshot: Snapshot, *, state: str,
               zstd_level: int) -> tuple[StepHeader, Any]:
    """Encode this rank's part (docs/FORMAT.md section 5b) into ``dest``; returns its header and what was written."""
    dtypes = {n: dtype_name(snapshot.tensors[n].dtype) for n in cap.shards.ranges}
    headers = {
        n: TensorHeader(dtype=dtypes[n], shape=cap.shards.shapes[n], changed=0,
                        checksum=format_checksum(cap.checksums[n]), range=r)
        for n, r in cap.shards.ranges.items()
    }
    encoded = {}
    if cap.kind == "delta":
        for c, enc in zip(cap.changes, parallel_map(lambda c: encode_patch(c, zstd_level=zstd_level), cap.changes,
                                                             cost=lambda c: c.changed), strict=True):
            encoded[c.name] = enc
            h = headers[c.name]
            headers[c.name] = TensorHeader(dtype=h.dtype, shape=h.shape, changed=c.changed, checksum=h.checksum,
                                           range=h.range,
                                           positions=enc.positions_chain, values=enc.values_chain)
    header = StepHeader(kind=cap.kind, step=cap.step, base_step=cap.base_step, state_checksum=state, tensors=headers,
                        format_version=2)
    if cap.kind == "anchor":
        return header, write_anchor(dest, header, snapshot.tensors)
    return header, write_delta(dest, header, encoded)


def combined_checksums(partials: list[dict[str, int]], names: Mapping[str, Any]) -> dict[str, str]:
    """Each tensor's checksum from the ranks' partial sums (every tensor must be held by some rank)."""
    total: dict[str, int] = {}
    for p in partials:
        for n, c in p.items():
            total[n] = (total.get(n, 0) + c) & MASK64
    missing = set(names) - set(total)
    if missing:
        raise TensorMismatchError(f"no rank holds tensors {sorted(missing)[:5]}")
    return {n: format_checksum(c) for n, c in total.items()}


def step_manifest(*, cap: ShardedCapture, parts: list[Part], state: str, numel: int, changed: int,
                  encode_s: float) -> Manifest:
    """The multi-part manifest that commits the ranks' parts (rank order): version 2 where they are digested with
    SHA-256, else version 3 naming their algorithm (docs/FORMAT.md section 1b). Ranks that digest with different
    algorithms (``DELTASYNC_DIGEST`` set on some) make a manifest the parser refuses: the step fails."""
    algorithm = digests.algorithm_of(parts[0].digest) if parts else digests.write_algorithm()
    return Manifest(
        step=cap.step, base_step=cap.base_step, kind=cap.kind, object_bytes=sum(p.object_bytes for p in parts),
        state_checksum=state, created_unix_s=time.time(), parts=tuple(parts), aliases=dict(cap.shards.aliases),
        **digest_version_fields(algorithm, sha256_version=2),
        stats=ManifestStats(
            numel=numel, changed=changed if cap.kind == "delta" else numel,
            density=changed / numel if cap.kind == "delta" and numel else 1.0,
            capture_s=round(cap.capture_s, 6), encode_s=round(encode_s, 6),
        ),
    )


def part_name(kind: Kind, rank: int, hex16: str) -> str:
    """A part's name: its kind, writing rank and the first 16 hex digits of its digest (docs/FORMAT.md 5b)."""
    return f"{kind}-r{rank:05d}-{hex16[:16]}.safetensors"


class ShardedWriter:
    """The sharded publish of one ``DeltaPublisher``: its rank's snapshot, and the step protocol.

    Per step: capture (diff this rank's shards) -> agree (errors, kinds, partial checksums) -> write and
    upload this rank's part -> rank 0 gathers the parts and commits the manifest under its lease ->
    rank 0 tells every rank the outcome. An error anywhere raises ``PublishError`` on every rank.
    """

    def __init__(self, source: Any, options: PublishOptions, store: Store, *, writer_id: str,
                 signing_key: StreamSigner | None, spool: Callable[[], Path], group: ShardGroup) -> None:
        self.source, self.options, self.store = source, options, store
        self.writer_id, self.signing_key = writer_id, signing_key
        self.spool = spool  # the publisher's spool folder, made on first use (anchors are written there)
        self.group = group
        self.snapshot: Snapshot | None = None
        self.metrics: list[dict[str, Any]] = []

    @property
    def rank(self) -> int:
        return self.group.rank

    def publish(self, step: int, *, kind: Kind, base_step: int | None, precheck: BaseException | None = None,
                last_step: int | None = None) -> int:
        """Publish ``step`` from every rank; returns the bytes of the whole step. ``precheck``: an error this
        rank found before capturing (it fails the step on all ranks). ``last_step``: the step published before
        (named by a refusal).

        Raises:
            PublishError: the step failed on some rank (every rank raises it).
            NonFiniteStepError: some rank's shards turned NaN or ±Inf (``refuse_nonfinite``): every rank raises it,
                naming every rank's tensors, with its snapshot as it was before the step.
        """
        opts = self.options
        cap: ShardedCapture | None = None
        error = precheck
        if error is None:
            try:
                shards = local_shards(self.source, self.rank, opts.names)
                self.snapshot, cap = capture(self.snapshot, shards, step=step, kind=kind, base_step=base_step,
                                             device=opts.snapshot_device, max_chunk_bytes=opts.max_chunk_bytes,
                                             dtype=opts.dtype, refuse_nonfinite=opts.refuse_nonfinite)
            except Exception as e:  # noqa: BLE001 - any rank's failure must reach every rank (collectives), not hang them
                error = e
        sent = None if cap is None else (cap.kind, cap.base_step, cap.checksums, len(cap.shards.shapes))
        gathered = self.group.all_gather((None if error is None else describe(error), sent,
                                          None if cap is None else (cap.refused, cap.built)))
        bad = [(r, e) for r, (e, _, _) in enumerate(gathered) if e is not None]
        if not bad and len({(g[1][0], g[1][1], g[1][3]) for g in gathered}) != 1:
            bad = [(r, f"captured {g[1][0]} on {g[1][1]} with {g[1][3]} tensors") for r, g in enumerate(gathered)]
        if bad:
            self.snapshot = None if error is not None else self.snapshot
            raise PublishError(f"{self.store.url}: step {step} failed on ranks {[r for r, _ in bad]}: "
                               + "; ".join(f"rank {r}: {e}" for r, e in bad[:4])) from error
        assert cap is not None and self.snapshot is not None
        refused = [n for g in gathered for n in g[2][0]]
        if refused:  # refused on every rank alike: each puts its snapshot back (no rank writes anything)
            self.snapshot = take_back(self.snapshot, cap)
            first = any(g[2][1] for g in gathered)  # some rank had no step before to compare with
            raise refusal(self.store.url, step, refused, last_step=None if first else last_step)
        checksums = combined_checksums([g[1][2] for g in gathered], cap.shards.shapes)
        state = state_checksum(checksums)
        part, error, encode_s = self._write(cap, state)
        changed = sum(c.changed for c in cap.changes)
        parts = self.group.all_gather((None if error is None else describe(error), part, encode_s, changed))
        failed = [(r, e) for r, (e, _, _, _) in enumerate(parts) if e is not None]
        outcome = None
        if self.rank == 0:
            outcome = self._commit(cap, [p[1] for p in parts if p[1] is not None], state, failed,
                                   encode_s=max(p[2] for p in parts), changed=sum(p[3] for p in parts))
        outcome = self.group.broadcast(outcome)
        if outcome is not None:
            if failed and part is not None:  # no manifest will name it: leave nothing behind
                try:
                    self.store.delete(f"steps/{step:012d}/{part.object}")
                except DeltaSyncError as e:
                    log.warning("could not remove the part of failed step %d: %s", step, e)
            raise PublishError(f"{self.store.url}: step {step} was not committed: {outcome}") from error
        total = sum(p[1].object_bytes for p in parts if p[1] is not None)
        self.metrics.append({"step": step, "kind": cap.kind, "part_bytes": 0 if part is None else part.object_bytes,
                             "step_bytes": total, "capture_s": cap.capture_s, "encode_s": encode_s})
        return total

    def _write(self, cap: ShardedCapture, state: str) -> tuple[Part | None, BaseException | None, float]:
        """Encode and upload this rank's part (None when it holds nothing)."""
        if not cap.shards.ranges:
            return None, None, 0.0
        t0 = time.perf_counter()
        local = None
        try:
            assert self.snapshot is not None
            if cap.kind == "delta":  # small: handed to the store as bytes
                buf = io.BytesIO()
                _, written = write_part(buf, cap, self.snapshot, state=state, zstd_level=self.options.zstd_level)
                data: Any = buf.getbuffer()
            else:  # anchors spool to a file
                local = self.spool() / f"{cap.step:012d}-r{self.rank:05d}.safetensors"
                _, written = write_part(local, cap, self.snapshot, state=state, zstd_level=self.options.zstd_level)
                data = local
            part = Part.of(object=part_name(cap.kind, self.rank, written.hex16), object_bytes=written.nbytes,
                           digest=written.digest, tensors=dict(cap.shards.ranges))
            encode_s = time.perf_counter() - t0
            self.store.put_part(cap.step, part, data)
            return part, None, encode_s
        except Exception as e:
            log.exception("rank %d: writing its part of step %d failed", self.rank, cap.step)
            return None, e, time.perf_counter() - t0
        finally:
            if local is not None:
                local.unlink(missing_ok=True)

    def _commit(self, cap: ShardedCapture, parts: list[Part], state: str, failed: list[tuple[int, str]], *,
                encode_s: float, changed: int) -> str | None:
        """Rank 0: write the manifest (the commit) unless a rank failed; the reason it did not, or None."""
        if failed:
            return "; ".join(f"rank {r}: {e}" for r, e in failed[:4])
        try:
            numel = sum(math.prod(s) for s in cap.shards.shapes.values())
            manifest = step_manifest(cap=cap, parts=parts, state=state, numel=numel, changed=changed, encode_s=encode_s)
            self.store.commit(manifest, None, owner=self.writer_id, signer=self.signing_key)  # rank 0 signs
        except Exception as e:
            log.exception("committing step %d failed", cap.step)
            return describe(e)
        return None


def describe(e: BaseException) -> str:
    """An error as one line for the other ranks."""
    return str(e) if isinstance(e, DeltaSyncError) else f"{type(e).__name__}: {e}"
