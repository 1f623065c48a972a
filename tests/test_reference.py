"""Every path that diffs, checksums or patches bits, against an independent reference of docs/FORMAT.md section 4.

The reference below is written from the format text alone (NumPy uint64 arithmetic wraps mod 2**64) and
imports nothing from deltasync. The kernels read 8-byte words of 1 to 8 elements, in runs of 4096 words (each
run sparse or dense), and split work into blocks of 1 << 15 elements, 64 blocks per call; so sizes and change
positions are exhaustive
where that structure repeats (a period of at most 32 elements, several times over), sampled up to 300, and
placed around the block and call boundaries. Each path is checked the same way: the device paths (host
chunks, torch ops) run here on CPU tensors through the very functions that device tensors take.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

import numba
import numpy as np
import pytest
import safetensors.torch
import torch
from typer.testing import CliRunner

from deltasync import DeltaPublisher, StreamReader
from deltasync.engine import Replica
from deltasync.errors import TensorMismatchError
from deltasync.format import _kernels
from deltasync.format.checksum import (
    _torch_checksum,
    _torch_checksum_at,
    checksum_elements,
    tensor_checksum,
)
from deltasync.format.objects import StepObject
from deltasync.publish.steps import snapshot_headers, write_step
from deltasync.stages.apply import _xor_apply_torch, xor_apply
from deltasync.stages.diff import Snapshot, _diff_host_chunks, _diff_np, _diff_torch, _Scratch
from deltasync_cli import app

# --- the reference: docs/FORMAT.md section 4, nothing else ---

_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)


def ref_mix64(z: np.ndarray) -> np.ndarray:
    z = np.asarray(z, np.uint64)
    z = z ^ (z >> np.uint64(30))
    z = z * _M1
    z = z ^ (z >> np.uint64(27))
    z = z * _M2
    return z ^ (z >> np.uint64(31))


def ref_checksum(bits: np.ndarray, indices: np.ndarray | None = None) -> int:
    """sum over i of mix64(u_i XOR mix64(i)) mod 2**64; ``indices`` are the elements' global flat indices."""
    u = bits.astype(np.uint64)  # zero-extends: bits are unsigned
    i = np.arange(u.size, dtype=np.uint64) if indices is None else np.asarray(indices).astype(np.uint64)
    return int(ref_mix64(u ^ ref_mix64(i)).sum(dtype=np.uint64))


def ref_diff(old: np.ndarray, new: np.ndarray) -> tuple[np.ndarray, np.ndarray, int]:
    """Positions where the bits differ, ``old ^ new`` there, and the checksum after."""
    pos = np.flatnonzero(old != new)
    return pos, (old ^ new)[pos], ref_checksum(new)


def test_reference_is_splitmix64():
    # splitmix64 seeded with 0 yields mix64(k * golden gamma) for k = 1, 2: published test vectors
    gamma = 0x9E3779B97F4A7C15
    z = ref_mix64(np.array([gamma, (2 * gamma) % 2**64], np.uint64))
    assert [int(v) for v in z] == [0xE220A8397B1DCDAF, 0x6E789E6AA1B965F4]
    assert ref_checksum(np.zeros(0, np.uint8)) == 0
    one = int(ref_mix64(np.array([7 ^ int(ref_mix64(np.array([2], np.uint64))[0])], np.uint64))[0])
    assert ref_checksum(np.array([7], np.uint8), [2]) == one


# --- tensors from bits, bits from tensors (no deltasync code) ---

WIDTH_DTYPES: dict[int, list[torch.dtype]] = {
    1: [torch.uint8, torch.bool, torch.float8_e4m3fn, torch.int8],
    2: [torch.bfloat16, torch.float16, torch.int16],
    4: [torch.float32, torch.int32],
    8: [torch.float64, torch.int64],
}
ALL_DTYPES = [d for ds in WIDTH_DTYPES.values() for d in ds]
ONE_PER_WIDTH = [torch.uint8, torch.bfloat16, torch.float32, torch.float64]
UNSIGNED = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}
SIGNED = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def bits_of(t: torch.Tensor) -> np.ndarray:
    w = t.element_size()
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().view(UNSIGNED[w]).copy()


def int_bits(t: torch.Tensor) -> torch.Tensor:
    """The flat signed-integer view (shared memory) that the device paths take."""
    return t.reshape(-1).view(torch.uint8).view(SIGNED[t.element_size()])


