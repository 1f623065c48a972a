import numpy as np
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from deltasync.format import checksum as C
from deltasync.format._bits import np_bits

M = (1 << 64) - 1


def _mix(z: int) -> int:
    z ^= z >> 30
    z = (z * 0xBF58476D1CE4E5B9) & M
    z ^= z >> 27
    z = (z * 0x94D049BB133111EB) & M
    return z ^ (z >> 31)


def reference(t: torch.Tensor) -> int:
    """docs/FORMAT.md section 4, written out in plain Python."""
    return sum(_mix(int(u) ^ _mix(i)) for i, u in enumerate(np_bits(t.contiguous()).tolist())) & M


DTYPES = [torch.bfloat16, torch.float16, torch.float32, torch.float64, torch.int8, torch.int64, torch.bool,
          torch.float8_e4m3fn]


@settings(max_examples=40, deadline=None)
@given(st.sampled_from(DTYPES), st.integers(0, 300), st.integers(0, 2**31))
def test_kernels_torch_and_reference_agree(dtype, n, seed):
    g = torch.Generator().manual_seed(seed)
    t = (torch.randn(n, generator=g) * 3).to(dtype)
    want = reference(t)
    assert C.tensor_checksum(t) == want
    assert C._torch_checksum(C.int_view(t), 0) == want
    assert C.checksum_elements(t, torch.arange(n)) == want


def test_parts_add_up():
    t = torch.randn(40, 30).bfloat16()
    rows = [C.checksum_elements(t[a:b], torch.arange(a * 30, b * 30)) for a, b in ((0, 7), (7, 31), (31, 40))]
    assert C.add(*rows) == C.tensor_checksum(t)
    cols = t[:, 10:20]  # a non-contiguous slice, as a row-parallel shard would be
    idx = (torch.arange(40)[:, None] * 30 + torch.arange(10, 20)[None, :]).reshape(-1)
    rest = torch.cat([t[:, :10], t[:, 20:]], 1)
    rest_cols = torch.cat([torch.arange(10), torch.arange(20, 30)])
    idx_rest = (torch.arange(40)[:, None] * 30 + rest_cols[None, :]).reshape(-1)
    assert C.add(C.checksum_elements(cols, idx), C.checksum_elements(rest, idx_rest)) == C.tensor_checksum(t)


def test_detects_single_bit_flip_and_swaps():
    t = torch.randn(1000).bfloat16()
    base = C.tensor_checksum(t)
    u = t.clone()
    u.view(torch.int16)[500] ^= 1
    assert C.tensor_checksum(u) != base
    s = t.clone()
    s[1], s[2] = t[2].clone(), t[1].clone()
    assert t[1] != t[2] and C.tensor_checksum(s) != base


def test_format_parse_and_state_digest():
    assert C.format_checksum(5) == "0x0000000000000005"
    assert C.parse_checksum(C.format_checksum(M)) == M
    a = C.state_checksum({"b": "0x1", "a": "0x2"})
    assert a == C.state_checksum({"a": "0x2", "b": "0x1"}) and len(a) == 64
    assert a != C.state_checksum({"a": "0x1", "b": "0x2"})


def _reference_at(bits: torch.Tensor, indices: torch.Tensor) -> int:
    """Section 4 over elements at given global indices, in plain Python."""
    return sum(_mix(int(u) ^ _mix(int(i))) for u, i in zip(np_bits(bits.contiguous()).tolist(),
                                                               indices.tolist(), strict=True)) & M


@settings(max_examples=30, deadline=None)
@given(st.sampled_from([torch.bfloat16, torch.float32, torch.int8, torch.float64]), st.integers(1, 400),
       st.integers(0, 2**31), st.integers(0, 10_000))
def test_a_change_computed_before_a_write_is_the_one_the_write_makes(dtype, n, seed, base):
    """``checksum_change`` (one fused pass, nothing written) against the plain-Python checksum of the elements
    before and after the XOR, each hashed at its global index (a slice of a larger tensor: base + position)."""
    g = torch.Generator().manual_seed(seed)
    t = (torch.randn(n, generator=g) * 3).to(dtype)
    signed = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()]
    positions = torch.randperm(n, generator=g)[: max(1, n // 7)].sort().values
    xor = torch.randint(-100, 100, (positions.numel(),), generator=g).to(signed)
    indices = positions + base
    before = t.clone()
    change = C.checksum_change(t, positions, xor, indices)
    assert torch.equal(t.view(signed), before.view(signed))  # nothing written
    after = t.clone().view(signed).reshape(-1)
    after[positions] ^= xor
    want = (_reference_at(after[positions], indices) - _reference_at(before.view(signed)[positions], indices)) & M
    assert change == want
    assert C._torch_change(t.reshape(-1), positions, xor, indices) == want  # the accelerators' path, run here
    # NumPy positions, xor and indices (what an engine's staging threads pass for CPU bits): the same number
    assert C.checksum_change(t, positions.numpy(), xor.numpy(), indices.numpy()) == want


def test_a_change_outside_the_tensor_is_refused_before_any_read():
    """``checksum_change`` checks what ``xor_apply`` checks (one shared check), before reading a bit."""
    import pytest

    from deltasync.errors import TensorMismatchError

    t = torch.zeros(10, dtype=torch.bfloat16)
    x = torch.ones(2, dtype=torch.int16)
    with pytest.raises(TensorMismatchError, match="positions run from 3 to 10, the tensor has 10 elements"):
        C.checksum_change(t, torch.tensor([3, 10]), x, torch.tensor([3, 10]))
    with pytest.raises(TensorMismatchError, match="patch of 2 32-bit values for 2 elements of 16 bits"):
        C.checksum_change(t, torch.tensor([3, 4]), x.int(), torch.tensor([3, 4]))
    with pytest.raises(TensorMismatchError, match="1 checksum indices for 2 patched elements"):
        C.checksum_change(t, torch.tensor([3, 4]), x, torch.tensor([3]))
    # the same checks for NumPy arguments
    with pytest.raises(TensorMismatchError, match="positions run from -1 to 4, the tensor has 10 elements"):
        C.checksum_change(t, np.array([-1, 4]), x.numpy(), np.array([3, 4]))
    with pytest.raises(TensorMismatchError, match="positions must be int64, got int32"):
        C.checksum_change(t, np.array([3, 4], np.int32), x.numpy(), np.array([3, 4]))
    with pytest.raises(TensorMismatchError, match="patch of 2 32-bit values for 2 elements of 16 bits"):
        C.checksum_change(t, np.array([3, 4]), x.int().numpy(), np.array([3, 4]))
