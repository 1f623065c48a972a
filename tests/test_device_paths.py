"""The accelerator paths of the diff and the apply (deltasync/stages/_device.py, _triton_scatter.py), run here on
CPU tensors: the same positions, xor values, checksum changes and bits as the CPU kernels, with every change of a
step crossing in one transfer however the reserved room and the memory bound cut it."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch

from deltasync.format._bits import int_view
from deltasync.format.checksum import tensor_checksum
from deltasync.stages._device import diff_device, xor_apply_many
from deltasync.stages.apply import xor_apply
from deltasync.stages.diff import Snapshot

ROOT = Path(__file__).resolve().parents[1]


def _state(gen: torch.Generator) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    old = {
        "w": torch.randn(5000, generator=gen).bfloat16(),
        "m": torch.randn(37, 29, generator=gen).float(),
        "e": torch.zeros(0).bfloat16(),
        "i8": torch.randint(-100, 100, (300,), generator=gen, dtype=torch.int8),
        "same": torch.randn(700, generator=gen).bfloat16(),
    }
    new = {}
    for n, t in old.items():
        u = t.clone()
        if n != "same" and u.numel():
            flat = u.reshape(-1)
            idx = torch.randperm(flat.numel(), generator=gen)[: max(1, flat.numel() // 7)]
            flat[idx] = flat[idx] + 1 if not flat.is_floating_point() else flat[idx] * 1.01 + 0.5
            flat[0] = flat[0] + 1  # element 0 changed: the padding's index
        new[n] = u
    return old, new


@pytest.mark.parametrize("caps_elems,step,pending", [(None, 1 << 20, 1 << 30), (1, 333, 1 << 30), (None, 97, 64)])
def test_device_diff_matches_the_cpu_kernels(caps_elems, step, pending):
    """Room too small for the changes (the exact second round), segments cut mid-tensor, a memory bound that forces
    a transfer after every segment: always the CPU kernels' answer, and the snapshot advanced."""
    gen = torch.Generator().manual_seed(3)
    old, new = _state(gen)
    want = Snapshot(old).diff(new)
    snaps = {n: t.clone() for n, t in old.items()}
    caps = {(n, s): caps_elems for n, t in old.items() for s in range(0, t.numel(), step)} if caps_elems else {}
    items = [(n, new[n], int_view(snaps[n]), 1000 * k) for k, n in enumerate(old)]
    got = diff_device(items, step_elems=step, caps=caps, max_pending_bytes=pending)
    for k, (c, (pos, xor, delta)) in enumerate(zip(want, got, strict=True)):
        assert np.array_equal(pos - 1000 * k, c.positions) and np.array_equal(xor, c.xor), c.name
        if k == 0:
            assert (tensor_checksum(old[c.name]) + delta) % 2**64 == c.checksum
        assert torch.equal(int_view(snaps[c.name]), int_view(new[c.name].contiguous()))
    assert all(v >= 1024 for v in caps.values())  # the room learned for the next step


def test_device_diff_casts_one_segment_at_a_time():
    """fp32 master weights published as bf16: the device path gives what the host path gives."""
    gen = torch.Generator().manual_seed(4)
    master = torch.randn(4000, generator=gen)
    host = Snapshot({"w": master}, dtype=torch.bfloat16)
    snap = master.bfloat16()
    master += 1e-2 * torch.randn(4000, generator=gen)
    (c,) = host.diff({"w": master})
    ((pos, xor, _),) = diff_device([("w", master, int_view(snap), 0)], step_elems=999, cast=lambda t: t.bfloat16())
    assert np.array_equal(pos, c.positions) and np.array_equal(xor, c.xor)


def _patches(gen: torch.Generator):
    rng = np.random.default_rng(5)
    tensors = [torch.randn(3000, generator=gen).bfloat16(), torch.randn(500, generator=gen),
               torch.randn(64, generator=gen).bfloat16()]
    items = []
    for k, t in enumerate(tensors):
        width = t.element_size()
        pos = np.sort(rng.choice(t.numel(), t.numel() // 9, replace=False)).astype(np.int64)
        xor = rng.integers(1, 2 ** (8 * width) - 1, pos.size, dtype=np.uint64).astype(f"u{width}")
        index = [None, 7000, pos + 11][k]
        items.append((t, pos, xor, index))
    dense = torch.randn(50, generator=gen).bfloat16()
    items.append((dense, None, rng.integers(0, 2**16, 50, dtype=np.uint64).astype("u2"), None))
    return items


def test_batched_apply_matches_xor_apply():
    """All positions, xor values and checksum indices in one buffer, one checksum transfer: xor_apply's bits and
    checksum changes, item by item; with ``checksum=False`` the same bits."""
    items = _patches(torch.Generator().manual_seed(6))
    want_bits = [t.clone() for t, *_ in items]
    want = [xor_apply(b, p, x, index=ix) for b, (_, p, x, ix) in zip(want_bits, items, strict=True)]
    for checksum in (True, False):
        bits = [t.clone() for t, *_ in items]
        landed: list[int] = []
        got = xor_apply_many([(int_view(b), p, x, ix) for b, (_, p, x, ix) in zip(bits, items, strict=True)],
                             checksum=checksum, landed=landed)
        assert got == (want if checksum else [0] * len(items))
        assert landed == list(range(len(items)))
        assert all(torch.equal(int_view(a), int_view(b)) for a, b in zip(bits, want_bits, strict=True))


@pytest.mark.skipif(subprocess.run([sys.executable, "-c", "import triton"], capture_output=True).returncode != 0,
                    reason="Triton is not installed")
def test_triton_scatter_in_the_interpreter():
    """The one-launch-per-width kernel (a table of base addresses), run by Triton's CPU interpreter: xor_apply's
    bits."""
    code = textwrap.dedent("""
        import torch
        from deltasync.format._bits import int_view
        from deltasync.stages._device import xor_apply_many
        from deltasync.stages._triton_scatter import xor_scatter_table
        from deltasync.stages.apply import xor_apply
        from tests.test_device_paths import _patches
        items = _patches(torch.Generator().manual_seed(6))
        want = [t.clone() for t, *_ in items]
        for b, (_, p, x, ix) in zip(want, items):
            xor_apply(b, p, x, checksum=False)
        bits = [t.clone() for t, *_ in items]
        assert xor_apply_many([(int_view(b), p, x, ix) for b, (_, p, x, ix) in zip(bits, items)],
                              checksum=False, scatter="triton") == [0] * len(items)
        assert all(torch.equal(int_view(a), int_view(b)) for a, b in zip(bits, want))
        big = torch.zeros(5000, dtype=torch.int16)
        assert xor_scatter_table([(big, torch.arange(0, 5000, 2), torch.ones(2500, dtype=torch.int16))]) == 1
        assert int(big.sum()) == 2500 and int(big[1::2].abs().sum()) == 0
        print("ok")
    """)
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(ROOT))
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=ROOT, timeout=600)
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stderr[-3000:]