def tensor_of(bits: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
    if bits.size == 0:
        return torch.empty(0, dtype=dtype)
    raw = np.ascontiguousarray(bits).view(np.uint8).copy()
    return torch.from_numpy(raw).view(dtype)


def random_bits(n: int, dtype: torch.dtype, rng: np.random.Generator) -> np.ndarray:
    w = torch.empty(0, dtype=dtype).element_size()
    if dtype == torch.bool:
        return rng.integers(0, 2, n).astype(np.uint8)
    return np.frombuffer(rng.bytes(n * w), UNSIGNED[w]).copy()


def changed_bits(old: np.ndarray, positions: Iterable[int], dtype: torch.dtype, rng: np.random.Generator) -> np.ndarray:
    """``old`` with new, different bits at ``positions``."""
    new = old.copy()
    pos = np.fromiter(positions, np.int64)
    if dtype == torch.bool:
        flips = np.ones(pos.size, np.uint8)
    else:
        flips = random_bits(pos.size, dtype, rng)
        flips[flips == 0] = 1
    new[pos] ^= flips
    return new


@dataclass(frozen=True)
class Case:
    name: str
    dtype: torch.dtype
    old: np.ndarray
    new: np.ndarray


def single_change_positions(n: int, exhaustive_up_to: int) -> list[int]:
    """Every position up to ``exhaustive_up_to`` elements; beyond (where the kernels' structure repeats with
    a period of 32), the first, the last 8 (past the last whole word) and a stride of 37, which meets every
    residue mod 32 over the sizes."""
    if n <= exhaustive_up_to:
        return list(range(n))
    return sorted({0, *range(n - 8, n), *range(n % 37, n, 37)})


def single_change_cases(dtype: torch.dtype, sizes: Iterable[int], exhaustive_up_to: int, seed: int) -> list[Case]:
    rng = np.random.default_rng(seed)
    cases = []
    for n in sizes:
        old = random_bits(n, dtype, rng)
        for p in single_change_positions(n, exhaustive_up_to):
            cases.append(Case(f"n{n}.p{p}", dtype, old, changed_bits(old, [p], dtype, rng)))
    return cases


PATTERNS: dict[str, Callable[[int, np.random.Generator], np.ndarray]] = {
    "all": lambda n, rng: np.arange(n),
    "first_last": lambda n, rng: np.unique([0, n - 1]) if n else np.arange(0),
    "tail8": lambda n, rng: np.arange(max(0, n - 8), n),
    "rand25": lambda n, rng: np.flatnonzero(rng.random(n) < 0.25),
    "rand75": lambda n, rng: np.flatnonzero(rng.random(n) < 0.75),
    # RL densities: the diff kernel's sparse (marks visited 8 at a time) and dense (listed) runs, mixed
    "rand2": lambda n, rng: np.flatnonzero(rng.random(n) < 0.02),
    "rand02": lambda n, rng: np.flatnonzero(rng.random(n) < 0.002),
    "none": lambda n, rng: np.arange(0),
}


def pattern_cases(dtype: torch.dtype, sizes: Iterable[int], seed: int) -> list[Case]:
    rng = np.random.default_rng(seed)
    cases = []
    for n in sizes:
        old = random_bits(n, dtype, rng)
        for pattern, where in PATTERNS.items():
            cases.append(Case(f"n{n}.{pattern}", dtype, old, changed_bits(old, where(n, rng), dtype, rng)))
    return cases


def check_diff(case: Case, positions: np.ndarray, xor: np.ndarray, checksum: int, where: str) -> None:
    want_pos, want_xor, want_sum = ref_diff(case.old, case.new)
    label = f"{where} {case.dtype} {case.name}"
    assert np.array_equal(positions, want_pos), label
    assert xor.dtype == want_xor.dtype and np.array_equal(xor, want_xor), label
    assert checksum == want_sum, f"{label}: checksum {checksum:#018x}, reference {want_sum:#018x}"


def diff_with_snapshot(cases: list[Case], **snapshot_kw: object) -> None:
    """One Snapshot over all cases (one tensor each), one diff; everything checked against the reference."""
    old = {c.name: tensor_of(c.old, c.dtype) for c in cases}
    snap = Snapshot(old, **snapshot_kw)
    for c in cases:
        assert snap.checksums[c.name] == ref_checksum(c.old), f"{c.dtype} {c.name}"
    changes = {ch.name: ch for ch in snap.diff({c.name: tensor_of(c.new, c.dtype) for c in cases})}
    for c in cases:
        ch = changes[c.name]
        check_diff(c, ch.positions, ch.xor, ch.checksum, "Snapshot.diff")
        assert np.array_equal(bits_of(snap.tensors[c.name]), c.new)


@pytest.fixture(autouse=True)
def _one_kernel_thread():
    """Run the kernels on one thread: a small tensor is one block, which one thread runs anyway, and a
    parallel launch per tiny tensor is slow on a busy 2-core machine (the 2M-element case undoes this)."""
    before = numba.get_num_threads()
    numba.set_num_threads(1)
    yield
    numba.set_num_threads(before)


# --- checksums ---


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=str)
def test_tensor_checksum_matches_reference(dtype):
    rng = np.random.default_rng(1)
    sizes = range(0, 301) if dtype in ONE_PER_WIDTH else range(0, 65)
    for n in [*sizes, (1 << 15) - 1, 1 << 15, (1 << 15) + 1, 3 * (1 << 15) + 5]:
        bits = random_bits(n, dtype, rng)
        t = tensor_of(bits, dtype)
        want = ref_checksum(bits)
        assert tensor_checksum(t) == want, n
        assert _torch_checksum(int_bits(t), 0) == want
        assert checksum_elements(t, torch.arange(n)) == want


