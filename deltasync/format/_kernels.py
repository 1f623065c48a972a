"""Compiled CPU kernels for the hot loops (numba).

Plain torch on CPU needs several full passes and temporaries per tensor (compare, nonzero, gather): about
15x the time of a memcpy. These kernels make one read-only pass to count and one pass to gather, skip
unchanged 8-byte words, and fold the checksum update into the gather. All arrays are unsigned integer
views of the tensors' bits; indices are int64. Callers live in ``diff.py``, ``checksum.py`` and ``apply.py``.
"""

from __future__ import annotations

import sys

import numba
import numpy as np


def _shield_llvmlite() -> None:
    """Let a vLLM engine start after numba (hence llvmlite) was imported in the same process.

    vLLM 0.32's CPU start-up scans every module namespace and calls ``vars(x).get(...)`` on anything with a
    ``__dict__``; llvmlite's library proxy answers any attribute (``__dict__`` included) with a function
    wrapper, and the engine dies with "'_lib_fn_wrapper' object has no attribute 'get'". An empty
    ``__dict__`` entry is harmless to llvmlite.
    """
    ffi = sys.modules.get("llvmlite.binding.ffi")
    table = getattr(getattr(ffi, "lib", None), "_fntab", None)
    if isinstance(table, dict):
        table.setdefault("__dict__", {})


_shield_llvmlite()

_BLOCK = 1 << 15  # elements (or words) per parallel work item
_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)
_S30 = np.uint64(30)
_S27 = np.uint64(27)
_S31 = np.uint64(31)

_jit = numba.njit(cache=True, nogil=True, boundscheck=False)
_pjit = numba.njit(cache=True, nogil=True, boundscheck=False, parallel=True)


@_jit
def mix64(z: np.uint64) -> np.uint64:
    z = z ^ (z >> _S30)
    z = z * _M1
    z = z ^ (z >> _S27)
    z = z * _M2
    return z ^ (z >> _S31)


@_jit
def element_hash(index: np.int64, bits: np.uint64) -> np.uint64:
    return mix64(np.uint64(bits) ^ mix64(np.uint64(index)))


@_pjit
def checksum_range(u: np.ndarray, base: np.int64) -> np.uint64:
    """Checksum of contiguous elements whose first global flat index is ``base``."""
    nblocks = (u.size + _BLOCK - 1) // _BLOCK
    parts = np.zeros(nblocks, np.uint64)
    for k in numba.prange(nblocks):
        s = k * _BLOCK
        e = min(s + _BLOCK, u.size)
        acc = np.uint64(0)
        for i in range(s, e):
            acc += element_hash(base + i, np.uint64(u[i]))
        parts[k] = acc
    total = np.uint64(0)
    for k in range(nblocks):
        total += parts[k]
    return total


@_jit
def checksum_at(u: np.ndarray, indices: np.ndarray) -> np.uint64:
    """Checksum of elements ``u[k]`` that sit at global flat indices ``indices[k]``."""
    acc = np.uint64(0)
    for k in range(u.size):
        acc += element_hash(indices[k], np.uint64(u[k]))
    return acc


@_pjit
def diff_scan(
    aw: np.ndarray,
    bw: np.ndarray,
    a: np.ndarray,
    b: np.ndarray,
    group: np.int64,
    block_words: np.int64,
    first_block: np.int64,
    nblocks: np.int64,
    base: np.int64,
    scratch_pos: np.ndarray,
    scratch_xor: np.ndarray,
    counts: np.ndarray,
    sums: np.ndarray,
) -> None:
    """One read pass over blocks ``first_block .. first_block + nblocks`` of ``a`` vs ``b``.

    ``aw``/``bw`` are 8-byte word views of ``a``/``b`` holding ``group`` elements each (or the element
    arrays themselves with ``group == 1``), so an unchanged word costs one compare. ``a``/``b`` may be a
    slice of a tensor (its word-aligned body, its tail, a host chunk) whose first element sits at global
    flat index ``base``. Block ``k`` writes its changed elements' global indices and ``a ^ b`` to its own
    scratch region (``block_words * group`` entries), its count to ``counts`` and its checksum change
    (hashed with the global indices, as the format defines) to ``sums``; it also sets ``b = a`` where they
    differ.
    """
    stride = block_words * group
    for kk in numba.prange(nblocks):
        s = (first_block + kk) * block_words
        e = min(s + block_words, aw.size)
        out = kk * stride
        c = 0
        acc = np.uint64(0)
        i = s
        while i < e:
            # skip 4 unchanged words with one branch (most of them, at RL densities)
            if i + 4 <= e and ((aw[i] ^ bw[i]) | (aw[i + 1] ^ bw[i + 1]) | (aw[i + 2] ^ bw[i + 2]) | (aw[i + 3] ^ bw[i + 3])) == 0:
                i += 4
                continue
            if aw[i] != bw[i]:
                for j in range(i * group, i * group + group):
                    x = a[j]
                    y = b[j]
                    if x != y:
                        g = base + j
                        scratch_pos[out + c] = g
                        scratch_xor[out + c] = x ^ y
                        acc += element_hash(g, np.uint64(x)) - element_hash(g, np.uint64(y))
                        b[j] = x
                        c += 1
            i += 1
        counts[kk] = c
        sums[kk] = acc


@_jit
def compact(
    scratch_pos: np.ndarray, scratch_xor: np.ndarray, counts: np.ndarray, stride: np.int64,
    out_pos: np.ndarray, out_xor: np.ndarray,
) -> None:
    """Gather the blocks' scratch regions (global positions already) into contiguous outputs."""
    p = 0
    for kk in range(counts.size):
        src = kk * stride
        for i in range(counts[kk]):
            out_pos[p] = scratch_pos[src + i]
            out_xor[p] = scratch_xor[src + i]
            p += 1


