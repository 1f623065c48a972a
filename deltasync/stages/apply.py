"""Apply stage: the one in-place XOR + checksum apply, and the state-dict consumer built on it.

``xor_apply`` is the only code that writes a patch into a tensor: the state dict (``Replica``), replay and
the vLLM worker all call it, so the checksum of what was written is computed one way (docs/FORMAT.md
section 4, with each element's global index). ``apply_staged`` writes a staged step (decoded and checked
ahead, ``deltasync.stages.staging``), compares checksums, and on a mismatch applies the same XOR again
(XOR undoes itself), so the state is exactly as before: all or nothing.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import Future, wait
from typing import Any, Literal, TypeVar

import numpy as np
import torch

from deltasync.errors import (
    BaseStepMismatchError,
    ChecksumMismatchError,
    TensorMismatchError,
)
from deltasync.format import _kernels
from deltasync.format._bits import UNSIGNED_NP, int_view, np_bits
from deltasync.format.checksum import (
    MASK64,
    _torch_hash,
    _unsigned64,
    check_patch,
    format_checksum,
    parse_checksum,
    tensor_checksum,
)
from deltasync.format.codecs import DecodeScratch
from deltasync.format.objects import StepHeader, StepObject
from deltasync.format.patch import PackedPatch, Patch
from deltasync.stages._device import Scatter, xor_apply_many
from deltasync.stages.staging import StagedStep, check_layout, stage
from deltasync.threads import parallel_map, submit_all

__all__ = [
    "Replica", "StagedStep", "Verify", "apply_staged", "stage", "xor_apply", "xor_apply_all", "xor_apply_packed",
    "xor_into",
]

log = logging.getLogger(__name__)

Verify = Literal["incremental", "full"]
Indices = np.ndarray | torch.Tensor
T = TypeVar("T")

class Replica:
    """A consumer's copy of the weights at a known step, with the checksum of every tensor.

    ``tensors`` maps every trainer name (aliases included, sharing storage with their target) to a tensor.
    ``verify="incremental"`` proves each step from the previous one in time proportional to the change;
    ``"full"`` recomputes the checksum of every changed tensor from its bits.
    """

    def __init__(self, step: int, tensors: dict[str, torch.Tensor], checksums: dict[str, int]) -> None:
        self.step = step
        self.tensors = tensors
        self.checksums = checksums

    @classmethod
    def from_tensors(cls, tensors: dict[str, torch.Tensor], *, step: int) -> Replica:
        """A replica of tensors the caller vouches for as ``step`` (checksums computed here)."""
        return cls(step, tensors, {n: tensor_checksum(t) for n, t in tensors.items()})

    @classmethod
    def from_anchor(cls, obj: StepObject, *, device: str | torch.device = "cpu") -> Replica:
        """Load an anchor and check every tensor's checksum.

        Also loads every kernel a later apply may need (``warm_kernels``, for the widths of its tensors: once
        per process, seconds at most), so that no step, and no engine pause built on a replica, waits for a
        compilation."""
        h = obj.header
        _kernels.warm_kernels({t.itemsize for t in h.tensors.values()})
        if h.kind != "anchor":
            raise BaseStepMismatchError(f"{obj.where}: a fresh replica needs an anchor, this is a delta on step "
                                        f"{h.base_step}")
        tensors = {name: obj.tensor(name).to(device) for name in h.tensors}
        checksums = {name: tensor_checksum(t) for name, t in tensors.items()}
        _check(h, checksums, obj.where, names=h.tensors)
        for alias, target in h.aliases.items():
            tensors[alias] = tensors[target]
        return cls(h.step, tensors, checksums)

    def state_dict(self) -> dict[str, torch.Tensor]:
        return dict(self.tensors)

    def apply(self, obj: StepObject, *, verify: Verify = "incremental") -> None:
        """Advance to ``obj``'s step: a delta on this replica's step, or an anchor (loaded in place)."""
        h = obj.header
        if h.kind == "anchor":
            self._load_anchor_in_place(obj)
            return
        if h.base_step != self.step:
            raise BaseStepMismatchError(
                f"{obj.where}: delta to step {h.step} is based on step {h.base_step}, but the replica holds step "
                f"{self.step}", step=h.step, expected=h.base_step, found=self.step,
            )
        check_layout(h, self.tensors, obj.where)
        unchanged = {n for n in h.tensors if not h.tensors[n].changed}
        _check(h, self.checksums, obj.where, names=unchanged)  # the replica is the base it claims to be
        # each tensor is written as soon as it is decoded, on the pool: decoding (CPU) overlaps the writes
        # (memory); a tensor that fails to decode undoes the others' writes, so the step is still all or nothing.
        # Decoded into the pool thread's reused scratch (no fresh pages per tensor), so an undo decodes again
        names = [n for n, t in h.tensors.items() if t.changed]
        changed = _write_all(names, lambda n: obj.change(n, scratch=_scratch()), self.tensors, undo_of=obj.change,
                             where=obj.where, step=h.step,
                             checksums=self.checksums if verify == "incremental" else None,
                             cost=lambda n: h.tensors[n].changed,
                             on_host=all(self.tensors[n].device.type == "cpu" for n in names))
        self.checksums = {**self.checksums, **changed}
        self.step = h.step

    def _load_anchor_in_place(self, obj: StepObject) -> None:
        h = obj.header
        check_layout(h, self.tensors, obj.where)
        incoming = {name: obj.tensor(name) for name in h.tensors}
        checksums = {name: tensor_checksum(t) for name, t in incoming.items()}
        _check(h, checksums, obj.where, names=h.tensors)
        for name, t in incoming.items():
            self.tensors[name].copy_(t)
        self.checksums = checksums
        self.step = h.step


def _check(h: StepHeader, checksums: Mapping[str, int], where: str, *, names: Iterable[str]) -> None:
    bad = [n for n in names if checksums[n] != parse_checksum(h.tensors[n].checksum)]
    if bad:
        n = bad[0]
        raise ChecksumMismatchError(
            f"{where}: {len(bad)} tensor(s) do not match the trainer's checksums after step {h.step}, first {n!r}: "
            f"expected {h.tensors[n].checksum}, got {format_checksum(checksums[n])}",
            step=h.step, tensor=n, expected=h.tensors[n].checksum, found=format_checksum(checksums[n]),
        )


def apply_staged(
    staged: StagedStep, tensors: Mapping[str, torch.Tensor], *, checksums: Mapping[str, int] | None = None
) -> dict[str, int]:
    """Write a staged step into ``tensors`` in place and prove it; returns the changed tensors' checksums.

    ``checksums`` are the tensors' checksums before the step: each changed tensor's checksum after is then
    that plus the change ``xor_apply`` reports (time proportional to the change); None computes them from
    the written bits (a full pass over each changed tensor). On a mismatch with the step header, or any
    error while writing, the patches already written are applied again, which restores the exact previous
    bits, and the error is raised (``ChecksumMismatchError`` for a mismatch).
    """
    return _write_all(staged.patches, lambda p: p, tensors, checksums=checksums, where=staged.where,
                      step=staged.step, cost=lambda p: p.xor.size,
                      on_host=all(tensors[p.name].device.type == "cpu" for p in staged.patches))


def _write_all(items: Sequence[T], patch_of: Callable[[T], Patch | PackedPatch], tensors: Mapping[str, torch.Tensor], *,
               checksums: Mapping[str, int] | None, where: str, step: int,
               cost: Callable[[T], int], on_host: bool,
               undo_of: Callable[[T], Patch | PackedPatch] | None = None) -> dict[str, int]:
    """Write ``patch_of(item)`` for every item (a decoded patch, or a name decoded here), compare checksums,
    and undo every landed write on any error: ``apply_staged``'s contract, for patches decoded ahead or as
    they are written. ``undo_of(item)``: the patch to undo with, when ``patch_of``'s does not outlive its write
    (decoded into reused scratch)."""
    written: list[tuple[T, Patch | PackedPatch]] = []
    futures: list[Future[Patch | PackedPatch]] = []
    deltas: dict[str, int] = {}

    def write(x: T) -> Patch | PackedPatch:
        p = patch_of(x)
        deltas[p.name] = _xor_either(tensors[p.name], p, checksum=True)
        written.append((x, p))  # list.append is atomic: the undo sees every landed patch
        return p

    try:
        # host tensors are patched in parallel across tensors, largest first (none starts last); device
        # tensors one after another, in order
        patches: Sequence[Patch | PackedPatch]
        if on_host:
            futures = submit_all(write, items, cost=cost)
            patches = [f.result() for f in futures]
        else:  # accelerator tensors: every patch decoded first, then one transfer for the step (xor_apply_all)
            unpacked = [_unpacked(patch_of(x)) for x in items]
            patches = unpacked
            landed: list[int] = []
            try:
                found = xor_apply_all([(tensors[p.name], p.positions, p.xor, None) for p in unpacked], landed=landed)
            finally:
                written.extend((items[j], unpacked[j]) for j in landed)
            deltas.update((p.name, d) for p, d in zip(unpacked, found, strict=True))
        if checksums is not None:
            after = {p.name: (checksums[p.name] + deltas[p.name]) & MASK64 for p in patches}
        else:
            after = dict(zip((p.name for p in patches),
                             parallel_map(lambda p: tensor_checksum(tensors[p.name]), patches,
                                          cost=lambda p: tensors[p.name].numel()), strict=True))
        bad = [p for p in patches if after[p.name] != p.checksum]
        if bad:
            raise ChecksumMismatchError(
                f"{where}: {len(bad)} tensor(s) do not match the trainer's checksums after step {step}, "
                f"first {bad[0].name!r}: expected {format_checksum(bad[0].checksum)}, got "
                f"{format_checksum(after[bad[0].name])}", step=step, tensor=bad[0].name,
                expected=format_checksum(bad[0].checksum), found=format_checksum(after[bad[0].name]),
            )
    except BaseException:
        for f in futures:
            f.cancel()
        wait(futures)  # writes still running land before they are undone
        _undo(tensors, [p if undo_of is None else _Redecode(x, undo_of) for x, p in written])
        raise
    return after


class _Redecode:
    """A written patch to undo, decoded again when the undo needs it."""

    def __init__(self, item: object, decode: Callable[[Any], Patch | PackedPatch]) -> None:
        self.item, self.decode = item, decode


def _undo(tensors: Mapping[str, torch.Tensor], done: Sequence[Patch | PackedPatch | _Redecode]) -> None:
    """XOR again what was written: back to the exact previous bits."""
    for p in reversed(done):
        try:
            q = p.decode(p.item) if isinstance(p, _Redecode) else p
            _xor_either(tensors[q.name], q, checksum=False)
        except Exception:
            log.exception("restoring tensor %r after a failed apply failed too",
                          p.item if isinstance(p, _Redecode) else p.name)


_local = threading.local()


def _scratch() -> DecodeScratch:
    """This thread's decode scratch (a pool thread keeps its own; it grows to the largest tensor's change)."""
    s = _local.__dict__.get("scratch")
    if s is None:
        s = _local.scratch = DecodeScratch()
    return s


def _unpacked(p: Patch | PackedPatch) -> Patch:
    return p.unpack() if isinstance(p, PackedPatch) else p


def _xor_either(t: torch.Tensor, p: Patch | PackedPatch, *, checksum: bool) -> int:
    if isinstance(p, PackedPatch):
        return xor_apply_packed(t, p, checksum=checksum)
    return xor_apply(t, p.positions, p.xor, checksum=checksum)


def xor_apply_packed(bits: torch.Tensor, packed: PackedPatch, *, base: int = 0, checksum: bool = True) -> int:
    """``xor_apply`` of a ``PackedPatch``: on a CPU tensor its ``gap16`` entries are decoded as they are scattered
    (one pass, no positions array in between); elsewhere (an accelerator, the dense form) it is unpacked first.

    ``bits``: a contiguous tensor of ``packed.numel`` elements as wide as its dtype (any dtype: only the bits are
    touched). ``base``: the global flat index of ``bits``' first element, which the checksum hashes (a part of a
    tensor, docs/FORMAT.md section 5b). Returns the checksum change (mod 2**64), or 0 with ``checksum=False``.

    Raises ``TensorMismatchError`` before any write when ``bits`` is not such a tensor; the patch itself was
    checked in full when it was decoded (``StepObject.packed``), so nothing else can fail once writing starts.

    Example::

        delta = xor_apply_packed(replica.tensors[name], obj.packed(name))
    """
    _check_packed(bits, packed)
    if packed.entries is None or packed.starts is None or bits.device.type != "cpu":
        p = packed.unpack()
        return xor_apply(bits, p.positions, p.xor, index=base or None, checksum=checksum)
    return int(_kernels.gap16_xor(np_bits(bits), packed.entries, packed.planes, packed.starts, base,
                                  checksum=checksum))


def xor_apply(
    bits: torch.Tensor,
    positions: Indices | None,
    xor: np.ndarray | torch.Tensor,
    *,
    index: Indices | int | None = None,
    checksum: bool = True,
) -> int:
    """``bits.flat[positions] ^= xor`` in place (every element when ``positions`` is None); returns the
    change of the checksum (docs/FORMAT.md section 4, mod 2**64), or 0 with ``checksum=False``.

    ``bits``: a contiguous tensor on any device, of any dtype (only its bits are touched; a flat integer
    view of it works as well). ``positions``: int64 flat indices into ``bits`` (NumPy or torch), each at
    most once. ``xor``: old ^ new bits as integers of ``bits``' width, one per position (or per element).
    ``index``: the elements' global flat indices in the full tensor, which the checksum hashes, when
    ``bits`` holds part of it (a shard, one part of a fused parameter, a chunk): an array as long as
    ``xor``, or an int, the global index of ``bits``' first element. Default: the positions themselves.

    Everything is checked before the first write (``TensorMismatchError``: nothing was changed); the new
    bits are read back after the write, so the checksum change follows what landed.
    """
    if not bits.is_contiguous():
        raise TensorMismatchError(f"cannot patch a non-contiguous tensor of shape {tuple(bits.shape)} in place")
    width, numel = bits.element_size(), bits.numel()
    count = numel if positions is None else int(positions.numel() if isinstance(positions, torch.Tensor)
                                                else positions.size)
    check_patch(width, numel, positions, xor, index, count)
    if bits.device.type == "cpu":
        return _xor_apply_np(np_bits(bits), positions, _np_unsigned(xor, width), index, checksum)
    return _xor_apply_torch(int_view(bits), positions, xor, index, checksum)


def xor_apply_all(
    items: Sequence[tuple[torch.Tensor, Indices | None, np.ndarray | torch.Tensor, Indices | int | None]],
    *,
    checksum: bool = True,
    landed: list[int] | None = None,
    scatter: Scatter = "torch",
) -> list[int]:
    """``xor_apply(bits, positions, xor, index=index)`` for each item; returns each checksum change.

    Every item is checked first (``TensorMismatchError``: nothing was changed). Tensors on one accelerator are
    written with one host-to-device transfer for all items and no host sync per tensor (docs/GPU.md); the
    index arrays must then be on the host. ``landed`` gets the number of each item as its write is issued (on
    an error, the caller XORs those again). ``scatter="triton"`` (with ``checksum=False``): one kernel launch
    per element width instead of a few per tensor.
    """
    landed = [] if landed is None else landed
    bits = [b for b, *_ in items]
    if not bits or len({b.device for b in bits}) != 1 or bits[0].device.type == "cpu":
        out = []
        for j, (b, p, x, ix) in enumerate(items):
            out.append(xor_apply(b, p, x, index=ix, checksum=checksum))
            landed.append(j)
        return out
    checked = []
    for b, p, x, ix in items:
        if not b.is_contiguous():
            raise TensorMismatchError(f"cannot patch a non-contiguous tensor of shape {tuple(b.shape)} in place")
        count = b.numel() if p is None else int(p.numel() if isinstance(p, torch.Tensor) else p.size)
        check_patch(b.element_size(), b.numel(), p, x, ix, count)
        checked.append((int_view(b), None if p is None else _np_int64(p), _np_unsigned(x, b.element_size()),
                        ix if ix is None or isinstance(ix, int) else _np_int64(ix)))
    return xor_apply_many(checked, checksum=checksum, landed=landed, scatter=scatter)


def _check_packed(bits: torch.Tensor, packed: PackedPatch) -> None:
    if not bits.is_contiguous():
        raise TensorMismatchError(f"cannot patch a non-contiguous tensor of shape {tuple(bits.shape)} in place")
    if bits.numel() != packed.numel or bits.element_size() != packed.width:
        raise TensorMismatchError(f"patch of {packed.name!r} is for {packed.numel} elements of {8 * packed.width} "
                                  f"bits, the tensor has {bits.numel()} of {8 * bits.element_size()}")


def host_bits(bits: torch.Tensor, packed: PackedPatch) -> np.ndarray:
    """``bits`` (a contiguous CPU tensor) checked as ``xor_apply_packed`` checks it, as the array the CPU kernels
    take: for a caller that writes a sparse packed patch in many slices (replay, block by block)."""
    _check_packed(bits, packed)
    if bits.device.type != "cpu" or packed.entries is None:
        raise TensorMismatchError(f"cannot patch a non-CPU tensor of shape {tuple(bits.shape)} here, or densely")
    return np_bits(bits)


def xor_either(bits: torch.Tensor, p: Patch | PackedPatch, *, checksum: bool = True) -> int:
    """``xor_apply_packed`` or ``xor_apply`` of ``p``, whichever it is (what ``StepObject.change`` returns)."""
    return _xor_either(bits, p, checksum=checksum)


def host_arrays(bits: torch.Tensor, positions: np.ndarray,
                xor: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``bits`` (a contiguous CPU tensor), ``positions`` and ``xor`` checked as ``xor_apply`` checks them, as
    the arrays the CPU kernels take: for a caller that writes one patch in many slices (replay, block by
    block), checked once in full (every slice is then in range) instead of once per slice."""
    if not bits.is_contiguous() or bits.device.type != "cpu":
        raise TensorMismatchError(f"cannot patch a non-contiguous or non-CPU tensor of shape {tuple(bits.shape)} here")
    check_patch(bits.element_size(), bits.numel(), positions, xor, None, int(positions.size))
    return np_bits(bits), _np_int64(positions), _np_unsigned(xor, bits.element_size())


