"""One kernel launch per element width for a whole step's XOR scatter into separate tensors (optional: Triton).

torch launches at least one kernel per tensor (each parameter is its own allocation). This kernel takes a
table of the tensors' base addresses instead: each program writes one tile of ``_BLOCK`` changes of one tensor
(the tiles never cross tensors), so a step of any number of tensors of one width is one launch. The writes
go to the tensors' own storage, so CUDA graphs captured on them stay valid. Positions must be distinct within
a tensor (they are: ascending, checked when staged). Tested on CPU under ``TRITON_INTERPRET=1``; on a GPU it
runs only where asked for (``xor_apply_many(..., scatter="triton")``, bench/bench_gpu.py).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - Triton ships with CUDA builds of torch
    triton = None

_BLOCK = 1024

if triton is not None:
    _TL = {1: tl.int8, 2: tl.int16, 4: tl.int32, 8: tl.int64}

    @triton.jit
    def _xor_scatter(table_ptr, tiles_ptr, pos_ptr, xor_ptr, DTYPE: tl.constexpr, BLOCK: tl.constexpr):
        pid = tl.program_id(0)
        item = tl.load(tiles_ptr + 3 * pid)
        start = tl.load(tiles_ptr + 3 * pid + 1)
        stop = tl.load(tiles_ptr + 3 * pid + 2)
        base = tl.load(table_ptr + item).to(tl.pointer_type(DTYPE))
        i = start + tl.arange(0, BLOCK)
        m = i < stop
        p = tl.load(pos_ptr + i, mask=m, other=0)
        x = tl.load(xor_ptr + i, mask=m, other=0)
        old = tl.load(base + p, mask=m, other=0)
        tl.store(base + p, old ^ x, mask=m)


def xor_scatter_table(items: Sequence[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]) -> int:
    """``bits[pos] ^= xor`` for every ``(bits, pos, xor)`` (flat integer views on one device; ``pos`` int64 and
    ``xor`` of ``bits``' dtype on that device, contiguous), one launch per element width; returns the launches.

    ``pos`` and ``xor`` of one width are expected to be consecutive slices of one buffer (as ``xor_apply_many``
    packs them); otherwise they are concatenated first (a copy on the device)."""
    if triton is None:
        raise ImportError("the one-launch scatter needs Triton (it ships with CUDA builds of torch)")
    launches = 0
    for width in sorted({b.element_size() for b, _, _ in items}, reverse=True):
        group = [it for it in items if it[0].element_size() == width and it[1].numel()]
        if not group:
            continue
        device = group[0][0].device
        pos = _contiguous_run([p for _, p, _ in group])
        xor = _contiguous_run([x for _, _, x in group])
        counts = np.array([p.numel() for _, p, _ in group], np.int64)
        starts = np.concatenate([[0], np.cumsum(counts)[:-1]])
        tiles = np.array([(k, s, min(s + _BLOCK, starts[k] + counts[k])) for k in range(len(group))
                          for s in range(int(starts[k]), int(starts[k] + counts[k]), _BLOCK)], np.int64)
        meta = np.concatenate([np.array([b.data_ptr() for b, _, _ in group], np.int64), tiles.reshape(-1)])
        meta_d = torch.from_numpy(meta).to(device)
        _xor_scatter[(len(tiles),)](meta_d, meta_d[len(group):], pos, xor, DTYPE=_TL[width], BLOCK=_BLOCK)
        launches += 1
    return launches


def _contiguous_run(parts: list[torch.Tensor]) -> torch.Tensor:
    """The parts as one tensor: a view when they already lie back to back in one storage, else a copy."""
    first = parts[0]
    end = first.storage_offset()
    for p in parts:
        if p.untyped_storage().data_ptr() != first.untyped_storage().data_ptr() or p.storage_offset() != end:
            return torch.cat(parts)
        end += p.numel()
    return first.as_strided((end - first.storage_offset(),), (1,), first.storage_offset())
