"""Device paths of the diff and the apply: a step's changes cross the bus in one transfer, no host sync per tensor.

On an accelerator every ``.item()``, ``nonzero()`` or small ``.cpu()``/``.to(device)`` makes the host wait
for the device; with hundreds of tensors per step those waits, not the bandwidth, would set the time. These
functions are plain torch ops on any device (the tests run them on CPU tensors) and give the same positions,
xor values and checksum changes as the CPU kernels (docs/FORMAT.md section 4). docs/GPU.md is the design.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from typing import Any, Literal

import numpy as np
import torch

from deltasync.format._bits import UNSIGNED_NP, int_view
from deltasync.format.checksum import MASK64, _torch_hash, _unsigned64

Scatter = Literal["torch", "triton"]
_MIN_CAP = 1024  # smallest capacity reserved for a segment's changes
_WIDTHS = (8, 4, 2, 1)  # xor groups in a packed buffer, widest first: every view stays aligned


def _nonzero_capped(mask: torch.Tensor, cap: int) -> torch.Tensor:
    """The first ``cap`` indices where ``mask`` is set, padded with 0, without a host sync where torch can."""
    try:
        return torch.nonzero_static(mask, size=cap, fill_value=0).reshape(-1)
    except (NotImplementedError, RuntimeError):  # an older torch or a backend without it: one sync here
        idx = mask.nonzero().reshape(-1)[:cap]
        return torch.cat([idx, idx.new_zeros(cap - idx.numel())])


def _diff_segment(c: torch.Tensor, o: torch.Tensor, cap: int, gbase: int) -> tuple[torch.Tensor, ...]:
    """Device-side diff of flat bits ``c`` (new) vs ``o`` (snapshot, updated at the changes found): (count of all
    changes, global positions of the first ``cap``, their xor, their checksum change), all still on the device."""
    ne = c != o
    count = ne.sum()
    idx = _nonzero_capped(ne, cap)
    new, old = c[idx], o[idx]
    o[idx] = new  # the padding repeats index 0 and writes c[0] there: right whether or not element 0 changed
    g = idx + gbase
    hashed = _torch_hash(_unsigned64(new), g) - _torch_hash(_unsigned64(old), g)
    valid = torch.arange(cap, device=c.device) < count
    return count, g, new ^ old, torch.where(valid, hashed, torch.zeros_like(hashed)).sum()


def diff_device(
    items: Sequence[tuple[Hashable, torch.Tensor, torch.Tensor, int]],
    *,
    step_elems: int,
    cast: Callable[[torch.Tensor], torch.Tensor] = lambda t: t,
    caps: dict[Any, int] | None = None,
    max_pending_bytes: int = 1 << 30,
) -> list[tuple[np.ndarray, np.ndarray, int]]:
    """Diff ``(key, current tensor, snapshot bits, global base)`` items on their device; per item (global
    positions, xor bits as unsigned NumPy, checksum change mod 2**64), and every snapshot set to its current.

    Each item is cut into segments of ``step_elems`` elements (``cast`` maps a flat slice of the current tensor to
    the snapshot's dtype, one segment at a time). A segment reserves room for ``caps[(key, start)]`` changes
    (learned from the last diff: twice its count); the counts of all segments come back in one transfer, a
    segment that found more changes than its room is finished then with the exact count, and every change then
    comes back in one more transfer. ``max_pending_bytes`` bounds the device memory held by reserved room
    between transfers (a model with more changes than that takes more than one pair of transfers).
    """
    caps = {} if caps is None else caps
    pieces: list[list[tuple[np.ndarray, np.ndarray, int]]] = [[] for _ in items]
    pending: list[tuple[int, int, int, tuple[torch.Tensor, ...]]] = []  # (item, start, cap, segment result)
    held = 0

    def segment(i: int, s: int) -> tuple[torch.Tensor, torch.Tensor]:
        _, cur, snap, _ = items[i]
        o = snap[s : s + step_elems]
        return int_view(cast(cur.detach().reshape(-1)[s : s + o.numel()]).contiguous()), o

    def flush() -> None:
        counts = _to_host(torch.stack([r[0] for *_, r in pending])).tolist() if pending else []
        out: list[tuple[int, torch.Tensor, torch.Tensor, torch.Tensor]] = []
        for (i, s, cap, (_, g, x, d)), n in zip(pending, counts, strict=True):
            caps[(items[i][0], s)] = max(_MIN_CAP, 2 * n)
            out.append((i, g[: min(n, cap)], x[: min(n, cap)], d))
            if n > cap:  # the first ``cap`` changes are in the snapshot already: the rest, exactly counted
                c, o = segment(i, s)
                _, g2, x2, d2 = _diff_segment(c, o, n - cap, items[i][3] + s)
                out.append((i, g2, x2, d2))
        if out:
            host = _unpack(_to_host(_pack([g for _, g, _, _ in out], [x for *_, x, _ in out], [d for *_, d in out])),
                           [g.numel() for _, g, _, _ in out], [x.element_size() for *_, x, _ in out])
            for (i, *_), part in zip(out, host, strict=True):
                pieces[i].append(part)
        pending.clear()

    for i, (key, _, snap, base) in enumerate(items):
        for s in range(0, snap.numel(), step_elems):
            c, o = segment(i, s)
            cap = min(o.numel(), caps.get((key, s), max(_MIN_CAP, o.numel() // 16)))
            pending.append((i, s, cap, _diff_segment(c, o, cap, base + s)))
            held += cap * (8 + o.element_size())
            if held >= max_pending_bytes:
                flush()
                held = 0
    flush()
    return [_join(p, snap.element_size()) for p, (_, _, snap, _) in zip(pieces, items, strict=True)]


def _join(parts: list[tuple[np.ndarray, np.ndarray, int]], width: int) -> tuple[np.ndarray, np.ndarray, int]:
    parts = [p for p in parts if p[0].size] or parts[:1]
    if not parts:
        return np.empty(0, np.int64), np.empty(0, UNSIGNED_NP[width]), 0
    if len(parts) == 1:
        return parts[0][0], parts[0][1], parts[0][2] & MASK64
    return (np.concatenate([p[0] for p in parts]), np.concatenate([p[1] for p in parts]),
            sum(p[2] for p in parts) & MASK64)


def _pack(int64s: list[torch.Tensor], xors: list[torch.Tensor], scalars: list[torch.Tensor]) -> torch.Tensor:
    """One flat uint8 device buffer: the int64 arrays, the int64 scalars, then the xors grouped widest first."""
    parts = [t.reshape(-1).view(torch.uint8) for t in int64s]
    if scalars:
        parts.append(torch.stack(scalars).to(torch.int64).view(torch.uint8))
    for w in _WIDTHS:
        parts += [x.reshape(-1).view(torch.uint8) for x in xors if x.element_size() == w]
    return torch.cat(parts) if parts else torch.empty(0, dtype=torch.uint8)


def _unpack(buf: torch.Tensor, counts: list[int], widths: list[int]) -> list[tuple[np.ndarray, np.ndarray, int]]:
    """``_pack``'s buffer (on the host) back into per-part (positions, xor, checksum change) NumPy views."""
    h = buf.numpy()
    off = 8 * sum(counts)
    pos = np.split(h[:off].view(np.int64), np.cumsum(counts)[:-1]) if counts else []
    deltas = h[off : off + 8 * len(counts)].view(np.int64)
    off += 8 * len(counts)
    xors: dict[int, np.ndarray] = {}
    for w in _WIDTHS:
        for j in (j for j, wj in enumerate(widths) if wj == w):
            xors[j] = h[off : off + w * counts[j]].view(UNSIGNED_NP[w])
            off += w * counts[j]
    return [(pos[j], xors[j], int(deltas[j]) & MASK64) for j in range(len(counts))]


def _to_host(t: torch.Tensor) -> torch.Tensor:
    """One device-to-host copy; into pinned memory (torch caches those blocks) from a CUDA device."""
    if t.device.type != "cuda":
        return t.cpu()
    out = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    out.copy_(t, non_blocking=True)
    torch.cuda.current_stream(t.device).synchronize()
    return out


def _to_device(buf: np.ndarray, device: torch.device) -> torch.Tensor:
    """One host-to-device copy of a uint8 buffer, through pinned memory to a CUDA device."""
    t = torch.from_numpy(buf)
    if device.type != "cuda":
        return t.to(device)
    pinned = torch.empty(t.shape, dtype=torch.uint8, pin_memory=True)
    pinned.copy_(t)
    return pinned.to(device, non_blocking=True)  # the caching host allocator keeps it until the copy is done


def xor_apply_many(
    items: Sequence[tuple[torch.Tensor, np.ndarray | None, np.ndarray, int | np.ndarray | None]],
    *,
    checksum: bool = True,
    landed: list[int] | None = None,
    scatter: Scatter = "torch",
) -> list[int]:
    """``xor_apply`` of many ``(bits, positions, xor, index)`` (all bits flat integer views on one device; the
    arrays NumPy, already checked) with one host-to-device transfer of all positions, xor and checksum indices.

    Appends each item's number to ``landed`` as its write is issued (the caller undoes those on an error).
    Returns each item's checksum change (mod 2**64; zeros with ``checksum=False``), fetched in one transfer.
    ``scatter="triton"`` (``checksum=False`` only) writes every sparse item of one element width with one kernel
    launch (``deltasync.stages._triton_scatter``); ``"torch"``: a gather, an XOR and a scatter per tensor.
    """
    if not items:
        return []
    device = items[0][0].device
    landed = [] if landed is None else landed
    counts = [int(x.size) for _, _, x, _ in items]
    sparse = [p is not None for _, p, _, _ in items]
    indexed = [ix is not None and not isinstance(ix, int) for *_, ix in items]
    host = [np.ascontiguousarray(p, dtype=np.int64) for _, p, _, _ in items if p is not None]
    host += [np.ascontiguousarray(ix, dtype=np.int64) for (*_, ix), k in zip(items, indexed, strict=True) if k]
    n64 = sum(a.size for a in host)
    order = [j for w in _WIDTHS for j, it in enumerate(items) if it[0].element_size() == w]
    buf = np.empty(8 * n64 + sum(items[j][0].element_size() * counts[j] for j in order), np.uint8)
    off = 0
    for a in host:
        buf[off : off + 8 * a.size] = a.view(np.uint8)
        off += 8 * a.size
    for j in order:
        x = np.ascontiguousarray(items[j][2]).reshape(-1).view(np.uint8)
        buf[off : off + x.size] = x
        off += x.size
    dev = _to_device(buf, device)
    # device views, in the buffer's order
    i64 = dev[: 8 * n64].view(torch.int64)
    off64, pos_d, idx_d = 0, {}, {}
    for j in range(len(items)):
        if sparse[j]:
            pos_d[j] = i64[off64 : off64 + counts[j]]
            off64 += counts[j]
    for j in range(len(items)):
        if indexed[j]:
            idx_d[j] = i64[off64 : off64 + counts[j]]
            off64 += counts[j]
    xor_d, off = {}, 8 * n64
    for j in order:
        bits = items[j][0]
        xor_d[j] = dev[off : off + bits.element_size() * counts[j]].view(bits.dtype)
        off += bits.element_size() * counts[j]
    if scatter == "triton":
        if checksum:
            raise ValueError("the Triton scatter writes without a checksum (seal the step first)")
        from deltasync.stages._triton_scatter import xor_scatter_table

        dense = [j for j in range(len(items)) if not sparse[j]]
        for j in dense:
            items[j][0].bitwise_xor_(xor_d[j])
            landed.append(j)
        rest = [j for j in range(len(items)) if sparse[j]]
        xor_scatter_table([(items[j][0], pos_d[j], xor_d[j]) for j in rest])
        landed += rest
        return [0] * len(items)
    deltas = []
    for j, (bits, _, _, index) in enumerate(items):
        idx = pos_d[j] if sparse[j] else torch.arange(counts[j], device=device)
        old = bits[idx]
        bits[idx] = old ^ xor_d[j]
        landed.append(j)
        if checksum:
            new = bits[idx]  # read back what landed
            g = idx_d[j] if indexed[j] else idx + (index if isinstance(index, int) else 0)  # else: None or an int
            deltas.append((_torch_hash(_unsigned64(new), g) - _torch_hash(_unsigned64(old), g)).sum())
    if not checksum:
        return [0] * len(items)
    return [int(d) & MASK64 for d in _to_host(torch.stack(deltas)).tolist()]