@pytest.mark.parametrize("dtype", ONE_PER_WIDTH, ids=str)
def test_checksums_of_slices_use_global_indices(dtype):
    """Every checksum entry point that takes a slice (a base offset or explicit indices) hashes global indices."""
    rng = np.random.default_rng(2)
    for n in (1, 3, 7, 9, 33, 100, (1 << 15) + 9):
        bits = random_bits(n, dtype, rng)
        starts = range(n) if n < 40 else (0, 1, 5, 31, n // 2, n - 1)
        for s in starts:
            part = bits[s:]
            want = ref_checksum(part, np.arange(s, n))
            assert int(_kernels.checksum_range(part, s)) == want, (n, s)
            signed = int_bits(tensor_of(part, dtype))
            assert _torch_checksum(signed, s) == want, (n, s)
            assert _torch_checksum_at(signed, torch.arange(s, n)) == want, (n, s)
            assert checksum_elements(tensor_of(part, dtype), torch.arange(s, n)) == want, (n, s)
            shuffled = rng.permutation(np.arange(s, n))
            assert int(_kernels.checksum_at(bits[shuffled], shuffled)) == ref_checksum(bits[shuffled], shuffled)


# --- the diff: Snapshot (host kernels), host chunks (device tensor, host snapshot), torch ops (device snapshot) ---

SIZES = range(0, 301)
SAMPLED_SIZES = [*range(0, 101), *range(101, 301, 7)]


@pytest.mark.parametrize("dtype", ONE_PER_WIDTH, ids=str)
def test_snapshot_diff_single_change_everywhere(dtype):
    """Every size 0..300; every position up to 64 elements, both ends and every residue mod 32 beyond."""
    diff_with_snapshot(single_change_cases(dtype, SIZES, exhaustive_up_to=64, seed=3))


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=str)
def test_snapshot_diff_change_patterns(dtype):
    """Every dtype: several changes at once (all, both ends, the tail, random 25% and 75%, none)."""
    diff_with_snapshot(pattern_cases(dtype, SIZES if dtype in ONE_PER_WIDTH else range(0, 65), seed=4))
    diff_with_snapshot(single_change_cases(dtype, range(0, 25), exhaustive_up_to=24, seed=5))


