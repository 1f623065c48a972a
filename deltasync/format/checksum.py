"""Per-tensor checksums (``mix64-sum``, docs/FORMAT.md section 4).

A sum over (global index, bits) pairs: slices of a tensor (fused projections, tensor-parallel shards) are
checksummed where they live and the parts add up, and a delta updates a checksum in time proportional to
the elements it changes.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping

import numpy as np
import torch

from deltasync.format import _kernels
from deltasync.format._bits import int_view, np_bits

ALGORITHM = "mix64-sum"
MASK64 = (1 << 64) - 1
_CHUNK = 1 << 20


def tensor_checksum(t: torch.Tensor, base: int = 0) -> int:
    """Checksum of a whole tensor, on whatever device it lives; with ``base``, of a contiguous slice of a
    larger tensor whose first element sits at global flat index ``base`` (a rank's shard)."""
    t = t.detach()
    if t.device.type == "cpu":
        return int(_kernels.checksum_range(np_bits(t.contiguous()), base))
    return _torch_checksum(int_view(t.contiguous()), base)


def checksum_elements(t: torch.Tensor, indices: torch.Tensor) -> int:
    """Checksum of the elements of ``t`` (any shape, any device) that sit at global flat ``indices``.

    ``t.numel() == indices.numel()``; lets a holder of a slice checksum it with the full tensor's indices.
    """
    t = t.detach()
    if t.device.type == "cpu":
        idx = indices.reshape(-1).to(torch.int64).contiguous().numpy()
        return int(_kernels.checksum_at(np_bits(t.contiguous()), idx))
    return _torch_checksum_at(int_view(t.contiguous()), indices.reshape(-1).to(device=t.device, dtype=torch.int64))


def checksum_change(bits: torch.Tensor, positions: torch.Tensor | np.ndarray, xor: torch.Tensor | np.ndarray,
                    indices: torch.Tensor | np.ndarray) -> int:
    """The change of the checksum that ``bits.flat[positions] ^= xor`` would make (mod 2**64), each element
    hashed with its global flat index from ``indices``; writes nothing. Lets a holder prove a write before
    making it (an engine seals a staged step ahead of its pause) in one pass over the change.

    ``positions`` (int64) and ``indices`` are as long as ``xor`` (integers as wide as ``bits``' elements);
    ``TensorMismatchError`` if they are not, or a position is outside ``bits`` (the checks of ``xor_apply``).
    For ``bits`` on the CPU they may also be NumPy arrays: an engine sealing many tensors on a pool thread per
    core then makes no torch call per tensor beyond the view of ``bits`` (each one hands the GIL over, and the
    threads queue for it).
    """
    flat = bits.reshape(-1)
    if flat.device.type == "cpu":
        # the positions' bounds are checked by the serial kernel on the calling thread, not torch.aminmax: that
        # splits across torch's OpenMP threads, which an engine sealing on a pool thread per core contends for
        pos, x = _np_flat(positions), _np_flat(xor)
        idx = (indices.reshape(-1).to(torch.int64).contiguous().numpy() if isinstance(indices, torch.Tensor)
               else _np_flat(indices))
        check_patch(flat.element_size(), flat.numel(), pos, x, idx, pos.size)
        if not pos.size:
            return 0
        u = np_bits(flat)
        return int(_kernels.change_at(u, pos, x.view(u.dtype), idx.astype(np.int64, copy=False)))
    assert isinstance(positions, torch.Tensor) and isinstance(xor, torch.Tensor) and isinstance(indices, torch.Tensor)
    xor, positions, indices = xor.reshape(-1), positions.reshape(-1), indices.reshape(-1)
    check_patch(flat.element_size(), flat.numel(), positions, xor, indices, positions.numel())
    if not positions.numel():
        return 0
    return _torch_change(flat, positions, xor, indices)


def _np_flat(a: torch.Tensor | np.ndarray) -> np.ndarray:
    """A flat contiguous NumPy view (or copy, where not contiguous) of a CPU array or tensor."""
    if isinstance(a, torch.Tensor):
        return int_view(a.contiguous()).numpy()  # bits as integers of the same width (bfloat16 has no NumPy type)
    return np.ascontiguousarray(a).reshape(-1)


def _torch_change(flat: torch.Tensor, positions: torch.Tensor, xor: torch.Tensor, indices: torch.Tensor) -> int:
    """``checksum_change`` with torch operations (accelerators; the same number as the CPU kernel)."""
    old = int_view(flat)[positions.to(flat.device)]
    new = old ^ int_view(xor.to(flat.device))
    idx = indices.to(device=flat.device, dtype=torch.int64)
    return (_torch_checksum_at(new, idx) - _torch_checksum_at(old, idx)) & MASK64


def check_patch(width: int, numel: int, positions: np.ndarray | torch.Tensor | None, xor: np.ndarray | torch.Tensor,
                index: np.ndarray | torch.Tensor | int | None, count: int) -> None:
    """What every write of a patch (``xor_apply``) and every checksum of one (``checksum_change``) checks first:
    ``xor`` holds ``count`` values as wide as the tensor's ``width``-byte elements, ``positions`` are int64 within
    its ``numel`` elements, ``index`` (global indices, when an array) is as long; else ``TensorMismatchError``."""
    from deltasync.errors import TensorMismatchError

    xsize = int(xor.numel() if isinstance(xor, torch.Tensor) else xor.size)
    xwidth = xor.element_size() if isinstance(xor, torch.Tensor) else xor.itemsize
    if xwidth != width or xsize != count:
        raise TensorMismatchError(f"patch of {xsize} {8 * xwidth}-bit values for {count} elements of {8 * width} bits")
    if positions is not None and count:
        if positions.dtype not in (np.int64, torch.int64):
            raise TensorMismatchError(f"positions must be int64, got {positions.dtype}")
        lo, hi = (int(v) for v in (torch.aminmax(positions) if isinstance(positions, torch.Tensor)
                                    else _kernels.span(positions)))
        if lo < 0 or hi >= numel:
            raise TensorMismatchError(f"positions run from {lo} to {hi}, the tensor has {numel} elements")
    if index is not None and not isinstance(index, int):
        isize = int(index.numel() if isinstance(index, torch.Tensor) else index.size)
        if isize != count:
            raise TensorMismatchError(f"{isize} checksum indices for {count} patched elements")


def add(*parts: int) -> int:
    """Combine checksums of disjoint parts of one tensor (or apply a checksum delta)."""
    return sum(parts) & MASK64


def format_checksum(value: int) -> str:
    return f"0x{value & MASK64:016x}"


def parse_checksum(text: str) -> int:
    if not (isinstance(text, str) and text.startswith("0x") and len(text) == 18):
        raise ValueError(f"checksum must be '0x' + 16 hex digits, got {text!r}")
    return int(text, 16)


def state_checksum(checksums: Mapping[str, str]) -> str:
    """One digest of a whole model: SHA-256 of ``name<TAB>checksum`` lines, names sorted."""
    text = "".join(f"{name}\t{checksums[name]}\n" for name in sorted(checksums))
    return hashlib.sha256(text.encode()).hexdigest()


# --- torch implementation, for tensors on accelerators (same numbers as the CPU kernels) ---

_M1 = 0xBF58476D1CE4E5B9 - (1 << 64)  # as signed int64
_M2 = 0x94D049BB133111EB - (1 << 64)


def _srl(z: torch.Tensor, n: int) -> torch.Tensor:
    """Logical right shift of int64 (torch shifts signed values arithmetically)."""
    return (z >> n) & ((1 << (64 - n)) - 1)


def _torch_mix64(z: torch.Tensor) -> torch.Tensor:
    z = z ^ _srl(z, 30)
    z = z * _M1
    z = z ^ _srl(z, 27)
    z = z * _M2
    return z ^ _srl(z, 31)


def _unsigned64(bits: torch.Tensor) -> torch.Tensor:
    width = bits.element_size() * 8
    wide = bits.to(torch.int64)
    return wide if width == 64 else wide & ((1 << width) - 1)


def _torch_hash(u64: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    return _torch_mix64(u64 ^ _torch_mix64(indices))


def _torch_checksum_at(bits: torch.Tensor, indices: torch.Tensor) -> int:
    """Checksum of flat integer ``bits`` (any device) that sit at global flat ``indices`` (int64, same device)."""
    total = 0
    for s in range(0, bits.numel(), _CHUNK):
        total += int(_torch_hash(_unsigned64(bits[s : s + _CHUNK]), indices[s : s + _CHUNK]).sum().item())
    return total & MASK64


def _torch_checksum(bits: torch.Tensor, base: int) -> int:
    """Checksum of flat integer ``bits`` (any device), a slice whose first element sits at global index ``base``."""
    total = 0
    for s in range(0, bits.numel(), _CHUNK):
        chunk = bits[s : s + _CHUNK]
        idx = torch.arange(base + s, base + s + chunk.numel(), device=bits.device, dtype=torch.int64)
        total += int(_torch_hash(_unsigned64(chunk), idx).sum().item())
    return total & MASK64

