"""Compiled CPU kernels for the hot loops (numba).

Plain torch on CPU needs several full passes and temporaries per tensor (compare, nonzero, gather): about
15x the time of a memcpy. These kernels make one read-only pass to count and one pass to gather, skip
unchanged 8-byte words, and fold the checksum update into the gather. All arrays are unsigned integer
views of the tensors' bits; indices are int64. Callers live in ``diff.py``, ``checksum.py`` and ``apply.py``.
"""

from __future__ import annotations

import numba
import numpy as np

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
def diff_count(aw: np.ndarray, bw: np.ndarray, a: np.ndarray, b: np.ndarray, group: np.int64) -> np.ndarray:
    """Per block, the number of elements of ``a`` that differ from ``b``.

    ``aw``/``bw`` are 8-byte word views of ``a``/``b`` holding ``group`` elements each (or the element arrays
    themselves with ``group == 1``), so that equal words are skipped with one compare.
    """
    nblocks = (aw.size + _BLOCK - 1) // _BLOCK
    counts = np.zeros(nblocks, np.int64)
    for k in numba.prange(nblocks):
        s = k * _BLOCK
        e = min(s + _BLOCK, aw.size)
        c = 0
        for i in range(s, e):
            if aw[i] != bw[i]:
                for j in range(i * group, i * group + group):
                    if a[j] != b[j]:
                        c += 1
        counts[k] = c
    return counts


@_pjit
def diff_gather(
    aw: np.ndarray,
    bw: np.ndarray,
    a: np.ndarray,
    b: np.ndarray,
    group: np.int64,
    base: np.int64,
    offsets: np.ndarray,
    positions: np.ndarray,
    xor: np.ndarray,
) -> np.uint64:
    """Write changed positions (``base`` + local index) and ``a ^ b`` there, set ``b = a`` there.

    Returns the change of the checksum of ``b`` (new minus old, mod 2^64).
    """
    nblocks = offsets.size - 1
    parts = np.zeros(nblocks, np.uint64)
    for k in numba.prange(nblocks):
        s = k * _BLOCK
        e = min(s + _BLOCK, aw.size)
        p = offsets[k]
        acc = np.uint64(0)
        for i in range(s, e):
            if aw[i] != bw[i]:
                for j in range(i * group, i * group + group):
                    x = a[j]
                    y = b[j]
                    if x != y:
                        g = base + j
                        positions[p] = g
                        xor[p] = x ^ y
                        acc += element_hash(g, np.uint64(x)) - element_hash(g, np.uint64(y))
                        b[j] = x
                        p += 1
        parts[k] = acc
    total = np.uint64(0)
    for k in range(nblocks):
        total += parts[k]
    return total


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


BLOCK = _BLOCK
