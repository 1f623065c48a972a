"""Compiled CPU kernels of the byte codecs (numba; docs/FORMAT.md section 3): ``gap16`` position entries and
byte shuffling (all elements' byte 0, then byte 1, ...). ``codecs.py`` calls them; :func:`warm_kernels
<deltasync.format._kernels.warm_kernels>` loads them with the other kernels.
"""

from __future__ import annotations

import numpy as np

from deltasync.format._kernel_cache import jit as _jit
from deltasync.format._kernel_cache import read_only as _ro

__all__ = ["GAP16_BLOCK", "gap16_check", "gap16_decode", "gap16_encode", "shuffle_bytes", "unshuffle_bytes"]

GAP16_BLOCK = 1 << 15
"""``gap16`` entries per block of :func:`gap16_check`'s ``starts``: the unit a scatter splits across threads."""

# what ``gap16_check`` found (its first result); ``codecs`` turns each into a ``FormatError`` naming it
GAP16_OK, GAP16_COUNT, GAP16_RANGE, GAP16_TRAILING, GAP16_ZERO_VALUE = 0, 1, 2, 3, 4


@_jit
def gap16_encode(positions: np.ndarray) -> np.ndarray:
    """The ``gap16`` entries of sorted positions, already byte-shuffled (all low bytes, then high bytes).

    One pass: the output is sized for the most escapes the last position allows (one per 65535 elements), the
    high bytes written that far out and moved down after; a pass counting the entries first cost 40% more."""
    n = positions.size
    cap = n + (positions[n - 1] + 1) // 65535 + 1 if n else 0
    out = np.empty(2 * cap, np.uint8)
    e = 0
    prev = -1
    for i in range(n):
        p = positions[i]
        gap = p - prev
        while gap > 65535:
            out[e] = 0
            out[cap + e] = 0
            e += 1
            gap -= 65535
        out[e] = gap & 0xFF
        out[cap + e] = gap >> 8
        e += 1
        prev = p
    if e < cap:
        out[e : 2 * e] = out[cap : cap + e]
    return out[: 2 * e]


@_jit
def _gap16_decode(shuffled: np.ndarray, max_count: np.int64) -> np.ndarray:
    """Sorted positions from byte-shuffled ``gap16`` entries; at most ``max_count`` (more returns -1 marker).

    Branch-free: an escape writes a slot that the next position overwrites."""
    entries = shuffled.size // 2
    if max_count < 0:
        return np.full(1, -1, np.int64)
    out = np.empty(entries + 1, np.int64)  # no entry yields more than one position
    pos = np.int64(-1)
    k = 0
    lo = shuffled[:entries]
    hi = shuffled[entries : 2 * entries]
    for e in range(entries):
        v = np.int64(lo[e]) | (np.int64(hi[e]) << 8)
        z = np.int64(v == 0)
        pos += v + z * 65535
        out[k] = pos
        k += 1 - z
    if k > max_count:
        return np.full(1, -1, np.int64)
    return out[:k]