@pytest.mark.parametrize("dtype", [torch.uint8, torch.bfloat16], ids=str)
def test_snapshot_diff_around_kernel_blocks(dtype):
    """Sizes and changes around the 1 << 15-element blocks, and past the 64 blocks of one kernel call."""
    rng = np.random.default_rng(6)
    block = 1 << 15
    sizes = [block - 1, block, block + 1, block + 3, block + 31, 2 * block + 5]
    if dtype == torch.uint8:
        sizes.append(64 * block + 5)  # the second kernel call's blocks start at 64 * block
    small, big = [], []
    for n in sizes:
        old = random_bits(n, dtype, rng)
        bounds = [b for b in (block, 2 * block, 64 * block) if b < n]
        edges = sorted({*range(n - 40, n), *(p for b in bounds for p in range(b - 36, min(b + 36, n)))})
        near = sorted({0, *range(n - 9, n), *(p for b in bounds for p in range(b - 3, min(b + 3, n)))})
        if n > 4 * block:  # a copy and reference pass each: a few cases only
            near = [bounds[-1], n - 1]
        out = small if n <= 4 * block else big
        out += [Case(f"n{n}.p{p}", dtype, old, changed_bits(old, [p], dtype, rng)) for p in near]
        out.append(Case(f"n{n}.edges", dtype, old, changed_bits(old, edges, dtype, rng)))
        out.append(Case(f"n{n}.rand", dtype, old, changed_bits(old, np.flatnonzero(rng.random(n) < 0.01), dtype, rng)))
    diff_with_snapshot(small)
    diff_with_chunks(small, step=block + 5)
    if big:
        numba.set_num_threads(numba.config.NUMBA_NUM_THREADS)  # 65 blocks: let them run concurrently
        diff_with_snapshot(big)
        diff_with_chunks(big, step=(1 << 20) + 3)


@pytest.mark.parametrize("dtype", ONE_PER_WIDTH, ids=str)
def test_snapshot_diff_runs_of_words_sparse_after_dense(dtype):
    """Inside one block the diff kernel takes runs of 4096 words: a dense run (listed word by word) followed by
    a short sparse run (its marks visited 8 at a time) must not see the dense run's marks again, whatever
    the width; and a sparse run ending inside an 8-word group."""
    rng = np.random.default_rng(61)
    group = 8 // torch.empty(0, dtype=dtype).element_size()
    run = 4096 * group  # elements per run of words
    cases = []
    for tail_words in (1, 5, 8, 1000, 1001, 1003):
        n = (1 << 15) + run + tail_words * group  # the last block: a full run, then a partial one
        old = random_bits(n, dtype, rng)
        dense = np.arange(1 << 15, (1 << 15) + run)
        cases.append(Case(f"n{n}.dense_then_last", dtype, old, changed_bits(old, [*dense, n - 1], dtype, rng)))
        cases.append(Case(f"n{n}.dense_then_none", dtype, old, changed_bits(old, dense, dtype, rng)))
        sparse = np.flatnonzero(rng.random(n) < 0.002)
        cases.append(Case(f"n{n}.sparse", dtype, old, changed_bits(old, [*sparse, n - 1], dtype, rng)))
    diff_with_snapshot(cases)


def diff_with_chunks(cases: list[Case], step: int) -> None:
    """The path of a device tensor diffed against a host snapshot (``Snapshot(device="cpu")``)."""
    scratch = _Scratch()
    for c in cases:
        snap = c.old.copy()
        cur = int_bits(tensor_of(c.new, c.dtype))
        positions, xor, delta = _diff_host_chunks(cur, snap, step, scratch)
        check_diff(c, positions, xor, (ref_checksum(c.old) + delta) % 2**64, f"host chunks of {step}")
        assert np.array_equal(snap, c.new)


@pytest.mark.parametrize("dtype", ONE_PER_WIDTH, ids=str)
def test_host_chunks_diff(dtype):
    """Chunks of 13 elements start at every word offset; chunks of 32 start word-aligned with a tail."""
    for step in (13, 32):
        diff_with_chunks(single_change_cases(dtype, range(0, 33), exhaustive_up_to=32, seed=7), step)
        diff_with_chunks(pattern_cases(dtype, range(0, 301, 11), seed=8), step)
    diff_with_chunks(pattern_cases(dtype, range(0, 20), seed=9), 1)


def test_snapshot_on_host_with_tiny_chunks():
    """``Snapshot(device="cpu", max_chunk_bytes=...)`` of CPU weights (they skip the chunks: a host tensor is
    diffed in place; the chunks themselves are ``test_host_chunks_diff``)."""
    cases = single_change_cases(torch.bfloat16, range(0, 41), exhaustive_up_to=40, seed=10)
    diff_with_snapshot(cases, device="cpu", max_chunk_bytes=6)


