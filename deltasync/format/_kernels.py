"""Compiled CPU kernels for the hot loops (numba).

Plain torch on CPU needs several full passes and temporaries per tensor (compare, nonzero, gather): about
15x the time of a memcpy. These kernels make one read-only pass to count and one pass to gather, skip
unchanged 8-byte words, and fold the checksum update into the gather. All arrays are unsigned integer
views of the tensors' bits; indices are int64. Callers live in ``diff.py``, ``checksum.py`` and ``apply.py``;
the byte codecs' kernels (gap16, byte shuffling) are in :mod:`deltasync.format._byte_kernels`, loaded and
warmed with these.
"""

from __future__ import annotations

import sys
import time
import types
from collections.abc import Callable, Iterable
from typing import Any

import numba
import numpy as np
from numba.cpython.unsafe.numbers import trailing_zeros

from deltasync.format import _byte_kernels, _simd
from deltasync.format._byte_kernels import GAP16_BLOCK
from deltasync.format._kernel_cache import cache_dir
from deltasync.format._kernel_cache import jit as _jit
from deltasync.format._kernel_cache import pjit as _pjit
from deltasync.format._kernel_cache import read_only as _ro


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
_RUN = 1 << 12  # positions scattered before they are hashed (their old bits stay in L1)
_DIFF_RUN = 1 << 10  # words the diff compares, marks and lists at once (both runs' 16 KiB stay in L1)
_UNTIL_RUN = 1 << 9  # entries decoded at once by ``_gap16_xor_until`` (one run is decoded twice per call)
_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)
_S30 = np.uint64(30)
_S27 = np.uint64(27)
_S31 = np.uint64(31)

PARALLEL_MIN_ELEMENTS = 1 << 21
"""Below this many elements (or patched positions) a kernel runs on the calling thread alone.

numba's parallel kernels end in a barrier: when another process holds a core, a kernel split across every
core waits for it, and a small tensor's work is far shorter than that wait (up to 20x slower under load).
Callers get parallelism across tensors instead (``deltasync.threads.parallel_map``)."""

def _serial_twin(fn: Callable[..., Any]) -> Any:
    """A single-threaded compilation of a ``prange`` kernel (``prange`` runs as ``range``).

    The twin has its own qualified name, so numba's on-disk cache keeps the two compilations apart.
    """
    twin = types.FunctionType(fn.__code__, fn.__globals__, fn.__name__ + "_serial", fn.__defaults__, fn.__closure__)
    twin.__qualname__ = fn.__qualname__ + "_serial"
    twin.__doc__ = fn.__doc__
    return _jit(twin)


def _pick(serial: Any, parallel: Any, size: int, want: bool | None) -> Any:
    """The parallel kernel for large work (or when asked), else the serial one."""
    return parallel if (size >= PARALLEL_MIN_ELEMENTS if want is None else want) else serial


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


def _checksum_range(u: np.ndarray, base: np.int64) -> np.uint64:
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


@_jit
def _lanes(ra: np.ndarray, rb: np.ndarray, changed: np.ndarray, nc: np.int64, g0: np.int64, group: np.int64,
           scratch_pos: np.ndarray, scratch_xor: np.ndarray, out: np.int64, c: np.int64) -> np.int64:
    """For the changed words ``changed[:nc]`` of a run (``ra`` new, ``rb`` the snapshot, set here), every lane
    written to the scratch at ``out + c`` with its global index (``g0``: the run's first element), counted
    when it changed: no branch per lane. Called with ``group`` a literal: LLVM inlines it and unrolls the lanes."""
    bits = 64 // group
    lane_mask = ~np.uint64(0) >> np.uint64(64 - bits)
    for q in range(nc):
        i = changed[q]
        wa = ra[i]
        d = np.uint64(wa ^ rb[i])
        rb[i] = wa
        g = g0 + i * group
        for t in range(group):
            lane = (d >> np.uint64(t * bits)) & lane_mask
            scratch_pos[out + c] = g + t
            scratch_xor[out + c] = lane
            c += lane != 0
    return c


@_jit
def _differs(ra: np.ndarray, rb: np.ndarray) -> bool:
    """Whether two equally long runs of words differ anywhere: an OR of XORs with no branch and no write (the
    diff kernels' test of a run before they look for its changes)."""
    d = np.uint64(0)
    for k in range(ra.size):
        d |= np.uint64(ra[k] ^ rb[k])
    return d != 0


