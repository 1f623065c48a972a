import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from deltasync.errors import FormatError
from deltasync.format._byte_kernels import gap16_decode, gap16_encode
from deltasync.format.codecs import decode_change, encode_change
from deltasync.stages.diff import Snapshot
from tests.conftest import perturb

DTYPES = [torch.bfloat16, torch.float16, torch.float32, torch.float64, torch.uint8, torch.int32, torch.bool,
          torch.float8_e5m2]


def roundtrip(change, header_changed=None):
    enc = encode_change(change)
    return enc, decode_change(
        numel=change.numel,
        width=change.xor.itemsize,
        changed=change.changed if header_changed is None else header_changed,
        positions_chain=list(enc.positions_chain),
        values_chain=list(enc.values_chain),
        positions=enc.positions,
        values=enc.values,
        where="test",
    )


@settings(max_examples=60, deadline=None)
@given(
    st.sampled_from(DTYPES),
    st.lists(st.integers(0, 70), min_size=0, max_size=3),
    st.sampled_from([0.0, 0.001, 0.02, 0.2, 0.3, 0.9, 1.0]),
    st.integers(0, 2**31),
)
def test_roundtrip_any_dtype_shape_density(dtype, shape, density, seed):
    g = torch.Generator().manual_seed(seed)
    old = (torch.randn(shape, generator=g) * 4).to(dtype)
    new = perturb(old, density, g)
    snap = Snapshot({"t": old})
    (change,) = snap.diff({"t": new})
    enc, (pos, xor) = roundtrip(change)
    dense = np.zeros(change.numel, change.xor.dtype)
    dense[change.positions] = change.xor
    if pos is None:
        assert enc.positions_chain == ("dense",)
        assert np.array_equal(xor, dense)
    else:
        assert np.array_equal(pos, change.positions) and np.array_equal(xor, change.xor)


def test_gap16_escapes_long_gaps():
    pos = np.array([0, 1, 65535, 65536, 65536 + 65535 * 3 + 7, 10**9], np.int64)
    enc = gap16_encode(pos)
    entries = enc.size // 2
    lo, hi = enc[:entries].astype(np.int64), enc[entries:].astype(np.int64)
    assert ((lo | hi << 8) == 0).sum() == 65535 * 0 + (65535 * 3 + 6) // 65535 + (10**9 - pos[-2] - 1) // 65535
    assert np.array_equal(gap16_decode(enc, 10), pos)
    # the layout of docs/FORMAT.md: gaps p0+1, p_k - p_(k-1), escapes as 0
    gaps = (lo | hi << 8)[:4]
    assert gaps.tolist() == [1, 1, 65534, 1]


def test_compression_at_rl_density():
    g = torch.Generator().manual_seed(0)
    master = torch.randn(2_000_000, generator=g) * 0.02
    old = master.bfloat16()
    new = (master + torch.randn(2_000_000, generator=g) * 7e-7).bfloat16()
    (change,) = Snapshot({"w": old}).diff({"w": new})
    assert 0.01 < change.changed / change.numel < 0.04
    enc = encode_change(change)
    assert enc.nbytes / change.changed < 1.6
    assert enc.positions_chain == ("gap16", "shuffle", "zstd")


def _change(n=1000, k=50):  # 46 changed with this seed
    g = torch.Generator().manual_seed(1)
    old = torch.randn(n, generator=g).bfloat16()
    (c,) = Snapshot({"t": old}).diff({"t": perturb(old, k / n, g, finite=False)})  # any bits: a codec's input
    return c


def test_count_mismatch_is_reported():
    c = _change()
    with pytest.raises(FormatError, match="expected 47 values|header says"):
        roundtrip(c, header_changed=c.changed + 1)


def test_corrupt_zstd_frame_is_reported():
    c = _change(100_000, 5000)
    enc = encode_change(c)
    assert "zstd" in enc.positions_chain
    bad = bytearray(enc.positions)
    bad[len(bad) // 2] ^= 0xFF
    with pytest.raises(FormatError, match="step 3 tensor 't' positions"):
        decode_change(
            numel=c.numel, width=2, changed=c.changed, positions_chain=list(enc.positions_chain),
            values_chain=list(enc.values_chain), positions=bytes(bad), values=enc.values, where="step 3 tensor 't'",
        )


def test_out_of_range_position_is_reported():
    c = _change()
    enc = encode_change(c)
    with pytest.raises(FormatError, match="out of range"):
        decode_change(
            numel=int(c.positions[-1]), width=2, changed=c.changed, positions_chain=list(enc.positions_chain),
            values_chain=list(enc.values_chain), positions=enc.positions, values=enc.values, where="t",
        )


def test_unknown_codec_is_reported():
    c = _change()
    enc = encode_change(c)
    with pytest.raises(FormatError, match="unknown positions codec"):
        decode_change(
            numel=c.numel, width=2, changed=c.changed, positions_chain=["rle"], values_chain=list(enc.values_chain),
            positions=enc.positions, values=enc.values, where="t",
        )