def diff_with_torch(cases: list[Case], step: int) -> None:
    """The path of a snapshot on the trainer's accelerator (torch ops), here on CPU tensors."""
    for c in cases:
        snap = tensor_of(c.old, c.dtype)
        cur = tensor_of(c.new, c.dtype)
        positions, xor, delta = _diff_torch(int_bits(cur), int_bits(snap), step, snap.element_size())
        check_diff(c, positions, xor, (ref_checksum(c.old) + delta) % 2**64, f"torch ops, chunks of {step}")
        assert np.array_equal(bits_of(snap), c.new)


@pytest.mark.parametrize("dtype", ONE_PER_WIDTH, ids=str)
def test_torch_diff(dtype):
    diff_with_torch(single_change_cases(dtype, range(0, 25), exhaustive_up_to=24, seed=11), 1 << 20)
    diff_with_torch(single_change_cases(dtype, (0, 1, 3, 7, 9, 33), exhaustive_up_to=40, seed=12), 5)
    diff_with_torch(pattern_cases(dtype, range(0, 301, 23), seed=13), 29)


@pytest.mark.parametrize("range_elems", [40, 64, 1 << 15])
def test_snapshot_diff_in_ranges_on_the_pool(monkeypatch, range_elems):
    """``Snapshot.diff`` splits host tensors into ranges diffed on the codec pool, largest first, and
    reassembles them: ranges that end inside an 8-byte word (40 elements of 1 byte), on word boundaries, and
    at the kernel's blocks; a snapshot of shard slices (``offsets``) hashes global indices."""
    monkeypatch.setattr("deltasync.stages.diff._RANGE_ELEMS", range_elems)
    rng = np.random.default_rng(21)
    sizes = [0, 1, 39, 40, 41, 129, 300] + ([(1 << 15) + 77, 3 * (1 << 15) + 5] if range_elems > 64 else [1001])
    for dtype in ONE_PER_WIDTH:
        diff_with_snapshot(pattern_cases(dtype, sizes, seed=22))
    cases = [c for d in ONE_PER_WIDTH for c in pattern_cases(d, [1, 45, 300, 2 * range_elems + 3], seed=23)]
    offsets = {c.name + str(c.dtype): int(rng.integers(0, 1 << 40)) for c in cases}
    snap = Snapshot({c.name + str(c.dtype): tensor_of(c.old, c.dtype) for c in cases}, offsets=offsets)
    changes = {ch.name: ch for ch in snap.diff({c.name + str(c.dtype): tensor_of(c.new, c.dtype) for c in cases})}
    for c in cases:
        name, off = c.name + str(c.dtype), offsets[c.name + str(c.dtype)]
        ch = changes[name]
        want_pos, want_xor, _ = ref_diff(c.old, c.new)
        assert np.array_equal(ch.positions, want_pos) and np.array_equal(ch.xor, want_xor), name
        assert ch.checksum == ref_checksum(c.new, np.arange(off, off + c.new.size)), name


@pytest.mark.parametrize("parallel", [False, True], ids=["serial", "parallel"])
@pytest.mark.parametrize("dtype", ONE_PER_WIDTH, ids=str)
def test_both_compilations_of_each_kernel(dtype, parallel):
    """Every kernel split into blocks has a single-threaded twin (small work, busy machines): each of the
    two, forced whatever the size, against the reference (diff, checksum, sparse, indexed and dense XOR)."""
    numba.set_num_threads(numba.config.NUMBA_NUM_THREADS)  # parallel=True: really on every thread
    block = 1 << 15
    # parallel launches are slow on a busy machine (the reason for the twins): fewer tiny cases there
    sizes = [0, 1, 9, 33, block + 1, 2 * block + 5] if parallel else [0, 1, 7, 9, 33, 300, block - 1, block + 1,
                                                                      2 * block + 5]
    cases = pattern_cases(dtype, sizes, seed=24) + single_change_cases(dtype, range(0, 10 if parallel else 17), 16,
                                                                       seed=25)
    scratch = _Scratch()
    for c in cases:
        label = f"{'parallel' if parallel else 'serial'} {c.dtype} {c.name}"
        snap = c.old.copy()
        positions, xor, delta = _diff_np(c.new.copy(), snap, 0, scratch, parallel=parallel)
        check_diff(c, positions, xor, (ref_checksum(c.old) + delta) % 2**64, label)
        assert np.array_equal(snap, c.new), label
        base = 5 if c.old.size % 2 else 0
        assert int(_kernels.checksum_range(c.new, base, parallel=parallel)) == ref_checksum(
            c.new, np.arange(base, base + c.new.size)), label
        pos, x, want_after = ref_diff(c.old, c.new)
        u = c.old.copy()
        assert (ref_checksum(c.old) + int(_kernels.xor_at(u, pos, x, parallel=parallel))) % 2**64 == want_after, label
        assert np.array_equal(u, c.new), label
        u = c.old.copy()
        delta = int(_kernels.xor_dense(u, c.old ^ c.new, 0, parallel=parallel))
        assert (ref_checksum(c.old) + delta) % 2**64 == want_after
        assert np.array_equal(u, c.new), label
        u, kept = c.old.copy(), np.empty(pos.size, c.old.dtype)
        delta = int(_kernels.xor_at_indexed(u, pos, x, pos + base, kept, parallel=parallel))
        idx = np.arange(base, base + c.old.size)
        assert (ref_checksum(c.old, idx) + delta) % 2**64 == ref_checksum(c.new, idx), label
        assert np.array_equal(u, c.new) and np.array_equal(kept, c.old[pos]), label