@_jit
def gap16_encode(positions: np.ndarray) -> np.ndarray:
    """The ``gap16`` entries of sorted positions, already byte-shuffled (all low bytes, then high bytes)."""
    n = positions.size
    entries = 0
    prev = -1
    for i in range(n):
        entries += (positions[i] - prev - 1) // 65535 + 1
        prev = positions[i]
    out = np.empty(2 * entries, np.uint8)
    e = 0
    prev = -1
    for i in range(n):
        gap = positions[i] - prev
        while gap > 65535:
            out[e] = 0
            out[entries + e] = 0
            e += 1
            gap -= 65535
        out[e] = gap & 0xFF
        out[entries + e] = gap >> 8
        e += 1
        prev = positions[i]
    return out


@_jit
def gap16_decode(shuffled: np.ndarray, max_count: np.int64) -> np.ndarray:
    """Sorted positions from byte-shuffled ``gap16`` entries; at most ``max_count`` (more returns -1 marker)."""
    entries = shuffled.size // 2
    count = 0
    for e in range(entries):
        if shuffled[e] != 0 or shuffled[entries + e] != 0:
            count += 1
    if count > max_count:
        return np.full(1, -1, np.int64)
    out = np.empty(count, np.int64)
    pos = np.int64(-1)
    k = 0
    for e in range(entries):
        v = np.int64(shuffled[e]) | (np.int64(shuffled[entries + e]) << 8)
        if v == 0:
            pos += 65535
        else:
            pos += v
            out[k] = pos
            k += 1
    return out


@_jit
def shuffle_bytes(x: np.ndarray) -> np.ndarray:
    """Byte ``k`` of every element, for k = 0 .. width-1 (little-endian), concatenated."""
    n = x.size
    w = x.itemsize
    out = np.empty(n * w, np.uint8)
    for i in range(n):
        v = np.uint64(x[i])
        for k in range(w):
            out[k * n + i] = np.uint8((v >> np.uint64(8 * k)) & np.uint64(0xFF))
    return out


@_jit
def unshuffle_bytes(data: np.ndarray, out: np.ndarray) -> None:
    """Inverse of ``shuffle_bytes`` into ``out`` (unsigned, ``data.size == out.size * width``)."""
    n = out.size
    w = out.itemsize
    for i in range(n):
        v = np.uint64(0)
        for k in range(w):
            v |= np.uint64(data[k * n + i]) << np.uint64(8 * k)
        out[i] = v


@_pjit
def xor_at(u: np.ndarray, positions: np.ndarray, xor: np.ndarray) -> np.uint64:
    """``u[positions] ^= xor`` in place; returns the change of the checksum of ``u``.

    Positions must be in range (callers validate first, so that bad input changes nothing).
    """
    n = positions.size
    nblocks = (n + _BLOCK - 1) // _BLOCK
    parts = np.zeros(nblocks, np.uint64)
    for k in numba.prange(nblocks):
        s = k * _BLOCK
        e = min(s + _BLOCK, n)
        acc = np.uint64(0)
        for i in range(s, e):
            g = positions[i]
            old = u[g]
            new = old ^ xor[i]
            u[g] = new
            acc += element_hash(g, np.uint64(new)) - element_hash(g, np.uint64(old))
        parts[k] = acc
    total = np.uint64(0)
    for k in range(nblocks):
        total += parts[k]
    return total


@_pjit
def xor_at_indexed(u: np.ndarray, local: np.ndarray, xor: np.ndarray, hashed: np.ndarray, old_out: np.ndarray) -> np.uint64:
    """``u[local] ^= xor``, keeping the old bits in ``old_out``; returns the checksum change hashed with the
    elements' global indices ``hashed`` (a slice of a larger tensor: a fused or sharded parameter).

    The new bits are read back from ``u`` after the write, so the checksum follows what landed.
    """
    n = local.size
    nblocks = (n + _BLOCK - 1) // _BLOCK
    parts = np.zeros(nblocks, np.uint64)
    for k in numba.prange(nblocks):
        s = k * _BLOCK
        e = min(s + _BLOCK, n)
        acc = np.uint64(0)
        for i in range(s, e):
            g = local[i]
            old = u[g]
            old_out[i] = old
            u[g] = old ^ xor[i]
            acc += element_hash(hashed[i], np.uint64(u[g])) - element_hash(hashed[i], np.uint64(old))
        parts[k] = acc
    total = np.uint64(0)
    for k in range(nblocks):
        total += parts[k]
    return total


@_pjit
def xor_dense(u: np.ndarray, xor: np.ndarray, base: np.int64) -> np.uint64:
    """``u ^= xor`` for a whole (chunk of a) tensor; returns the change of the checksum."""
    nblocks = (u.size + _BLOCK - 1) // _BLOCK
    parts = np.zeros(nblocks, np.uint64)
    for k in numba.prange(nblocks):
        s = k * _BLOCK
        e = min(s + _BLOCK, u.size)
        acc = np.uint64(0)
        for i in range(s, e):
            x = xor[i]
            if x != 0:
                old = u[i]
                new = old ^ x
                u[i] = new
                acc += element_hash(base + i, np.uint64(new)) - element_hash(base + i, np.uint64(old))
        parts[k] = acc
    total = np.uint64(0)
    for k in range(nblocks):
        total += parts[k]
    return total


@_jit
def xor_plain_at(u: np.ndarray, positions: np.ndarray, xor: np.ndarray) -> None:
    """``u[positions] ^= xor`` in place, without a checksum update (replay checks the result once, in full).

    Positions must be in range (callers validate first).
    """
    for i in range(positions.size):
        u[positions[i]] ^= xor[i]


BLOCK = _BLOCK