def _np_unsigned(x: np.ndarray | torch.Tensor, width: int) -> np.ndarray:
    if isinstance(x, torch.Tensor):
        x = int_view(x.detach().reshape(-1).cpu().contiguous()).numpy()
    return np.ascontiguousarray(x).reshape(-1).view(UNSIGNED_NP[width])


def _np_int64(x: Indices) -> np.ndarray:
    if isinstance(x, torch.Tensor):
        return x.detach().reshape(-1).to(device="cpu", dtype=torch.int64).contiguous().numpy()
    return np.ascontiguousarray(x, dtype=np.int64).reshape(-1)


def _xor_apply_np(u: np.ndarray, positions: Indices | None, xor: np.ndarray, index: Indices | int | None,
                  checksum: bool) -> int:
    """The CPU kernels (one pass, the checksum change folded into the scatter)."""
    if positions is None and (index is None or isinstance(index, int)):
        if not checksum:
            np.bitwise_xor(u, xor, out=u)
            return 0
        return int(_kernels.xor_dense(u, xor, index or 0))
    pos = np.arange(u.size, dtype=np.int64) if positions is None else _np_int64(positions)
    if not checksum:
        _kernels.xor_plain_at(u, pos, xor)
        return 0
    if index is None:
        return int(_kernels.xor_at(u, pos, xor))
    hashed = pos + index if isinstance(index, int) else _np_int64(index)
    return int(_kernels.xor_at_indexed(u, pos, xor, hashed, np.empty_like(xor)))