# --- apply: XOR patches in place and the checksum change they report ---


def _torch_ops(t, p, x, **kw):
    """``xor_apply``'s accelerator path (torch ops), here on a CPU tensor."""
    return _xor_apply_torch(int_bits(t), p, x, kw.get("index"), kw.get("checksum", True))


@pytest.mark.parametrize("dtype", ONE_PER_WIDTH, ids=str)
def test_xor_apply_reports_reference_checksums(dtype):
    """Sparse (``xor_at``) and dense (``xor_dense``) patches, by the kernels and by torch ops (accelerators)."""
    cases = pattern_cases(dtype, SAMPLED_SIZES, seed=14) + single_change_cases(dtype, range(0, 25), 24, seed=15)
    for k, c in enumerate(cases):
        pos, xor, want_after = ref_diff(c.old, c.new)
        patchers = {"kernels": xor_apply}
        if k % 3 == 0 or c.old.size <= 24:  # torch ops are slower on CPU: every size up to 24, a third beyond
            patchers["torch ops"] = _torch_ops
        for name, patch in patchers.items():
            for dense in (False, True):
                t = tensor_of(c.old, c.dtype)
                delta = patch(t, None, c.old ^ c.new) if dense else patch(t, pos, xor)
                label = f"{name} dense={dense} {c.dtype} {c.name}"
                assert (ref_checksum(c.old) + delta) % 2**64 == want_after, label
                assert np.array_equal(bits_of(t), c.new), label
                # checksum=False only writes; applying the same patch again restores the old bits
                if dense:
                    assert patch(t, None, c.old ^ c.new, checksum=False) == 0
                else:
                    assert patch(t, pos, xor, checksum=False) == 0
                assert np.array_equal(bits_of(t), c.old), label