@_jit
def _block_totals(counts: np.ndarray, sums: np.ndarray, nblocks: np.int64) -> tuple[np.int64, np.uint64]:
    """The diff kernels' result: changed elements and checksum change, summed over their blocks."""
    total = np.int64(0)
    delta = np.uint64(0)
    for kk in range(nblocks):
        total += counts[kk]
        delta += sums[kk]
    return total, delta


def _diff_scan(
    aw: np.ndarray,
    bw: np.ndarray,
    a: np.ndarray,
    group: np.int64,
    block_words: np.int64,
    first_block: np.int64,
    nblocks: np.int64,
    base: np.int64,
    scratch_pos: np.ndarray,
    scratch_xor: np.ndarray,
    counts: np.ndarray,
    sums: np.ndarray,
) -> tuple[np.int64, np.uint64]:
    """One read pass over blocks ``first_block .. first_block + nblocks`` of ``a`` (new) vs the snapshot.

    ``aw``/``bw`` are 8-byte word views of ``a``/the snapshot holding ``group`` elements each (or the element
    arrays themselves with ``group == 1``), so an unchanged word costs one compare. ``a`` may be a
    slice of a tensor (its word-aligned body, its tail, a host chunk) whose first element sits at global
    flat index ``base``. Block ``k`` writes its changed elements' global indices and ``a ^ b`` to its own
    scratch region (``block_words * group`` entries), its count to ``counts`` and its checksum change
    (hashed with the global indices, as the format defines) to ``sums``; it also sets ``bw = aw`` where they
    differ. Returns the changed elements' count and the checksum change, summed over the blocks.

    Per run of ``_DIFF_RUN`` words: a pure compare (an OR of XORs, no writes) skips an unchanged run at the cost of
    reading it; in a changed run a second pass, over words now in cache, marks the changed words; a sparse run
    (under 1 word in 32)
    visits the marks 8 at a time and only the set ones; a denser run first lists its changed words without
    a branch per word. Each changed word then yields all its lanes without a branch (a lane that did not
    change is written and not counted), and the checksum change is hashed in a last pass over the block's
    changes while they are in cache. At 2% density this does ~20% less work per change than testing each
    word and element in turn (mispredicted branches were most of the time), and ~40% less at 5%.
    """
    stride = block_words * group
    for kk in numba.prange(nblocks):
        marks = np.zeros(_DIFF_RUN, np.uint8)
        marks8 = marks.view(np.uint64)
        changed = np.empty(_DIFF_RUN, np.int64)
        s = (first_block + kk) * block_words
        e = min(s + block_words, aw.size)
        out = kk * stride
        c = 0
        for r in range(s, e, _DIFF_RUN):
            n = min(r + _DIFF_RUN, e) - r
            ra = aw[r : r + n]  # indexed from 0: vectorised (an index ``r + k`` might wrap, and that check stops it)
            rb = bw[r : r + n]
            if not _differs(ra, rb):  # the common case: a pure read, no writes
                continue
            nz = 0
            for k in range(n):
                f = np.uint8(ra[k] != rb[k])
                marks[k] = f
                nz += f
            if nz * 32 < n:  # sparse: visit set marks only
                marks[n:] = 0
                nc = 0
                for q in range((n + 7) // 8):
                    m = marks8[q]
                    while m != 0:
                        changed[nc] = q * 8 + (trailing_zeros(m) >> 3)
                        nc += 1
                        m &= m - np.uint64(1)
            else:  # dense: list the changed words without a branch per word
                nc = 0
                for k in range(n):
                    changed[nc] = k
                    nc += marks[k]
            g0 = base + r * group
            # the lanes' loop with its width a constant (unrolled: ~8% of the kernel at 2% density)
            if group == 4:
                c = _lanes(ra, rb, changed, nc, g0, 4, scratch_pos, scratch_xor, out, c)
            elif group == 2:
                c = _lanes(ra, rb, changed, nc, g0, 2, scratch_pos, scratch_xor, out, c)
            elif group == 8:
                c = _lanes(ra, rb, changed, nc, g0, 8, scratch_pos, scratch_xor, out, c)
            else:
                c = _lanes(ra, rb, changed, nc, g0, 1, scratch_pos, scratch_xor, out, c)
        acc = np.uint64(0)
        for k in range(out, out + c):
            g = scratch_pos[k]
            m = mix64(np.uint64(g))
            x = np.uint64(a[g - base])
            acc += mix64(x ^ m) - mix64((x ^ np.uint64(scratch_xor[k])) ^ m)
        counts[kk] = c
        sums[kk] = acc
    return _block_totals(counts, sums, nblocks)



def _diff_scan16(
    aw: np.ndarray,
    bw: np.ndarray,
    a: np.ndarray,
    b: np.ndarray,
    block_words: np.int64,
    first_block: np.int64,
    nblocks: np.int64,
    base: np.int64,
    scratch_pos: np.ndarray,
    scratch_xor: np.ndarray,
    counts: np.ndarray,
    sums: np.ndarray,
) -> tuple[np.int64, np.uint64]:
    """``_diff_scan`` for 2-byte elements (four to a word) on a CPU with ``_simd.COMPRESS16``; ``b`` is ``bw``'s
    elements. Same outputs, bit for bit (tests/test_simd.py holds the two together).

    A run whose words all match is skipped after the same pure compare; in a changed run every 32 elements are
    compared at once and their changed lanes compressed into L1 buffers (values, run-relative indices, new bits)
    with no branch per word or lane, the snapshot written in the changed lanes only; the run's changes are then
    widened to global positions and hashed from those contiguous buffers (a loop the compiler vectorises, where
    ``_diff_scan`` gathers each new value back from the tensor).
    """
    stride = block_words * 4
    lanes = _simd.LANES
    for kk in numba.prange(nblocks):
        rx = np.empty(_DIFF_RUN * 4 + lanes, np.uint16)  # each compressed store writes a whole register
        ri = np.empty(_DIFF_RUN * 4 + lanes, np.uint16)
        rn = np.empty(_DIFF_RUN * 4 + lanes, np.uint16)
        s = (first_block + kk) * block_words
        e = min(s + block_words, aw.size)
        out = kk * stride
        c = 0
        acc = np.uint64(0)
        for r in range(s, e, _DIFF_RUN):
            n = min(r + _DIFF_RUN, e) - r
            ra = aw[r : r + n]
            rb = bw[r : r + n]
            if not _differs(ra, rb):
                continue
            e0 = r * 4
            ne = n * 4
            body = ne - ne % lanes
            cnt = 0
            for o in range(0, body, lanes):
                cnt += _simd.compress16(a, b, rx, ri, rn, cnt, e0 + o, o)
            for o in range(body, ne):  # the run's last elements short of a register
                x = a[e0 + o] ^ b[e0 + o]
                if x != 0:
                    rx[cnt] = x
                    ri[cnt] = o
                    rn[cnt] = a[e0 + o]
                    b[e0 + o] = a[e0 + o]
                    cnt += 1
            g0 = base + e0
            for j in range(cnt):
                scratch_pos[out + c + j] = g0 + np.int64(ri[j])
                scratch_xor[out + c + j] = rx[j]
            for j in range(cnt):
                m = mix64(np.uint64(g0 + np.int64(ri[j])))
                x = np.uint64(rn[j])
                acc += mix64(x ^ m) - mix64((x ^ np.uint64(rx[j])) ^ m)
            c += cnt
        counts[kk] = c
        sums[kk] = acc
    return _block_totals(counts, sums, nblocks)

@_jit
def _span(positions: np.ndarray) -> tuple[np.int64, np.int64]:
    """The smallest and largest of non-empty ``positions`` in one pass (NumPy's ``min`` and ``max`` take two)."""
    lo = positions[0]
    hi = positions[0]
    for i in range(1, positions.size):
        v = positions[i]
        lo = min(lo, v)
        hi = max(hi, v)
    return lo, hi


@_jit
def compact(
    scratch_pos: np.ndarray, scratch_xor: np.ndarray, counts: np.ndarray, stride: np.int64,
    out_pos: np.ndarray, out_xor: np.ndarray,
) -> None:
    """Gather the blocks' scratch regions (global positions already) into contiguous outputs."""
    p = 0
    for kk in range(counts.size):
        src = kk * stride
        n = counts[kk]
        out_pos[p : p + n] = scratch_pos[src : src + n]  # slices: copied as memcpy does, not element by element
        out_xor[p : p + n] = scratch_xor[src : src + n]
        p += n


def _xor_at(u: np.ndarray, positions: np.ndarray, xor: np.ndarray) -> np.uint64:
    """``u[positions] ^= xor`` in place; returns the change of the checksum of ``u``.

    Positions must be in range (callers validate first, so that bad input changes nothing). Each run of
    ``_RUN`` positions is scattered first (keeping the old bits), then hashed in a second, branch-free pass
    over arrays in cache: the hashes then overlap instead of waiting on each scattered load (~25% faster at
    2% density). Old bits are taken in order, so a repeated position still adds up to what landed.
    """
    n = positions.size
    nblocks = (n + _BLOCK - 1) // _BLOCK
    parts = np.zeros(nblocks, np.uint64)
    for k in numba.prange(nblocks):
        old = np.empty(_RUN, u.dtype)
        acc = np.uint64(0)
        for s in range(k * _BLOCK, min(k * _BLOCK + _BLOCK, n), _RUN):
            e = min(s + _RUN, n)
            for i in range(s, e):
                g = positions[i]
                o = u[g]
                old[i - s] = o
                u[g] = o ^ xor[i]
            acc += _hash_change(positions[s:e], old, xor[s:e])
        parts[k] = acc
    total = np.uint64(0)
    for k in range(nblocks):
        total += parts[k]
    return total


@_jit
def _hash_change(hashed: np.ndarray, old: np.ndarray, xor: np.ndarray) -> np.uint64:
    """Checksum change of elements at global indices ``hashed`` going from ``old`` to ``old ^ xor``."""
    acc = np.uint64(0)
    for i in range(hashed.size):
        m = mix64(np.uint64(hashed[i]))
        o = np.uint64(old[i])
        acc += mix64((o ^ np.uint64(xor[i])) ^ m) - mix64(o ^ m)
    return acc


def _xor_at_indexed(u: np.ndarray, local: np.ndarray, xor: np.ndarray, hashed: np.ndarray,
                    old_out: np.ndarray) -> np.uint64:
    """``u[local] ^= xor``, keeping the old bits in ``old_out``; returns the checksum change hashed with the
    elements' global indices ``hashed`` (a slice of a larger tensor: a fused or sharded parameter).

    Scatter, then hash from the kept old bits (as ``_xor_at``): a repeated position adds up to what landed.
    """
    n = local.size
    nblocks = (n + _BLOCK - 1) // _BLOCK
    parts = np.zeros(nblocks, np.uint64)
    for k in numba.prange(nblocks):
        s = k * _BLOCK
        e = min(s + _BLOCK, n)
        for i in range(s, e):
            g = local[i]
            o = u[g]
            old_out[i] = o
            u[g] = o ^ xor[i]
        parts[k] = _hash_change(hashed[s:e], old_out[s:e], xor[s:e])
    total = np.uint64(0)
    for k in range(nblocks):
        total += parts[k]
    return total


def _change_at(u: np.ndarray, local: np.ndarray, xor: np.ndarray, hashed: np.ndarray) -> np.uint64:
    """The checksum change that ``u[local] ^= xor`` would make, hashed with the global indices ``hashed``;
    writes nothing. An engine seals a staged step with it before the pause: one pass gathering the old bits a
    run at a time, hashed from cache (``_xor_at``'s shape without the writes). Positions must be in range."""
    n = local.size
    nblocks = (n + _BLOCK - 1) // _BLOCK
    parts = np.zeros(nblocks, np.uint64)
    for k in numba.prange(nblocks):
        old = np.empty(_RUN, u.dtype)
        acc = np.uint64(0)
        for s in range(k * _BLOCK, min(k * _BLOCK + _BLOCK, n), _RUN):
            e = min(s + _RUN, n)
            for i in range(s, e):
                old[i - s] = u[local[i]]
            acc += _hash_change(hashed[s:e], old, xor[s:e])
        parts[k] = acc
    total = np.uint64(0)
    for k in range(nblocks):
        total += parts[k]
    return total


@_jit
def _gather_values(planes: np.ndarray, count: np.int64, k: np.int64, r: np.int64, xs: np.ndarray) -> None:
    """``xs[:r]`` = values ``k .. k + r`` of byte-shuffled ``planes`` (byte ``j`` of value ``i`` at ``j * count + i``),
    plane by plane: each loop is vectorised (the element width is not a constant here). The ``gap16`` scatters'
    one way to build values; compiled into them."""
    low = planes[k : k + r]
    for i in range(r):
        xs[i] = low[i]
    for j in range(1, xs.itemsize):
        plane = planes[j * count + k : j * count + k + r]
        for i in range(r):
            xs[i] |= xs.dtype.type(plane[i]) << (8 * j)


def _gap16_xor(u: np.ndarray, shuffled: np.ndarray, planes: np.ndarray, starts: np.ndarray, base: np.int64,
               checksum: bool) -> np.uint64:
    """``u.flat[p] ^= x`` for each position ``p`` the ``gap16`` entries list and its value ``x``, decoded as they are
    scattered: no positions array is written or read back (docs/FORMAT.md section 3). Returns the change of the
    checksum of ``u``, each element hashed with ``base + p`` (``base``: the global index of ``u``'s first element,
    a part's start), or 0 without ``checksum``.

    ``shuffled``: byte-shuffled ``gap16`` entries; ``planes``: the values' bytes, byte-shuffled (byte ``j`` of value
    ``k`` at ``j * count + k``); ``starts``: ``gap16_check``'s, which must have passed for ``u.size`` elements
    (every position is then in range: nothing is checked here). Blocks of ``GAP16_BLOCK`` entries are independent
    (``starts`` says where each begins), so a large change splits across threads. Each run of ``_RUN`` entries is
    decoded into positions and values in L1 (branch-free), then scattered keeping the old bits, then hashed from
    L1: three tight loops, the scatter's loads overlapping as ``_xor_at``'s do (one loop doing all three was 1.4x
    slower). A run's positions never leave the cache: nothing positions-sized is written or read back.
    """
    entries = shuffled.size // 2
    width = u.itemsize
    count = planes.size // width
    nblocks = starts.shape[0] - 1
    parts = np.zeros(nblocks, np.uint64)
    for b in numba.prange(nblocks):
        at = np.empty(_RUN, np.int64)
        old = np.empty(_RUN, u.dtype)
        xs = np.empty(_RUN, u.dtype)
        pos = starts[b, 0]
        k = starts[b, 1]
        acc = np.uint64(0)
        first = b * GAP16_BLOCK
        for s in range(first, min(first + GAP16_BLOCK, entries), _RUN):
            n = min(s + _RUN, entries) - s
            lo = shuffled[s : s + n]  # indexed from 0: no wrap check in the loop
            hi = shuffled[entries + s : entries + s + n]
            r = 0
            for i in range(n):  # no branch: an escape (0) advances 65535 and lists nothing (r stays)
                v = np.int64(lo[i]) | (np.int64(hi[i]) << 8)
                z = np.int64(v == 0)
                pos += v + z * 65535
                at[r] = pos
                r += 1 - z
            _gather_values(planes, count, k, r, xs)
            k += r
            for i in range(r):  # the scatter: its loads overlap (each index is already known)
                g = at[i]
                o = u[g]
                old[i] = o
                u[g] = o ^ xs[i]
            if checksum:
                for i in range(r):  # branch-free, from arrays in L1
                    m = mix64(np.uint64(base + at[i]))
                    o = np.uint64(old[i])
                    acc += mix64((o ^ np.uint64(xs[i])) ^ m) - mix64(o ^ m)
        parts[b] = acc
    total = np.uint64(0)
    for b in range(nblocks):
        total += parts[b]
    return total


@_jit
def _gap16_xor_until(u: np.ndarray, shuffled: np.ndarray, planes: np.ndarray, cursor: np.ndarray,
                     stop: np.int64) -> None:
    """``_gap16_xor`` without the checksum, of the entries from ``cursor`` on whose positions are below ``stop``;
    ``cursor`` (int64: next entry, position before it, values before it; ``[0, -1, 0]`` at the start) is left at
    the entry after the last one applied. Replay walks a tensor block by block and gives each block every patch's
    share this way: no positions array, no search for where a block's share begins. Checked entries only
    (``gap16_check``). Runs of ``_UNTIL_RUN`` entries are decoded branch-free into L1 (a loop testing each entry
    against ``stop`` was 1.3x slower than scattering from a positions array); the run that crosses ``stop`` is
    decoded again by the next call, from its first entry not applied."""
    entries = shuffled.size // 2
    width = u.itemsize
    count = planes.size // width
    e = cursor[0]
    pos = cursor[1]
    k = cursor[2]
    at = np.empty(_UNTIL_RUN, np.int64)
    ent = np.empty(_UNTIL_RUN, np.int64)
    xs = np.empty(_UNTIL_RUN, u.dtype)
    while e < entries:
        n = min(_UNTIL_RUN, entries - e)
        lo = shuffled[e : e + n]
        hi = shuffled[entries + e : entries + e + n]
        r = 0
        p = pos
        for i in range(n):
            v = np.int64(lo[i]) | (np.int64(hi[i]) << 8)
            z = np.int64(v == 0)
            p += v + z * 65535
            at[r] = p
            ent[r] = e + i
            r += 1 - z
        m = np.searchsorted(at[:r], stop)  # positions ascend: those below ``stop`` come first
        _gather_values(planes, count, k, m, xs)
        for i in range(m):
            u[at[i]] ^= xs[i]
        k += m
        if m < r:  # stopped inside this run: the next call starts after the last entry applied
            if m:
                e = ent[m - 1] + 1
                pos = at[m - 1]
            break
        e += n
        pos = p
    cursor[0] = e
    cursor[1] = pos
    cursor[2] = k


def _xor_dense(u: np.ndarray, xor: np.ndarray, base: np.int64) -> np.uint64:
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
def _xor_plain_at(u: np.ndarray, positions: np.ndarray, xor: np.ndarray) -> None:
    """``u[positions] ^= xor`` in place, without a checksum update (replay checks the result once, in full).

    Positions must be in range (callers validate first).
    """
    for i in range(positions.size):
        u[positions[i]] ^= xor[i]


_checksum_range_parallel, _checksum_range_serial = _pjit(_checksum_range), _serial_twin(_checksum_range)
_diff_scan_parallel, _diff_scan_serial = _pjit(_diff_scan), _serial_twin(_diff_scan)
_diff_scan16_parallel, _diff_scan16_serial = _pjit(_diff_scan16), _serial_twin(_diff_scan16)
_xor_at_parallel, _xor_at_serial = _pjit(_xor_at), _serial_twin(_xor_at)
_xor_at_indexed_parallel, _xor_at_indexed_serial = _pjit(_xor_at_indexed), _serial_twin(_xor_at_indexed)
_xor_dense_parallel, _xor_dense_serial = _pjit(_xor_dense), _serial_twin(_xor_dense)
_change_at_parallel, _change_at_serial = _pjit(_change_at), _serial_twin(_change_at)
_gap16_xor_parallel, _gap16_xor_serial = _pjit(_gap16_xor), _serial_twin(_gap16_xor)


def checksum_range(u: np.ndarray, base: int, *, parallel: bool | None = None) -> np.uint64:
    """Checksum of contiguous elements whose first global flat index is ``base``.

    ``parallel``: split across numba's threads (None: only from ``PARALLEL_MIN_ELEMENTS`` elements on)."""
    return _pick(_checksum_range_serial, _checksum_range_parallel, u.size, parallel)(u, base)


def diff_scan(aw: np.ndarray, bw: np.ndarray, a: np.ndarray, group: int, block_words: int,
              first_block: int, nblocks: int, base: int, scratch_pos: np.ndarray, scratch_xor: np.ndarray,
              counts: np.ndarray, sums: np.ndarray, *, parallel: bool | None = None) -> tuple[int, int]:
    """See ``_diff_scan`` (``_diff_scan16`` for 2-byte elements in words, where the CPU has AVX-512 VBMI2);
    ``parallel`` as in ``checksum_range`` (sized by the blocks scanned)."""
    size = min(nblocks * block_words, aw.size) * group
    if group == 4 and a.itemsize == 2 and _simd.COMPRESS16:
        return _pick(_diff_scan16_serial, _diff_scan16_parallel, size, parallel)(
            _ro(aw), bw, _ro(a), bw.view(np.uint16), block_words, first_block, nblocks, base, scratch_pos,
            scratch_xor, counts, sums)
    return _pick(_diff_scan_serial, _diff_scan_parallel, size, parallel)(
        _ro(aw), bw, _ro(a), group, block_words, first_block, nblocks, base, scratch_pos, scratch_xor, counts, sums
    )


def xor_at(u: np.ndarray, positions: np.ndarray, xor: np.ndarray, *, parallel: bool | None = None) -> np.uint64:
    """See ``_xor_at``; ``parallel`` as in ``checksum_range`` (sized by the positions)."""
    return _pick(_xor_at_serial, _xor_at_parallel, positions.size, parallel)(u, _ro(positions), _ro(xor))


def xor_at_indexed(u: np.ndarray, local: np.ndarray, xor: np.ndarray, hashed: np.ndarray, old_out: np.ndarray,
                   *, parallel: bool | None = None) -> np.uint64:
    """See ``_xor_at_indexed``; ``parallel`` as in ``checksum_range`` (sized by the positions)."""
    return _pick(_xor_at_indexed_serial, _xor_at_indexed_parallel, local.size, parallel)(u, _ro(local), _ro(xor),
                                                                                         _ro(hashed), old_out)


def change_at(u: np.ndarray, local: np.ndarray, xor: np.ndarray, hashed: np.ndarray,
              *, parallel: bool | None = None) -> np.uint64:
    """See ``_change_at``; ``parallel`` as in ``checksum_range`` (sized by the positions)."""
    return _pick(_change_at_serial, _change_at_parallel, local.size, parallel)(_ro(u), _ro(local), _ro(xor),
                                                                               _ro(hashed))


def gap16_xor(u: np.ndarray, shuffled: np.ndarray, planes: np.ndarray, starts: np.ndarray, base: int, *,
              checksum: bool = True, parallel: bool | None = None) -> np.uint64:
    """See ``_gap16_xor``; ``parallel`` as in ``checksum_range`` (sized by the changes)."""
    size = planes.size // u.itemsize
    return _pick(_gap16_xor_serial, _gap16_xor_parallel, size, parallel)(u, _ro(shuffled), _ro(planes), _ro(starts),
                                                                         base, checksum)


def gap16_xor_until(u: np.ndarray, shuffled: np.ndarray, planes: np.ndarray, cursor: np.ndarray, stop: int) -> None:
    """See ``_gap16_xor_until``."""
    _gap16_xor_until(u, _ro(shuffled), _ro(planes), cursor, stop)


def xor_dense(u: np.ndarray, xor: np.ndarray, base: int, *, parallel: bool | None = None) -> np.uint64:
    """See ``_xor_dense``; ``parallel`` as in ``checksum_range``."""
    return _pick(_xor_dense_serial, _xor_dense_parallel, u.size, parallel)(u, _ro(xor), base)


def xor_plain_at(u: np.ndarray, positions: np.ndarray, xor: np.ndarray) -> None:
    """See ``_xor_plain_at``."""
    _xor_plain_at(u, positions, _ro(xor))


def span(positions: np.ndarray) -> tuple[int, int]:
    """See ``_span`` (int64 positions of any layout; at least one)."""
    lo, hi = _span(_ro(np.ascontiguousarray(positions, dtype=np.int64).reshape(-1)))
    return int(lo), int(hi)


def dispatchers() -> dict[str, Any]:
    """Every kernel of this module that Python calls, by name (what ``warm_kernels`` loads, what tests inspect);
    ``mix64``, ``element_hash``, ``_hash_change``, ``_gather_values``, ``_lanes``, ``_block_totals`` and ``_differs``
    are compiled into the kernels that call them."""
    found = {**globals(), **vars(_byte_kernels)}
    return {name: obj for name, obj in found.items()
            if isinstance(obj, numba.core.registry.CPUDispatcher) and name not in _INLINED}


_INLINED = ("mix64", "element_hash", "_hash_change", "_gather_values", "_lanes", "_block_totals", "_differs")


_UNSIGNED = (np.uint8, np.uint16, np.uint32, np.uint64)


_warmed: set[int] = set()  # element widths whose kernels are loaded, and _COMMON
_COMMON = 0  # the kernels of no element width (positions)
SAY_AFTER_S = 2.0  # a wait longer than this is explained


def warm_kernels(itemsizes: Iterable[int] | None = None, *, explain: bool = True,
                 on_width: Callable[[int, float], None] | None = None) -> None:
    """Compile or load from numba's disk cache every kernel signature deltasync's stages use, on tiny inputs.

    A kernel's first call with a new signature costs a cache load (milliseconds) or a compilation (seconds);
    calling this when a publisher, replica or engine state is created keeps both out of a diff, a decode and
    above all a paused engine's apply. Idempotent and cheap once done (a few hundred microseconds). When it
    takes longer than two seconds (a first use: compiling), it says so on the log and on stderr, once.
    ``deltasync warm`` runs it ahead of time (a container image can build the cache in).

    ``itemsizes``: only the kernels for elements of these byte widths (a bf16 model needs 2; the others are
    never called for it): a first use compiles a quarter of the kernels. None: every width. ``explain=False``:
    no log line (a caller that says what it does itself, as ``deltasync warm`` does); ``on_width(itemsize,
    seconds)`` is called as each width's kernels are ready (0 for the kernels of no width)."""
    want = {np.dtype(t).itemsize for t in _UNSIGNED} if itemsizes is None else set(itemsizes)
    todo = [t for t in _UNSIGNED if np.dtype(t).itemsize in want - _warmed]
    if not todo and _COMMON in _warmed:
        return
    import logging
    import threading

    def say() -> None:
        if not any(d.stats.cache_misses for d in dispatchers().values()):
            return  # only loading from the cache, slowly (a busy machine): nothing to explain
        where = kernel_cache_dir()
        message = (f"deltasync: compiling its CPU kernels (first use in this environment, up to a minute; cached in "
                   f"{where} for later runs; `deltasync warm` does it ahead of time)")
        logging.getLogger(__name__).warning(message)

    timer = threading.Timer(SAY_AFTER_S, say)
    timer.daemon = True
    if explain:
        timer.start()
    try:
        for t in todo:
            t0 = time.perf_counter()
            _warm_width(t)
            _warmed.add(np.dtype(t).itemsize)
            if on_width is not None:
                on_width(np.dtype(t).itemsize, time.perf_counter() - t0)
        if _COMMON not in _warmed:
            t0 = time.perf_counter()
            _warm_common()
            _warmed.add(_COMMON)
            if on_width is not None:
                on_width(_COMMON, time.perf_counter() - t0)
    finally:
        timer.cancel()


def kernel_cache_dir() -> str:
    """Where these kernels' compiled code is kept: a user cache folder that survives reinstalling deltasync
    (``NUMBA_CACHE_DIR`` moves it; :mod:`deltasync.format._kernel_cache`)."""
    return str(cache_dir())


def _warm_width(t: Any) -> None:
    """Every kernel signature for elements of unsigned type ``t``."""
    n = 64
    idx = np.arange(0, n, 3, dtype=np.int64)
    # input-only arrays go to the kernels read-only whatever they were (``_ro``)
    u = np.zeros(n, t)
    x = np.ones(idx.size, t)
    words = np.zeros(n * np.dtype(t).itemsize // 8, np.uint64)
    counts, sums = np.zeros(1, np.int64), np.zeros(1, np.uint64)
    pos, xs = np.empty(n, np.int64), np.empty(n, t)
    entries = _byte_kernels.gap16_encode(idx)
    planes = np.ones(idx.size * u.itemsize, np.uint8)
    _, _, starts = _byte_kernels.gap16_check(entries, planes, u.itemsize, idx.size, n)
    for parallel in (False, True):
        checksum_range(u, 0, parallel=parallel)
        # the word-aligned body (8-byte words) and the tail (elements) of a tensor
        diff_scan(words, words.copy(), u, 8 // u.itemsize, n, 0, 1, 0, pos, xs, counts, sums, parallel=parallel)
        diff_scan(u, u.copy(), u, 1, n, 0, 1, 0, pos, xs, counts, sums, parallel=parallel)
        xor_at(u, idx, x, parallel=parallel)
        xor_at_indexed(u, idx, x, idx, np.empty_like(x), parallel=parallel)
        xor_dense(u, u.copy(), 0, parallel=parallel)
        change_at(u, idx, x, idx, parallel=parallel)
        for checksum in (False, True):
            gap16_xor(u, entries, planes, starts, 0, checksum=checksum, parallel=parallel)
    checksum_at(u, idx)
    gap16_xor_until(u, entries, planes, np.array([0, -1, 0], np.int64), n)
    compact(pos, xs, counts, n, pos.copy(), xs.copy())
    xor_plain_at(u, idx, x)
    _byte_kernels.shuffle_bytes(x)
    _byte_kernels.unshuffle_bytes(np.zeros(n * u.itemsize, np.uint8), np.empty(n, t))


def _warm_common() -> None:
    """The kernels of no element width (positions)."""
    idx = np.arange(0, 64, 3, dtype=np.int64)
    _byte_kernels.gap16_encode(idx)
    _byte_kernels.gap16_decode(np.zeros(8, np.uint8), 4)
    span(idx)


BLOCK = _BLOCK
