"""The AVX-512 diff kernel (deltasync/format/_simd.py, ``_kernels._diff_scan16``) against the portable one and a
plain NumPy diff written from docs/FORMAT.md section 4 (changed positions ascending, ``new ^ old``, the checksum
change hashed with global indices): the same positions, values, counts, checksum change and snapshot, bit for bit,
at every density, tail length and offset. Skipped on a CPU without AVX-512 VBMI2 (the portable kernel runs there,
and every other test exercises it)."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from deltasync.format import _kernels, _simd
from deltasync.format.checksum import MASK64
from deltasync.stages.diff import Snapshot
from tests.test_reference import ref_checksum, ref_diff

needs_vbmi2 = pytest.mark.skipif(not _simd.COMPRESS16, reason="this CPU has no AVX-512 VBMI2")

BLOCK_WORDS = 8192  # the diff's blocks of 32768 elements, four to a word


def _reference(new: np.ndarray, old: np.ndarray, base: int) -> tuple[np.ndarray, np.ndarray, int]:
    """Positions (global), xor values and checksum change of ``old`` -> ``new``, by tests/test_reference.py's
    plain-NumPy diff and checksum (FORMAT.md section 4): the changed elements' hashes after minus before."""
    where, xor, _ = ref_diff(old, new)
    delta = ref_checksum(new[where], where + base) - ref_checksum(old[where], where + base)
    return where + base, xor, delta & MASK64


def _run(kernel, new: np.ndarray, old: np.ndarray, base: int) -> tuple[np.ndarray, np.ndarray, int, np.ndarray]:
    """One kernel over every block, outputs gathered as ``diff._scan`` gathers them; returns the snapshot after."""
    snap = old.copy()
    aw, bw = new.view(np.uint64), snap.view(np.uint64)
    nblocks = -(-aw.size // BLOCK_WORDS)
    pos = np.empty(nblocks * BLOCK_WORDS * 4, np.int64)
    xor = np.empty(nblocks * BLOCK_WORDS * 4, np.uint16)
    counts, sums = np.zeros(nblocks, np.int64), np.zeros(nblocks, np.uint64)
    if kernel in (_kernels._diff_scan16_serial, _kernels._diff_scan16_parallel):
        total, delta = kernel(aw, bw, new, bw.view(np.uint16), BLOCK_WORDS, 0, nblocks, base, pos, xor, counts, sums)
    else:
        total, delta = kernel(aw, bw, new, 4, BLOCK_WORDS, 0, nblocks, base, pos, xor, counts, sums)
    out_pos, out_xor = np.empty(total, np.int64), np.empty(total, np.uint16)
    _kernels.compact(pos, xor, counts, BLOCK_WORDS * 4, out_pos, out_xor)
    return out_pos, out_xor, int(delta), snap


@needs_vbmi2
@pytest.mark.parametrize("density", [0.0, 0.0005, 0.02, 0.3, 1.0])
@pytest.mark.parametrize("words", [1, 7, 8, 9, 1023, 1025, 8192 + 13, 3 * 8192])
def test_the_avx512_diff_matches_the_portable_kernel_and_a_reference(density: float, words: int) -> None:
    rng = np.random.default_rng(words * 31 + int(density * 1e4))
    old = rng.integers(0, 1 << 16, words * 4, dtype=np.uint16)
    new = old.copy()
    hit = rng.random(new.size) < density
    new[hit] ^= rng.integers(1, 1 << 16, int(hit.sum()), dtype=np.uint16)  # never 0: every hit is a change
    base = int(rng.integers(0, 1 << 40))
    want_pos, want_xor, want_delta = _reference(new, old, base)
    for kernel in (_kernels._diff_scan16_serial, _kernels._diff_scan16_parallel, _kernels._diff_scan_serial):
        pos, xor, delta, snap = _run(kernel, new, old, base)
        assert np.array_equal(pos, want_pos) and np.array_equal(xor, want_xor), kernel
        assert delta == want_delta, kernel
        assert np.array_equal(snap, new), kernel  # the snapshot advanced to the new bits, nothing else written


@needs_vbmi2
def test_a_bf16_snapshot_diffs_through_the_avx512_kernel_as_plain_torch_does() -> None:
    """Through ``Snapshot.diff`` (ranges on the pool, the word body by the AVX-512 kernel, the tail by the
    portable one): each tensor's positions and xor as plain torch finds them, odd sizes and 8-byte-unaligned
    views included."""
    g = torch.Generator().manual_seed(3)
    backing = torch.randn(5_000_003, generator=g).to(torch.bfloat16)
    old = {"big": backing[:4_500_001], "unaligned": backing[1:70_002], "small": backing[:5].clone()}
    changed = backing.clone()
    hit = torch.rand(changed.numel(), generator=g) < 0.02
    changed[hit] = (changed[hit].float() * 1.01 + 1e-3).to(torch.bfloat16)
    new = {"big": changed[:4_500_001], "unaligned": changed[1:70_002], "small": changed[:5].clone()}
    snap = Snapshot({k: v.clone() for k, v in old.items()})
    for c in snap.diff(new):
        a = new[c.name].reshape(-1).view(torch.int16)
        b = old[c.name].reshape(-1).view(torch.int16)
        want = (a != b).nonzero().squeeze(1)
        assert np.array_equal(c.positions, want.numpy()), c.name
        assert np.array_equal(c.xor, (a ^ b)[want].numpy().view(np.uint16)), c.name
        assert torch.equal(snap.tensors[c.name].view(torch.int16), a.reshape(old[c.name].shape)), c.name


def test_kernels_built_for_other_cpus_never_use_avx512() -> None:
    """``NUMBA_CPU_FEATURES`` (kernels compiled for other machines, e.g. a container image's cache) without VBMI2:
    the portable kernel, whatever this CPU has (LLVM could not compile the AVX-512 one for that target)."""
    code = "from deltasync.format import _simd; print(_simd.COMPRESS16)"
    env = {**os.environ, "NUMBA_CPU_FEATURES": "+sse2,+avx2,+avx512f,+avx512bw"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True, timeout=120)
    assert out.stdout.strip() == "False"