@_jit
def _gap16_check(shuffled: np.ndarray, planes: np.ndarray, width: np.int64, changed: np.int64,
                 numel: np.int64) -> tuple[np.int64, np.int64, np.ndarray]:
    """Validate byte-shuffled ``gap16`` entries and their byte-shuffled values without decoding a position.

    Read-only, one pass over each (reductions the compiler vectorises): counts the entries that list an element
    and sums every entry's advance (an escape ``0`` advances 65535), so the last position is the sum minus one;
    counts the values whose bits are all zero. Returns ``(status, detail, starts)``: ``status`` is one of
    ``GAP16_*`` (``detail`` the count found, the last position or the zero values), and ``starts[b] =
    (position before block b, values before block b)`` for blocks of ``GAP16_BLOCK`` entries (one row more
    at the end): where a scatter of block ``b`` starts, so that blocks can be scattered on several threads.
    """
    entries = shuffled.size // 2
    nblocks = (entries + GAP16_BLOCK - 1) // GAP16_BLOCK
    starts = np.empty((nblocks + 1, 2), np.int64)
    pos = np.int64(-1)
    k = np.int64(0)
    for b in range(nblocks):
        starts[b, 0] = pos
        starts[b, 1] = k
        s = b * GAP16_BLOCK
        e = min(s + GAP16_BLOCK, entries)
        lo = shuffled[s:e]  # indexed from 0: vectorised
        hi = shuffled[entries + s : entries + e]
        advance = np.int64(0)
        listed = np.int64(0)
        for i in range(e - s):
            v = np.int64(lo[i]) | (np.int64(hi[i]) << 8)
            z = np.int64(v == 0)
            advance += v + z * 65535
            listed += 1 - z
        pos += advance
        k += listed
    starts[nblocks, 0] = pos
    starts[nblocks, 1] = k
    if k != changed:
        return np.int64(GAP16_COUNT), k, starts
    if entries and shuffled[entries - 1] == 0 and shuffled[2 * entries - 1] == 0:
        return np.int64(GAP16_TRAILING), pos, starts
    if k and pos >= numel:
        return np.int64(GAP16_RANGE), pos, starts
    zero = np.int64(0)
    if width == 2:
        vlo = planes[:changed]
        vhi = planes[changed : 2 * changed]
        for i in range(changed):
            zero += np.int64((vlo[i] | vhi[i]) == 0)
    else:
        for i in range(changed):
            any_bit = np.uint8(0)
            for j in range(width):
                any_bit |= planes[j * changed + i]
            zero += np.int64(any_bit == 0)
    if zero:
        return np.int64(GAP16_ZERO_VALUE), zero, starts
    return np.int64(GAP16_OK), k, starts


@_jit
def _shuffle_bytes(x: np.ndarray) -> np.ndarray:
    """Byte ``k`` of every element, for k = 0 .. width-1 (little-endian), concatenated."""
    n = x.size
    w = x.itemsize
    out = np.empty(n * w, np.uint8)
    if w == 2:  # bf16/fp16 bits: a loop the compiler vectorises (the general one runs several times slower)
        for i in range(n):
            out[i] = np.uint8(x[i] & 0xFF)
            out[n + i] = np.uint8((x[i] >> 8) & 0xFF)
        return out
    for i in range(n):
        v = np.uint64(x[i])
        for k in range(w):
            out[k * n + i] = np.uint8((v >> np.uint64(8 * k)) & np.uint64(0xFF))
    return out


@_jit
def _unshuffle_bytes(data: np.ndarray, out: np.ndarray) -> None:
    """Inverse of ``shuffle_bytes`` into ``out`` (unsigned, ``data.size == out.size * width``)."""
    n = out.size
    w = out.itemsize
    if w == 2:  # bf16/fp16 bits: a loop the compiler vectorises (the general one runs ~10x slower)
        for i in range(n):
            out[i] = np.uint16(data[i]) | (np.uint16(data[n + i]) << np.uint16(8))
        return
    if w == 4:
        for i in range(n):
            out[i] = (np.uint32(data[i]) | (np.uint32(data[n + i]) << np.uint32(8))
                      | (np.uint32(data[2 * n + i]) << np.uint32(16)) | (np.uint32(data[3 * n + i]) << np.uint32(24)))
        return
    for i in range(n):
        v = np.uint64(0)
        for k in range(w):
            v |= np.uint64(data[k * n + i]) << np.uint64(8 * k)
        out[i] = v


def shuffle_bytes(x: np.ndarray) -> np.ndarray:
    """See ``_shuffle_bytes``."""
    return _shuffle_bytes(_ro(x))


def unshuffle_bytes(data: np.ndarray, out: np.ndarray) -> None:
    """See ``_unshuffle_bytes``."""
    _unshuffle_bytes(_ro(data), out)


def gap16_decode(shuffled: np.ndarray, max_count: int) -> np.ndarray:
    """See ``_gap16_decode``."""
    return _gap16_decode(_ro(shuffled), max_count)


def gap16_check(shuffled: np.ndarray, planes: np.ndarray, width: int, changed: int,
                numel: int) -> tuple[int, int, np.ndarray]:
    """See ``_gap16_check`` (``planes``: the values' bytes, byte-shuffled, ``changed * width`` of them)."""
    status, detail, starts = _gap16_check(_ro(shuffled), _ro(planes), width, changed, numel)
    return int(status), int(detail), starts