def _xor_apply_torch(
    bits: torch.Tensor, positions: Indices | None, xor: np.ndarray | torch.Tensor, index: Indices | int | None,
    checksum: bool
) -> int:
    """``xor_apply`` on flat integer bits with torch ops (accelerators; the same numbers as the CPU kernels)."""
    dev = bits.device
    if isinstance(xor, np.ndarray):
        x = torch.from_numpy(np.ascontiguousarray(xor).view(f"i{xor.itemsize}")).to(dev)
    else:
        x = xor.detach().reshape(-1).view(bits.dtype).to(dev)
    if positions is None:
        idx = torch.arange(bits.numel(), device=dev)
    else:
        idx = torch.as_tensor(positions, device=dev).reshape(-1)
    old = bits[idx]
    bits[idx] = old ^ x
    if not checksum:
        return 0
    new = bits[idx]  # read back what landed
    if index is None:
        g = idx
    elif isinstance(index, int):
        g = idx + index
    else:
        g = torch.as_tensor(index, device=dev).reshape(-1).to(torch.int64)
    return int((_torch_hash(_unsigned64(new), g).sum() - _torch_hash(_unsigned64(old), g).sum()).item()) & MASK64


def xor_into(t: torch.Tensor, positions: np.ndarray | None, xor: np.ndarray) -> int:
    """``xor_apply(t, positions, xor)``: the name before issue 9."""
    return xor_apply(t, positions, xor)

