import numpy as np
import pytest
import torch

from deltasync.errors import TensorMismatchError
from deltasync.format._bits import int_view, np_bits
from deltasync.format.checksum import tensor_checksum
from deltasync.stages.diff import Snapshot, _diff_host_chunks, _diff_torch, _Scratch
from tests.conftest import bits_equal, perturb
from tests.test_checksum import reference


def test_diff_finds_exact_bits_and_advances_snapshot(small_state, gen):
    snap = Snapshot(small_state)
    new = {k: perturb(v, 0.05, gen) for k, v in small_state.items()}
    changes = {c.name: c for c in snap.diff(new)}
    for name, t in new.items():
        old = small_state[name].reshape(-1).view(torch.uint8).view(-1, t.element_size())
        cur = t.reshape(-1).view(torch.uint8).view(-1, t.element_size())
        want = torch.nonzero((old != cur).any(1)).squeeze(1).numpy()
        assert np.array_equal(changes[name].positions, want)
        assert bits_equal(snap.tensors[name], t)
        assert snap.checksums[name] == tensor_checksum(t) == changes[name].checksum
    assert all(c.changed == 0 for c in snap.diff(new))


def test_signed_zero_and_nan_payloads_are_changes():
    old = torch.tensor([0.0, float("nan"), 1.0], dtype=torch.bfloat16)
    new = old.clone()
    new[0] = -0.0
    new.view(torch.int16)[1] ^= 1  # another NaN
    (c,) = Snapshot({"t": old}).diff({"t": new})
    assert c.positions.tolist() == [0, 1]


def test_host_snapshot_of_device_tensor_streams_in_chunks(gen):
    """The path a device tensor takes with a host snapshot, run on a CPU tensor in chunks of 13 elements
    (chunk starts at every word offset; each chunk's positions and hashes use global indices)."""
    t = torch.randn(10_001, generator=gen).bfloat16()
    new = perturb(t, 0.1, gen)
    snap = np_bits(t.clone())
    pos, xor, delta = _diff_host_chunks(int_view(new), snap, 13, _Scratch())
    old_u, new_u = t.view(torch.int16).numpy().view(np.uint16), new.view(torch.int16).numpy().view(np.uint16)
    want = np.flatnonzero(old_u != new_u)
    assert want.size > 500 and np.array_equal(pos, want) and np.array_equal(xor, (old_u ^ new_u)[want])
    assert (tensor_checksum(t) + delta) % 2**64 == tensor_checksum(new) == reference(new)
    assert np.array_equal(snap, new_u)


@pytest.mark.parametrize(
    ("dtype", "n"), [(torch.float32, 3), (torch.bfloat16, 7), (torch.uint8, 13), (torch.float16, 301)]
)
def test_change_past_the_last_whole_word_has_the_right_checksum(dtype, n):
    """Regression: the kernel hashed an element past the last whole 8-byte word with its index in that tail,
    not in the tensor, so the publisher wrote a checksum every consumer rejected."""
    t = (torch.arange(n) % 50 + 1).to(dtype)
    new = t.clone()
    new[-1] = 100
    (c,) = Snapshot({"t": t}).diff({"t": new})
    assert c.positions.tolist() == [n - 1]
    assert c.checksum == reference(new)


def test_torch_path_matches_numba_path(gen):
    """The path used for accelerator tensors gives the same result as the CPU kernels."""
    t = torch.randn(5000, generator=gen).bfloat16()
    new = perturb(t, 0.03, gen)
    a = Snapshot({"t": t})
    (c,) = a.diff({"t": new})
    snap_copy = t.clone()
    pos, xor, delta = _diff_torch(int_view(new), int_view(snap_copy), 777, 2)
    assert np.array_equal(pos, c.positions) and np.array_equal(xor, c.xor)
    assert (tensor_checksum(t) + delta) % 2**64 == c.checksum
    assert bits_equal(snap_copy, new)


def test_publishes_fp32_master_weights_as_bf16(gen):
    master = {"w": torch.randn(1000, generator=gen)}
    snap = Snapshot(master, dtype=torch.bfloat16)
    assert snap.tensors["w"].dtype == torch.bfloat16
    master["w"] += 1e-2
    (c,) = snap.diff(master)
    assert c.changed > 0 and bits_equal(snap.tensors["w"], master["w"].bfloat16())


def test_layout_changes_are_refused(small_state):
    snap = Snapshot(small_state)
    with pytest.raises(TensorMismatchError, match="missing"):
        snap.diff({k: v for k, v in small_state.items() if k != "scale"})
    bad = dict(small_state, **{"layer.0.bias": torch.zeros(65).bfloat16()})
    with pytest.raises(TensorMismatchError, match="layer.0.bias"):
        snap.diff(bad)


@pytest.mark.parametrize("offset", [0, 4099], ids=["whole", "shard"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float8_e4m3fn,
                                   torch.float8_e5m2])
def test_track_finite_keeps_which_tensors_hold_nan_or_inf_from_the_changes(dtype, offset, gen):
    """``nonfinite`` after each diff equals a full scan, whether the change is sparse (read at its positions) or
    dense (read whole), for 8-bit floats too (torch.isfinite has no kernel for some) and for a rank's shard (a
    slice at a global offset: positions in its own coordinates); ``undo`` restores it."""
    def scan(state):
        return {n for n, t in state.items() if t.is_floating_point() and not torch.isfinite(t.float()).all()}

    base = {"a": torch.randn(4096, generator=gen).to(dtype), "b": torch.randn(64, generator=gen).to(dtype),
            "mask": torch.full((16,), float("-inf")).to(dtype) if dtype != torch.float8_e4m3fn else
            torch.full((16,), float("nan")).to(dtype), "i": torch.arange(4)}
    snap = Snapshot(base, track_finite=True, offsets=dict.fromkeys(base, offset))
    assert snap.nonfinite == scan(base) == {"mask"}
    steps = []
    a, b, mask = base["a"].clone(), base["b"].clone(), base["mask"].clone()
    a[100] = float("nan")  # sparse: one element of 4096
    steps.append({"a": a.clone(), "b": b.clone(), "mask": mask.clone(), "i": base["i"]})
    a[100] = 1.0
    b.copy_(torch.randn(64, generator=gen).to(dtype))  # dense, all finite
    mask.copy_(torch.zeros(16))  # the mask becomes finite (read whole: it was not)
    steps.append({"a": a.clone(), "b": b.clone(), "mask": mask.clone(), "i": base["i"]})
    for state in steps:
        before_sums, before_flags = dict(snap.checksums), set(snap.nonfinite)
        changes = snap.diff(state)
        assert snap.nonfinite == scan(state)
        snap.undo(changes, before_sums, before_flags)
        assert snap.nonfinite == before_flags
        snap.diff(state)
    assert snap.nonfinite == set()
    assert Snapshot(base).nonfinite == set()  # not tracked unless asked