@pytest.mark.parametrize("dtype", ONE_PER_WIDTH, ids=str)
def test_xor_apply_on_slices_hashes_global_indices(dtype):
    """A slice of a larger tensor (a shard, one part of a fused parameter, a host chunk) patched at local
    positions, hashed at global indices given as an array or as the slice's first index; NumPy and torch
    inputs, as the vLLM worker passes them."""
    rng = np.random.default_rng(20)
    for n in (1, 3, 9, 37, 300):
        old = random_bits(n, dtype, rng)
        new = changed_bits(old, np.flatnonzero(rng.random(n) < 0.5), dtype, rng)
        for s in sorted({0, 1, n // 3, n - 1}):
            idx = np.arange(s, n)
            want = (ref_checksum(new[s:], idx) - ref_checksum(old[s:], idx)) % 2**64
            local = rng.permutation(n - s).astype(np.int64)
            x = (old[s:] ^ new[s:])[local]
            for name, patch in {"kernels": xor_apply, "torch ops": _torch_ops}.items():
                calls = {
                    "dense, base": lambda t: patch(t, None, old[s:] ^ new[s:], index=s),  # noqa: B023 - called in this iteration
                    "local, base": lambda t: patch(t, local, x, index=s),  # noqa: B023 - called in this iteration
                    "local, indices": lambda t: patch(t, local, x, index=local + s),  # noqa: B023 - called in this iteration
                    "torch inputs": lambda t: patch(t, torch.from_numpy(local),  # noqa: B023 - called in this iteration
                                                    torch.from_numpy(x.view(f"i{x.itemsize}")),  # noqa: B023 - called in this iteration
                                                    index=torch.from_numpy(local + s)),  # noqa: B023 - called in this iteration
                }
                for how, call in calls.items():
                    t = tensor_of(old[s:], dtype)
                    assert call(t) == want, (name, how, n, s)
                    assert np.array_equal(bits_of(t), new[s:]), (name, how, n, s)


def test_xor_apply_refuses_a_patch_that_does_not_fit():
    """Positions out of range, too few values, a different width or mismatched indices: nothing written."""
    t = tensor_of(np.arange(10, dtype=np.uint16), torch.bfloat16)
    before = bits_of(t)
    bad = [
        (np.array([3, 10]), np.ones(2, np.uint16), {}),
        (np.array([-1]), np.ones(1, np.uint16), {}),
        (np.array([1, 2]), np.ones(3, np.uint16), {}),
        (np.array([1, 2]), np.ones(2, np.uint32), {}),
        (None, np.ones(9, np.uint16), {}),
        (np.array([1, 2]), np.ones(2, np.uint16), {"index": np.array([5])}),
        (np.array([1, 2], np.int32), np.ones(2, np.uint16), {}),
    ]
    for pos, x, kw in bad:
        for patch in (xor_apply, _torch_ops):
            with pytest.raises(TensorMismatchError):
                xor_apply(t, pos, x, **kw) if patch is xor_apply else _checked_torch(t, pos, x, **kw)
            assert np.array_equal(bits_of(t), before)


def _checked_torch(t, pos, x, **kw):
    """The accelerator path through ``xor_apply``'s own checks (they run before either path)."""
    from deltasync.format.checksum import check_patch

    check_patch(t.element_size(), t.numel(), pos, x, kw.get("index"), t.numel() if pos is None else pos.size)
    return _torch_ops(t, pos, x, **kw)


@pytest.mark.parametrize("dtype", ONE_PER_WIDTH, ids=str)
def test_patch_kernels_on_slices_hash_global_indices(dtype):
    """``xor_dense`` with a base and ``xor_at_indexed`` patch part of a larger tensor: global indices."""
    rng = np.random.default_rng(16)
    for n in (1, 3, 9, 37, 300):
        old = random_bits(n, dtype, rng)
        new = changed_bits(old, np.flatnonzero(rng.random(n) < 0.5), dtype, rng)
        for s in sorted({0, 1, n // 3, n - 1}):
            u = old[s:].copy()
            delta = int(_kernels.xor_dense(u, old[s:] ^ new[s:], s))
            idx = np.arange(s, n)
            assert (ref_checksum(old[s:], idx) + delta) % 2**64 == ref_checksum(new[s:], idx), (n, s)
            assert np.array_equal(u, new[s:])
            local = rng.permutation(n - s)
            u = old[s:].copy()
            kept = np.empty(local.size, u.dtype)
            delta = int(_kernels.xor_at_indexed(u, local, (old[s:] ^ new[s:])[local], local + s, kept))
            assert (ref_checksum(old[s:], idx) + delta) % 2**64 == ref_checksum(new[s:], idx), (n, s)
            assert np.array_equal(u, new[s:]) and np.array_equal(kept, old[s:][local])


@pytest.mark.parametrize("verify", ["incremental", "full"])
def test_replica_applies_a_written_delta(tmp_path, verify):
    """Snapshot -> write_step -> Replica.apply: the header's checksums are the reference's, and verify."""
    cases = [c for d in ONE_PER_WIDTH for c in pattern_cases(d, range(0, 41), seed=17)]
    cases += [c for d in ONE_PER_WIDTH for c in single_change_cases(d, range(0, 13), 12, seed=18)]
    cases = [Case(f"{c.dtype}.{c.name}".replace("torch.", ""), c.dtype, c.old, c.new) for c in cases]
    old = {c.name: tensor_of(c.old, c.dtype) for c in cases}
    snap = Snapshot(old)
    changes = [ch for ch in snap.diff({c.name: tensor_of(c.new, c.dtype) for c in cases}) if ch.changed]
    path = tmp_path / "1.safetensors"
    header = write_step(path, kind="delta", step=1, base_step=0, headers=snapshot_headers(snap), changes=changes)
    for c in cases:
        assert int(header.tensors[c.name].checksum, 16) == ref_checksum(c.new), c.name
    rep = Replica.from_tensors({c.name: tensor_of(c.old, c.dtype) for c in cases}, step=0)
    with StepObject(path, where="1") as obj:
        rep.apply(obj, verify=verify)
    for c in cases:
        assert np.array_equal(bits_of(rep.tensors[c.name]), c.new), c.name
        assert rep.checksums[c.name] == ref_checksum(c.new), c.name


# --- end to end: a publisher's stream, the CLI ---


def _tail_state(rng: np.random.Generator) -> dict[str, torch.Tensor]:
    return {
        "f32_3": tensor_of(random_bits(3, torch.float32, rng), torch.float32),
        "bf16_7": tensor_of(random_bits(7, torch.bfloat16, rng), torch.bfloat16).reshape(7, 1),
        "bf16_301": tensor_of(random_bits(301, torch.bfloat16, rng), torch.bfloat16),
        "u8_13": tensor_of(random_bits(13, torch.uint8, rng), torch.uint8),
        "f64_5": tensor_of(random_bits(5, torch.float64, rng), torch.float64),
        "f16_aligned": tensor_of(random_bits(64, torch.float16, rng), torch.float16),
    }


def _train_tail(state: dict[str, torch.Tensor], step: int, rng: np.random.Generator) -> None:
    """Change the last element of every tensor (and a random other one): the tail the kernels missed."""
    for t in state.values():
        bits = bits_of(t)
        where = {bits.size - 1, int(rng.integers(bits.size))} if step % 3 else {bits.size - 1}
        t.copy_(tensor_of(changed_bits(bits, sorted(where), t.dtype, rng), t.dtype).reshape(t.shape))


@pytest.mark.parametrize("snapshot_device", ["same", "cpu"])
def test_publisher_stream_with_tail_changes_replays_every_step(tmp_path, snapshot_device):
    rng = np.random.default_rng(19)
    state = _tail_state(rng)
    truth = {}
    url = str(tmp_path / "stream")
    (tmp_path / "spool").mkdir()  # inside tmp_path: nothing left in the system temp folder
    # random bits, NaN payloads included: the stream must carry any bits exactly when asked to publish them
    with DeltaPublisher(
        url, state, anchor_every=4, on_backlog="block", snapshot_device=snapshot_device, spool_dir=tmp_path / "spool",
        refuse_nonfinite=False,
    ) as pub:
        for step in range(10):
            if step:
                _train_tail(state, step, rng)
            truth[step] = {k: bits_of(v) for k, v in state.items()}
            assert pub.publish(step)
    reader = StreamReader(url)
    assert reader.steps() == list(range(10))
    for step, want in truth.items():
        with reader.open(step) as obj:
            for name, bits in want.items():
                assert int(obj.header.tensors[name].checksum, 16) == ref_checksum(bits), (step, name)
        got = reader.state_dict(step)  # raises ChecksumMismatchError on a wrong header
        for name, bits in want.items():
            assert np.array_equal(bits_of(got[name]), bits), (step, name)
    rep = reader.replica(0)
    for step in range(1, 10):  # one step at a time: every delta applied and checked in full
        assert reader.catch_up(rep, step, verify="full") == [step]
        assert all(np.array_equal(bits_of(rep.tensors[n]), b) for n, b in truth[step].items()), step


def test_cli_diff_then_patch_tail_changes(tmp_path):
    rng = np.random.default_rng(20)
    base_state = _tail_state(rng)
    target_state = {k: v.clone() for k, v in base_state.items()}
    _train_tail(target_state, 1, rng)
    base, target = tmp_path / "base.safetensors", tmp_path / "target.safetensors"
    safetensors.torch.save_file(base_state, str(base))
    safetensors.torch.save_file(target_state, str(target))
    delta, out = tmp_path / "d.safetensors", tmp_path / "out.safetensors"
    runner = CliRunner()
    r = runner.invoke(app, ["diff", str(base), str(target), "-o", str(delta)])
    assert r.exit_code == 0, r.output
    r = runner.invoke(app, ["patch", str(base), str(delta), "-o", str(out)])
    assert r.exit_code == 0, r.output
    got = safetensors.torch.load_file(str(out))
    assert got.keys() == target_state.keys()
    for name, t in target_state.items():
        assert got[name].dtype == t.dtype and got[name].shape == t.shape
        assert np.array_equal(bits_of(got[name]), bits_of(t)), name
