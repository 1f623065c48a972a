"""Diff stage: compare the live weights' bits with the last-published copy (the snapshot).

The snapshot is what consumers hold, so diffing against it (not against the previous optimizer step)
means skipped or coalesced steps lose nothing. The diff also advances the snapshot and the per-tensor
checksums, in time proportional to the change, and (when asked) which tensors hold NaN or ±Inf.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Mapping, Sequence, Set
from typing import Literal

import numpy as np
import torch

from deltasync.errors import TensorMismatchError
from deltasync.format import _kernels
from deltasync.format._bits import UNSIGNED_NP, dtype_name, int_view, np_bits, np_words
from deltasync.format.checksum import MASK64, tensor_checksum
from deltasync.format.patch import Patch
from deltasync.stages._device import diff_device
from deltasync.stages.apply import xor_apply
from deltasync.threads import parallel_map

SnapshotDevice = Literal["same", "cpu"]


TensorChange = Patch  # the name before issue 9: a diff's change is a Patch (always sparse)


def published_dtype(t: torch.Tensor, dtype: torch.dtype | None) -> torch.dtype:
    """The dtype ``t`` is published in under the publish option ``dtype``: floating tensors of 16 bits or more are
    cast to it (fp32 master weights published as the bf16 an engine serves); 8-bit floats are an engine's quantized
    representation (an FP8 stream, docs/FORMAT.md section 7) and are published as they are, like integers."""
    if dtype is None or not t.is_floating_point() or t.element_size() < 2:
        return t.dtype
    return dtype


class Snapshot:
    """The last-published copy of a model's tensors, and the diff that advances it.

    Memory: one copy of every tensor, on the trainer's device (``"same"``) or in host memory (``"cpu"``).
    With ``"cpu"`` a device tensor is diffed through host chunks of at most ``max_chunk_bytes``; with a snapshot
    on an accelerator the whole step is diffed there and its changes come back in one transfer (docs/GPU.md). With
    ``dtype``, floating tensors are published in that dtype (one tensor is cast at a time).

    ``offsets`` (name -> global flat index of the first element) make each tensor a contiguous slice of a
    larger one (a rank's shard, docs/FORMAT.md section 5b): checksums hash global indices, while the
    patches a diff returns stay in the slice's own coordinates.

    With ``track_finite``, ``nonfinite`` names the floating tensors whose published bits hold NaN or ±Inf (what
    the publisher's ``refuse_nonfinite`` compares, publish/finite.py): found when a tensor is added, then kept by
    every diff from what it changed alone. An unchanged tensor is not read again; a changed one that was all finite
    is read at its changed elements on the host (an accelerator's snapshot reads the whole changed tensor there,
    which costs less than sending the positions back); a changed one that held non-finite values is read whole.
    """

    def __init__(
        self,
        tensors: Mapping[str, torch.Tensor],
        *,
        device: SnapshotDevice = "same",
        max_chunk_bytes: int = 64 << 20,
        dtype: torch.dtype | None = None,
        offsets: Mapping[str, int] | None = None,
        track_finite: bool = False,
    ) -> None:
        self.device = device
        self.track_finite = track_finite
        self.nonfinite: set[str] = set()  # kept with track_finite only
        self.dtype = dtype
        self.max_chunk_bytes = max_chunk_bytes
        self.offsets: dict[str, int] = dict(offsets or {})
        self.tensors: dict[str, torch.Tensor] = {}
        self._scratch = _Scratch()
        self._caps: dict[tuple[str, int], int] = {}  # room reserved per device segment (learned, _device.py)
        self._bits: dict[str, tuple[torch.Tensor, _HostBits]] = {}
        self.checksums: dict[str, int] = {}
        for name, t in tensors.items():
            self.add(name, t)

    def add(self, name: str, t: torch.Tensor) -> None:
        """Copy one more tensor in (cast to the published dtype) with its checksum: how a snapshot is built one
        tensor at a time from a stream. Keeps no reference to ``t``."""
        if name in self.tensors:
            raise TensorMismatchError(f"tensor {name!r} is in the snapshot already")
        t = t.detach()
        cast = self._cast(t)
        # a cast made a fresh tensor already: keep it rather than copying it again (one tensor at a time either way)
        copy = cast.to("cpu" if self.device == "cpu" else cast.device, memory_format=torch.contiguous_format,
                       copy=cast is t)
        self.tensors[name] = copy
        self.checksums[name] = tensor_checksum(copy, self.offsets.get(name, 0))
        if self.track_finite and copy.is_floating_point() and bool(_any_nonfinite(copy, self._chunk_elems(copy))):
            self.nonfinite.add(name)

    def _cast(self, t: torch.Tensor) -> torch.Tensor:
        """Floating tensors in the published dtype (e.g. fp32 master weights published as bf16)."""
        return t.to(self.dtype) if self._needs_cast(t) else t

    def _host_bits(self, name: str, snap: torch.Tensor) -> _HostBits:
        """The bit views of a host snapshot tensor, made once (the diff advances the snapshot in place)."""
        kept = self._bits.get(name)
        if kept is None or kept[0] is not snap:
            kept = self._bits[name] = (snap, _HostBits(np_bits(snap)))
        return kept[1]

    def _needs_cast(self, t: torch.Tensor) -> bool:
        return published_dtype(t, self.dtype) != t.dtype

    def _chunk_elems(self, t: torch.Tensor) -> int:
        return max(1, self.max_chunk_bytes // t.element_size())

    def nan_tensors(self, names: Iterable[str] | None = None) -> list[str]:
        """Which of ``names`` (default: ``nonfinite``, the only ones that can) hold NaN, in the snapshot's order;
        reads those tensors."""
        wanted = self.nonfinite if names is None else set(names)
        return [n for n, t in self.tensors.items()
                if n in wanted and t.is_floating_point() and bool(_any_nan(t, self._chunk_elems(t)))]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors.values())

    def check_same_layout(self, tensors: Mapping[str, torch.Tensor]) -> None:
        """Raise ``TensorMismatchError`` unless ``tensors`` has exactly the snapshot's names, shapes and dtypes."""
        missing = self.tensors.keys() - tensors.keys()
        extra = tensors.keys() - self.tensors.keys()
        if missing or extra:
            raise TensorMismatchError(
                f"the model's tensors changed since the last publish: missing {sorted(missing)[:5]}, "
                f"new {sorted(extra)[:5]} ({len(missing)} missing, {len(extra)} new)"
            )
        for name, t in tensors.items():
            self.check_tensor(name, t)

    def check_tensor(self, name: str, t: torch.Tensor) -> None:
        """Raise ``TensorMismatchError`` unless the snapshot holds ``name`` with ``t``'s shape and published dtype."""
        s = self.tensors.get(name)
        if s is None:
            raise TensorMismatchError(f"tensor {name!r} is not in the snapshot (it holds {len(self.tensors)} tensors)")
        published = self.dtype if self._needs_cast(t) else t.dtype
        if t.shape != s.shape or published != s.dtype:
            raise TensorMismatchError(
                f"tensor {name!r}: expected shape {tuple(s.shape)} {s.dtype}, got {tuple(t.shape)} {t.dtype}"
            )

    def holds(self, name: str, t: torch.Tensor) -> bool:
        """Whether ``t``, cast to the published dtype, has exactly the bits of the snapshot's tensor ``name`` (a
        transient copy of one tensor at most)."""
        s = self.tensors.get(name)
        if s is None or t.shape != s.shape or (self.dtype if self._needs_cast(t) else t.dtype) != s.dtype:
            return False
        cur = self._cast(t.detach()).to(s.device).contiguous()
        return bool(torch.equal(int_view(cur), int_view(s)))

    def diff_tensor(self, name: str, t: torch.Tensor) -> Patch:
        """The change of one tensor (``diff`` of ``{name: t}`` without the check of the other names): how a
        stream is diffed as each tensor arrives. Advances the snapshot's ``name``; keeps no reference to ``t``."""
        self.check_tensor(name, t)
        return self._diff({name: t})[0]

    def undo(self, changes: Sequence[Patch], checksums: Mapping[str, int], nonfinite: Set[str] | None = None) -> None:
        """Take back diffs: ``changes`` (returned by ``diff``/``diff_tensor`` since the snapshot's checksums were
        ``checksums`` and its ``nonfinite`` was ``nonfinite``) are XORed in again and those restored, so the
        snapshot holds the exact bits it held before. What a failed or refused step costs: the patches the step
        kept anyway, no copy of the snapshot."""
        for c in reversed(changes):
            if c.changed:
                xor_apply(self.tensors[c.name], c.positions, c.xor, checksum=False)
            self.checksums[c.name] = checksums[c.name]
        if nonfinite is not None:
            self.nonfinite = set(nonfinite)

    def diff(self, tensors: Mapping[str, torch.Tensor]) -> list[Patch]:
        """Changes from the snapshot to ``tensors`` (same names, shapes, dtypes), one sparse ``Patch`` per
        tensor (unchanged ones included, empty); advances the snapshot.

        Host tensors are diffed as ranges of at most ``_RANGE_ELEMS`` elements on the codec thread pool,
        largest first, each by the single-threaded kernel: parallel across tensors, never inside a small one.
        """
        self.check_same_layout(tensors)
        return self._diff(tensors)

    def _diff(self, tensors: Mapping[str, torch.Tensor]) -> list[Patch]:
        found: dict[str, tuple[np.ndarray, np.ndarray, int]] = {}
        host: list[_Range] = []
        device: list[tuple[str, torch.Tensor, torch.Tensor, int]] = []
        for name, t in tensors.items():
            snap = self.tensors[name]
            if snap.device.type == "cpu" and t.device.type == "cpu" and t.is_contiguous():
                # views made once per tensor: a range is then a slice (the Python per range is most of a no-change
                # diff)
                cur = _HostBits(np_bits(t.detach())) if not self._needs_cast(t) else None
                views = (cur, self._host_bits(name, snap), self.offsets.get(name, 0))
                host += [(name, views, s, min(s + _RANGE_ELEMS, snap.numel()))
                         for s in range(0, max(snap.numel(), 1), _RANGE_ELEMS)]
            elif snap.device.type != "cpu":  # the snapshot on the accelerator: every such tensor in one batch
                device.append((name, t.to(snap.device), int_view(snap), self.offsets.get(name, 0)))
            else:  # a device tensor against a host snapshot: through host chunks, one tensor at a time
                found[name] = _diff_tensor(self._cast(t.detach()), snap, self.max_chunk_bytes, self._scratch,
                                           self.offsets.get(name, 0))
        if device:
            step = max(1, self.max_chunk_bytes // 2)
            found.update(zip((d[0] for d in device),
                             diff_device(device, step_elems=step, cast=self._cast, caps=self._caps), strict=True))

        def diff_range(r: _Range) -> tuple[np.ndarray, np.ndarray, int]:
            name, (cur, snap, base), start, stop = r
            if cur is None:  # cast a range at a time (bounded memory)
                a = np_bits(self._cast(tensors[name].detach().reshape(-1)[start:stop]))
                return _diff_np(a, snap.bits[start:stop], base + start, self._scratch, parallel=False)
            return _diff_range(cur, snap, start, stop, base, self._scratch)

        items = _pack(host)
        done = parallel_map(lambda rs: [diff_range(r) for r in rs], items,
                            cost=lambda rs: sum(r[3] - r[2] for r in rs))
        ranges: dict[str, list[tuple[int, tuple[np.ndarray, np.ndarray, int]]]] = {}
        for r, part in zip([r for rs in items for r in rs], [p for ps in done for p in ps], strict=True):
            ranges.setdefault(r[0], []).append((r[2], part))
        for name, parts in ranges.items():
            found[name] = _concat([p for _, p in sorted(parts, key=lambda sp: sp[0])],
                                  self.tensors[name].element_size())
        changes = []
        for name in tensors:
            snap = self.tensors[name]
            base = self.offsets.get(name, 0)
            positions, xor, delta = found[name]
            if base:
                positions -= base  # the kernels report global positions (they hash global indices)
            self.checksums[name] = (self.checksums[name] + delta) & MASK64
            changes.append(
                Patch(name=name, dtype=dtype_name(snap.dtype), shape=tuple(snap.shape), positions=positions, xor=xor,
                      checksum=self.checksums[name])
            )
        if self.track_finite:
            self._track_finite(changes)
        return changes

    def _track_finite(self, changes: Sequence[Patch]) -> None:
        """Keep ``nonfinite`` right after a diff wrote ``changes`` into the snapshot, reading only changed tensors:
        unchanged elements of a tensor that was all finite are finite still."""
        on_device: list[tuple[str, torch.Tensor]] = []
        for c in changes:
            snap = self.tensors[c.name]
            if not c.changed or not snap.is_floating_point():
                continue
            chunk = self._chunk_elems(snap)
            if snap.device.type != "cpu":  # flags of every changed tensor come back in one transfer (below)
                on_device.append((c.name, _any_nonfinite(snap, chunk)))
            elif c.name in self.nonfinite or 4 * c.changed >= snap.numel():
                self._flag(c.name, bool(_any_nonfinite(snap, chunk)))
            else:  # the changed elements only (positions are in the tensor's own coordinates)
                changed = snap.reshape(-1)[torch.from_numpy(c.positions)]
                self._flag(c.name, bool(_any_nonfinite(changed, chunk)))
        if on_device:
            flags = torch.stack([f for _, f in on_device]).cpu().tolist()
            for (name, _), flag in zip(on_device, flags, strict=True):
                self._flag(name, flag)

    def _flag(self, name: str, nonfinite: bool) -> None:
        if nonfinite:
            self.nonfinite.add(name)
        else:
            self.nonfinite.discard(name)


def _any_nonfinite(t: torch.Tensor, chunk_elems: int) -> torch.Tensor:
    """Whether floating ``t`` holds NaN or ±Inf, as a boolean tensor on its device (no host sync); read in
    chunks of ``chunk_elems`` elements (bounded temporary memory)."""
    return _any_of(t, chunk_elems, torch.isfinite, negate=True)


def _any_nan(t: torch.Tensor, chunk_elems: int) -> torch.Tensor:
    """Whether floating ``t`` holds NaN (see ``_any_nonfinite``)."""
    return _any_of(t, chunk_elems, torch.isnan, negate=False)


def _any_of(t: torch.Tensor, chunk_elems: int, test: Callable[[torch.Tensor], torch.Tensor], *,
            negate: bool) -> torch.Tensor:
    flat = t.reshape(-1)
    found = []
    for s in range(0, flat.numel(), chunk_elems):
        part = flat[s : s + chunk_elems]
        try:
            mask = test(part)
        except RuntimeError:  # not implemented for some 8-bit floats: bfloat16 holds each of their values exactly
            mask = test(part.to(torch.bfloat16))
        found.append(~mask.all() if negate else mask.any())
    return torch.stack(found).any() if found else torch.zeros((), dtype=torch.bool, device=t.device)


def _diff_tensor(
    cur: torch.Tensor, snap: torch.Tensor, max_chunk_bytes: int, scratch: _Scratch, base: int = 0
) -> tuple[np.ndarray, np.ndarray, int]:
    """Positions (global: from ``base``), xor bits and checksum delta of ``cur`` vs ``snap``; sets ``snap`` to
    ``cur``."""
    if not cur.is_contiguous():
        cur = cur.contiguous()
    step = max(1, max_chunk_bytes // snap.element_size())
    if snap.device.type != "cpu":
        return _diff_torch(int_view(cur), int_view(snap), step, snap.element_size(), base)
    if cur.device.type == "cpu":
        return _diff_np(np_bits(cur), np_bits(snap), base, scratch)
    return _diff_host_chunks(int_view(cur), np_bits(snap), step, scratch, base)


def _diff_host_chunks(
    cur: torch.Tensor, snap: np.ndarray, step: int, scratch: _Scratch, base: int = 0
) -> tuple[np.ndarray, np.ndarray, int]:
    """``cur`` (flat bits, any device) vs a host snapshot, through host copies of ``step`` elements at a time.

    Bounds the host memory a device tensor costs; each chunk is diffed with its global offset.
    """
    parts = [
        _diff_np(np_bits(cur[s : s + step].to("cpu")), snap[s : s + step], base + s, scratch)
        for s in range(0, cur.numel(), step)
    ]
    return _concat(parts, snap.itemsize)


_BLOCK_ELEMS = 1 << 15  # elements per parallel work item
_RANGE_ELEMS = 1 << 22  # elements per work item of a host diff (a multiple of the block: keeps words aligned)
_SMALL_ELEMS = 1 << 18  # smaller ranges share a work item (a pool task costs more than scanning them)
_SUPER_BLOCKS = 64  # work items per kernel call: bounds the scratch memory to ~20 MB


def _pack(ranges: list[_Range]) -> list[list[_Range]]:
    """Work items for the pool: a range of at least ``_SMALL_ELEMS`` elements alone, smaller ones together."""
    items: list[list[_Range]] = []
    small: list[_Range] = []
    size = 0
    for r in ranges:
        n = r[3] - r[2]
        if n >= _SMALL_ELEMS:
            items.append([r])
            continue
        small.append(r)
        size += n
        if size >= _SMALL_ELEMS:
            items.append(small)
            small, size = [], 0
    if small:
        items.append(small)
    return items


class _Scratch:
    """Reusable per-block output regions of the diff kernel (bounded temporary memory), one set per thread
    (the diff runs ranges on several threads at once)."""

    def __init__(self) -> None:
        self._local = threading.local()

    def get(self, width: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """Positions, xor bits (``width`` bytes), per-block counts and per-block checksum changes."""
        arrays = self._local.__dict__.setdefault("arrays", {})
        if width not in arrays:
            n = _SUPER_BLOCKS * _BLOCK_ELEMS
            arrays[width] = (np.empty(n, np.int64), np.empty(n, UNSIGNED_NP[width]),
                             np.zeros(_SUPER_BLOCKS, np.int64), np.zeros(_SUPER_BLOCKS, np.uint64))
        return arrays[width]


class _HostBits:
    """A host tensor's bits (flat) and, where they are 8-byte aligned, their 8-byte word view (see ``np_words``)."""

    __slots__ = ("bits", "words", "group")

    def __init__(self, bits: np.ndarray) -> None:
        self.bits = bits
        self.words, self.group = np_words(bits)


# name, (new, snapshot, global base), start, stop
_Range = tuple[str, tuple["_HostBits | None", _HostBits, int], int, int]


def _diff_range(
    cur: _HostBits, snap: _HostBits, start: int, stop: int, base: int, scratch: _Scratch
) -> tuple[np.ndarray, np.ndarray, int]:
    """``_diff_np`` of elements ``start .. stop`` of one host tensor (``start`` a multiple of its word size), from
    views made once per tensor."""
    a, b, group = cur.bits, snap.bits, cur.group
    parts = []
    covered = start
    if cur.words is not None and snap.words is not None:
        w0, w1 = start // group, min(stop // group, cur.words.size)
        if w1 > w0:
            covered = w1 * group
            parts += _scan(cur.words[w0:w1], snap.words[w0:w1], a[start:covered], group, base + start, scratch, False)
    if covered < stop:
        ta, tb = a[covered:stop], b[covered:stop]
        parts += _scan(ta, tb, ta, 1, base + covered, scratch, False)
    return _concat(parts, a.itemsize)


def _diff_np(
    a: np.ndarray, b: np.ndarray, base: int, scratch: _Scratch, *, parallel: bool | None = None
) -> tuple[np.ndarray, np.ndarray, int]:
    """Diff host bits ``a`` (new) against ``b`` (snapshot, updated), a slice starting at global flat index ``base``.

    The body that fills whole 8-byte words is scanned a word at a time, the rest element by element; both
    report global positions and hash global indices (docs/FORMAT.md section 4). ``parallel``: see
    ``_kernels.checksum_range`` (None: by size).
    """
    words_a, group = np_words(a)
    words_b, _ = np_words(b)
    parts = []
    covered = 0
    if words_a is not None and words_b is not None:
        covered = words_a.size * group
        parts += _scan(words_a, words_b, a[:covered], group, base, scratch, parallel)
    if covered < a.size:
        ta, tb = a[covered:], b[covered:]
        parts += _scan(ta, tb, ta, 1, base + covered, scratch, parallel)
    return _concat(parts, a.itemsize)


def _scan(
    aw: np.ndarray, bw: np.ndarray, a: np.ndarray, group: int, base: int, scratch: _Scratch,
    parallel: bool | None = None,
) -> list[tuple[np.ndarray, np.ndarray, int]]:
    """Run the diff kernel over ``a`` (global index of ``a[0]``: ``base``), at most 64 blocks per call."""
    block_words = _BLOCK_ELEMS // group
    total_blocks = -(-aw.size // block_words)
    scratch_pos, scratch_xor, counts, sums = scratch.get(a.itemsize)
    parts = []
    for first in range(0, total_blocks, _SUPER_BLOCKS):
        n = min(_SUPER_BLOCKS, total_blocks - first)
        changed, delta = _kernels.diff_scan(aw, bw, a, group, block_words, first, n, base, scratch_pos, scratch_xor,
                                            counts, sums, parallel=parallel)
        if changed:
            pos = np.empty(changed, np.int64)
            xor = np.empty(changed, a.dtype)
            _kernels.compact(scratch_pos, scratch_xor, counts[:n], block_words * group, pos, xor)
            parts.append((pos, xor, int(delta)))
        elif delta:
            raise AssertionError("checksum changed without a changed element")
    return parts


def _diff_torch(cur: torch.Tensor, snap: torch.Tensor, step: int, width: int,
                base: int = 0) -> tuple[np.ndarray, np.ndarray, int]:
    """Flat bits ``cur`` vs ``snap`` (any one device; ``snap`` updated) by the device path, segments of ``step``."""
    assert snap.element_size() == width
    return diff_device([(None, cur, snap, base)], step_elems=step)[0]


def _concat(parts: list[tuple[np.ndarray, np.ndarray, int]], width: int) -> tuple[np.ndarray, np.ndarray, int]:
    """One part from many; a lone part is returned as is (its arrays are already the diff's own, not scratch)."""
    if not parts:
        return np.empty(0, np.int64), np.empty(0, UNSIGNED_NP[width]), 0
    if len(parts) == 1:
        return parts[0][0], parts[0][1], parts[0][2] & MASK64
    return (
        np.concatenate([p[0] for p in parts]),
        np.concatenate([p[1] for p in parts]),
        sum(p[2] for p in parts) & MASK64,
    )
