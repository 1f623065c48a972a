"""The decoder that scatters as it decodes (``StepObject.packed``, ``xor_apply_packed``): bit-exact against a reader
written here from docs/FORMAT.md section 3 in plain NumPy (gaps -> cumsum -> positions -> XOR), its checksum change
against section 4's reference, and every malformed stream refused with a ``FormatError`` before a bit is written.

The streams are built here by hand from the spec (escape entries, byte shuffle, zstd), not by the encoder under test.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import zstandard

from deltasync.errors import FormatError, TensorMismatchError
from deltasync.format import _kernels
from deltasync.format._bits import np_bits
from deltasync.format.checksum import MASK64, tensor_checksum
from deltasync.format.codecs import DecodeScratch, decode_change, decode_packed
from deltasync.format.documents import TensorHeader
from deltasync.format.objects import StepObject
from deltasync.publish.steps import snapshot_headers, write_step
from deltasync.stages.apply import Replica, xor_apply_packed
from deltasync.stages.diff import Snapshot
from tests.conftest import states_equal
from tests.test_reference import ref_checksum

DTYPES = {  # torch dtype, safetensors name, unsigned view
    "bf16": (torch.bfloat16, "BF16", np.uint16), "fp16": (torch.float16, "F16", np.uint16),
    "fp32": (torch.float32, "F32", np.uint32), "fp64": (torch.float64, "F64", np.uint64),
    "fp8": (torch.float8_e4m3fn, "F8_E4M3", np.uint8), "int8": (torch.int8, "I8", np.uint8),
    "int16": (torch.int16, "I16", np.uint16), "int32": (torch.int32, "I32", np.uint32),
    "int64": (torch.int64, "I64", np.uint64), "uint8": (torch.uint8, "U8", np.uint8),
}


# --- the spec, written plainly ---

def spec_entries(positions: np.ndarray) -> np.ndarray:
    """gap16: d_0 = p_0 + 1, d_k = p_k - p_(k-1); a gap over 65535 is q escape entries 0 then d - 65535 q."""
    out: list[int] = []
    prev = -1
    for p in positions.tolist():
        d = p - prev
        q = (d - 1) // 65535
        out += [0] * q + [d - 65535 * q]
        prev = p
    return np.array(out, np.uint16)


def spec_positions(entries: np.ndarray) -> np.ndarray:
    """decode: step = e if e != 0 else 65535, p = cumsum(step) - 1 at entries != 0."""
    e = entries.astype(np.int64)
    return (np.cumsum(np.where(e == 0, 65535, e)) - 1)[e != 0]


def shuffle(a: np.ndarray) -> bytes:
    """Byte k of every element, for k = 0 .. width-1 (little-endian), concatenated."""
    return a.view(np.uint8).reshape(a.size, a.itemsize).T.tobytes()


def zstd(b: bytes) -> bytes:
    return zstandard.ZstdCompressor(level=1, write_content_size=True).compress(b)


def header(name: str, numel: int, changed: int, checksum: int = 0, *, zstd_: bool = True,
           start: int | None = None, total: int | None = None) -> TensorHeader:
    tail = ("shuffle", "zstd") if zstd_ else ("shuffle",)
    rng = None if start is None else (start, start + numel)
    return TensorHeader(dtype=DTYPES[name][1], shape=(numel if total is None else total,), changed=changed,
                        checksum=f"0x{checksum & MASK64:016x}", positions=("gap16", *tail), values=("xor", *tail),
                        range=rng)


def packed_of(name: str, numel: int, positions: np.ndarray, xor: np.ndarray, *, entries: np.ndarray | None = None,
              changed: int | None = None, zstd_: bool = True, start: int | None = None, total: int | None = None):
    entries = spec_entries(positions) if entries is None else entries
    pos_bytes, val_bytes = shuffle(entries), shuffle(xor)
    if zstd_:
        pos_bytes, val_bytes = zstd(pos_bytes), zstd(val_bytes)
    h = header(name, numel, positions.size if changed is None else changed, zstd_=zstd_, start=start, total=total)
    return decode_packed("t", h, positions=pos_bytes, values=val_bytes, where="test tensor 't'")


def random_case(name: str, numel: int, positions: np.ndarray, seed: int):
    torch_dtype, _, unsigned = DTYPES[name]
    rng = np.random.default_rng(seed)
    width = np.dtype(unsigned).itemsize
    before = rng.integers(0, 256, numel * width, dtype=np.uint8).view(unsigned)
    xor = rng.integers(0, 256, positions.size * width, dtype=np.uint8).view(unsigned)
    xor[xor == 0] = 1  # a listed element changes
    t = torch.from_numpy(before.copy()).view(torch_dtype)
    return t, before, xor


def spec_apply(before: np.ndarray, positions: np.ndarray, xor: np.ndarray) -> np.ndarray:
    after = before.copy()
    after[positions] ^= xor
    return after


def escape_positions(numel: int) -> np.ndarray:
    """Gaps of every kind: 1, 65535 (the largest without escape), 65536 (one escape, remainder 1), 2 * 65535
    (one escape, remainder 65535) and a run of four escapes, ending at the last element."""
    pos = [0, 1, 65536, 65536 + 65536, 65536 + 65536 + 2 * 65535, 65536 * 2 + 2 * 65535 + 4 * 65535 + 7, numel - 1]
    return np.array(sorted(set(pos)), np.int64)


@pytest.mark.parametrize("name", sorted(DTYPES))
@pytest.mark.parametrize("kind", ["sparse", "escapes", "dense-chain", "one"])
def test_scatter_matches_the_spec_reader(name, kind):
    numel = 700_000 if kind == "escapes" else 50_000
    rng = np.random.default_rng(len(name) + len(kind))
    positions = {
        "sparse": np.sort(rng.choice(numel, 1000, replace=False)),
        "escapes": escape_positions(numel),
        "dense-chain": np.arange(100, 20_100, dtype=np.int64),  # every gap 1: a run of neighbours
        "one": np.array([numel - 1], np.int64),
    }[kind].astype(np.int64)
    assert np.array_equal(spec_positions(spec_entries(positions)), positions)
    t, before, xor = random_case(name, numel, positions, seed=7)
    packed = packed_of(name, numel, positions, xor)
    assert np.array_equal(packed.unpack().positions, positions)  # the positions path still decodes the same
    change = xor_apply_packed(t, packed)
    after = spec_apply(before, positions, xor)
    assert np.array_equal(np_bits(t), after)
    assert change == (ref_checksum(after) - ref_checksum(before)) & MASK64
    assert change == (tensor_checksum(t) - tensor_checksum(torch.from_numpy(before).view(t.dtype))) & MASK64
    assert xor_apply_packed(t, packed, checksum=False) == 0  # XOR again: back to the exact bits
    assert np.array_equal(np_bits(t), before)


@pytest.mark.parametrize("parallel", [False, True])
def test_blocks_split_across_threads_match(parallel):
    """More entries than one block (``GAP16_BLOCK``), escapes inside later blocks: each block starts where
    ``gap16_check`` said, on either compilation."""
    numel = 3_000_000
    rng = np.random.default_rng(3)
    positions = np.unique(np.concatenate([rng.choice(1_000_000, 90_000, replace=False),
                                          [1_500_000, 1_800_000, numel - 1]])).astype(np.int64)
    t, before, xor = random_case("bf16", numel, positions, seed=4)
    packed = packed_of("bf16", numel, positions, xor)
    assert packed.starts is not None and packed.starts.shape[0] > 3
    change = _kernels.gap16_xor(np_bits(t), packed.entries, packed.planes, packed.starts, 0, parallel=parallel)
    after = spec_apply(before, positions, xor)
    assert np.array_equal(np_bits(t), after)
    assert int(change) == (ref_checksum(after) - ref_checksum(before)) & MASK64


def test_one_scratch_decodes_tensor_after_tensor():
    """A ``DecodeScratch`` is reused from one tensor to the next (each written before the next is decoded), and
    grows when a larger one comes: every tensor still lands bit-exact."""
    scratch = DecodeScratch()
    rng = np.random.default_rng(9)
    for numel, count in ((5000, 40), (200_000, 9000), (3000, 10), (400_000, 30_000)):
        positions = np.sort(rng.choice(numel, count, replace=False)).astype(np.int64)
        t, before, xor = random_case("fp16", numel, positions, seed=count)
        h = header("fp16", numel, count)
        packed = decode_packed("t", h, positions=zstd(shuffle(spec_entries(positions))), values=zstd(shuffle(xor)),
                               where="t", scratch=scratch)
        change = xor_apply_packed(t, packed)
        after = spec_apply(before, positions, xor)
        assert np.array_equal(np_bits(t), after)
        assert change == (ref_checksum(after) - ref_checksum(before)) & MASK64


def test_empty_change_writes_nothing():
    t, before, xor = random_case("bf16", 1000, np.empty(0, np.int64), seed=1)
    packed = packed_of("bf16", 1000, np.empty(0, np.int64), xor, zstd_=False)
    assert xor_apply_packed(t, packed) == 0
    assert np.array_equal(np_bits(t), before)


def test_a_part_hashes_global_indices():
    """A part (docs/FORMAT.md section 5b) lists positions relative to its start; its checksum change hashes the
    full tensor's indices, so the slice's change equals the whole tensor's."""
    total, start, count = 200_000, 70_001, 80_000
    rng = np.random.default_rng(5)
    rel = np.sort(rng.choice(count, 3000, replace=False)).astype(np.int64)
    full, before, _ = random_case("fp32", total, np.empty(0, np.int64), seed=6)
    xor = rng.integers(1, 2**32, rel.size, dtype=np.uint64).astype(np.uint32)
    packed = packed_of("fp32", count, rel, xor, start=start, total=total)
    assert packed.shape == (count,)
    change = xor_apply_packed(full[start : start + count], packed, base=start)
    after = spec_apply(before, rel + start, xor)
    assert np.array_equal(np_bits(full), after)
    assert change == (ref_checksum(after) - ref_checksum(before)) & MASK64
    idx = np.arange(start, start + count)
    assert change == (ref_checksum(after[start : start + count], idx)
                      - ref_checksum(before[start : start + count], idx)) & MASK64


# --- malformed streams: refused while decoding, before any write ---

def _bad(kind: str):
    numel = 300_000
    positions = np.array([3, 70_000, 200_000], np.int64)
    xor = np.array([1, 2, 3], np.uint16)
    entries = spec_entries(positions)
    if kind == "past the end":
        entries = spec_entries(np.array([3, 70_000, numel], np.int64))
    elif kind == "escape run past the end":
        entries = np.concatenate([entries[:-1], np.zeros(3, np.uint16), [40_000]]).astype(np.uint16)
    elif kind == "escape run over the bound":  # more entries than changed + numel // 65535 + 1 can need
        entries = np.concatenate([entries[:-1], np.zeros(4, np.uint16), [5]]).astype(np.uint16)
    elif kind == "escape run running off":
        entries = np.concatenate([entries, np.zeros(2, np.uint16)]).astype(np.uint16)
    elif kind == "truncated":
        entries = entries[:-1]
    elif kind == "too many":
        entries = np.concatenate([entries, [1]]).astype(np.uint16)
    elif kind == "zero value":
        xor = np.array([1, 0, 3], np.uint16)
    return numel, positions, xor, entries


@pytest.mark.parametrize("kind, match", [
    ("past the end", "out of range"), ("escape run past the end", "out of range"),
    ("escape run running off", "escape"), ("escape run over the bound", "at most 16"),
    ("truncated", "positions list 2"), ("too many", "positions list 4"),
    ("zero value", "change nothing"),
])
def test_malformed_positions_are_refused(kind, match):
    numel, positions, xor, entries = _bad(kind)
    with pytest.raises(FormatError, match=match):
        packed_of("bf16", numel, positions, xor, entries=entries)


@pytest.mark.parametrize("scratch", [None, "scratch"])
def test_truncated_frames_and_odd_bytes_are_refused(scratch):
    numel, positions, xor, entries = _bad("none")
    h = header("bf16", numel, positions.size)
    pos, val = zstd(shuffle(entries)), zstd(shuffle(xor))
    kw = {"scratch": DecodeScratch() if scratch else None}
    with pytest.raises(FormatError, match="positions"):
        decode_packed("t", h, positions=pos[:-3], values=val, where="t", **kw)
    with pytest.raises(FormatError, match="values"):
        decode_packed("t", h, positions=pos, values=val[:-1], where="t", **kw)
    checked = zstandard.ZstdCompressor(level=1, write_checksum=True, write_content_size=True).compress(shuffle(xor))
    with pytest.raises(FormatError, match="values"):  # the frame's own checksum is checked, decoded into scratch too
        decode_packed("t", h, positions=pos, values=checked[:-1] + bytes([checked[-1] ^ 1]), where="t", **kw)
    raw = header("bf16", numel, positions.size, zstd_=False)
    with pytest.raises(FormatError, match="odd number"):
        decode_packed("t", raw, positions=shuffle(entries) + b"\0", values=shuffle(xor), where="t")


@pytest.mark.parametrize("damage, match", [
    (lambda f: f + b"garbage", r"values: 7 bytes follow the zstd frame \(it ends at byte \d+ of \d+\), expected none"),
    (lambda f: f + f, r"values: \d+ bytes follow the zstd frame"),  # a second, valid frame is refused too
    (lambda f: f[:-2], r"values: the zstd frame is cut short"),  # in its checksum: the stream reader took it
])
def test_every_decode_path_refuses_a_frame_that_does_not_end_the_blob(damage, match):
    """The fresh-buffer decode, the scratch decode (replicas, replay) and decode_change read one blob alike: a
    zstd blob is exactly one frame (docs/FORMAT.md section 3), so bytes after it or a frame cut short are one
    FormatError naming the tensor, whichever path reads it."""
    numel, positions, xor, entries = _bad("none")
    h = header("bf16", numel, positions.size)
    pos = zstd(shuffle(entries))
    frame = zstandard.ZstdCompressor(level=1, write_checksum=True, write_content_size=True).compress(shuffle(xor))
    assert decode_packed("t", h, positions=pos, values=frame, where="t").changed == positions.size  # undamaged
    bad = damage(frame)
    messages = []
    for scratch in (None, DecodeScratch()):
        with pytest.raises(FormatError, match=match) as e:
            decode_packed("t", h, positions=pos, values=bad, where="step 3 tensor 't'", scratch=scratch)
        messages.append(str(e.value))
    with pytest.raises(FormatError, match=match) as e:
        decode_change(numel=numel, width=2, changed=positions.size, positions_chain=list(h.positions or ()),
                      values_chain=list(h.values or ()), positions=pos, values=bad, where="step 3 tensor 't'")
    messages.append(str(e.value))
    assert len(set(messages)) == 1 and messages[0].startswith("step 3 tensor 't' values: ")


def test_a_tensor_of_another_size_is_refused_untouched():
    positions = np.array([1, 5], np.int64)
    t, before, xor = random_case("bf16", 10, positions, seed=2)
    packed = packed_of("bf16", 10, positions, xor)
    smaller = t[:8].clone()
    with pytest.raises(TensorMismatchError, match="10 elements"):
        xor_apply_packed(smaller, packed)
    assert np.array_equal(np_bits(smaller), before[:8])
    with pytest.raises(TensorMismatchError, match="16 bits"):
        xor_apply_packed(torch.zeros(10, dtype=torch.float32), packed)


def test_a_replica_refuses_a_bad_position_and_keeps_every_bit(tmp_path):
    """A real delta whose last-written tensor lists a position past its end: the replica raises the decoder's
    ``FormatError`` and every tensor (those already scattered included) holds its exact previous bits."""
    import safetensors
    import safetensors.torch

    g = torch.Generator().manual_seed(0)
    state = {f"w{i}": torch.randn(4000 * (i + 1), generator=g).bfloat16() for i in range(4)}
    snap = Snapshot(state)
    write_step(tmp_path / "0", kind="anchor", step=0, base_step=None, headers=snapshot_headers(snap),
               anchor_tensors=state)
    new = {n: t.clone() for n, t in state.items()}
    for t in new.values():
        t[::50] += 1
    changes = [c for c in snap.diff(new) if c.changed]
    write_step(tmp_path / "1", kind="delta", step=1, base_step=0, headers=snapshot_headers(snap), changes=changes)
    smallest = min(changes, key=lambda c: c.changed).name
    with safetensors.safe_open(str(tmp_path / "1"), framework="pt") as f:
        metadata, blobs = dict(f.metadata()), {k: f.get_tensor(k) for k in f.keys()}
    h = StepObject(tmp_path / "1", where="1").header.tensors[smallest]
    assert h.positions is not None and list(h.positions) == ["gap16", "shuffle", "zstd"]
    bad = spec_positions(np.frombuffer(zstandard.ZstdDecompressor().decompress(
        blobs[f"{smallest}:positions"].numpy().tobytes()), np.uint8).reshape(2, -1).T.copy().view(np.uint16)[:, 0])
    bad[-1] = h.numel + 100  # past the end
    blobs[f"{smallest}:positions"] = torch.frombuffer(bytearray(zstd(shuffle(spec_entries(bad)))), dtype=torch.uint8)
    safetensors.torch.save_file(blobs, str(tmp_path / "1"), metadata=metadata)

    rep = Replica.from_anchor(StepObject(tmp_path / "0", where="0"))
    before = {n: t.clone() for n, t in rep.tensors.items()}
    with pytest.raises(FormatError, match="out of range"):
        rep.apply(StepObject(tmp_path / "1", where="1"))
    assert rep.step == 0 and states_equal(rep.state_dict(), before)


def test_replay_blocks_take_every_patch_in_turn():
    """Replay patches a large tensor block by block: each packed patch is decoded as far as each block's end (a
    cursor, escapes included), mixed with patches of positions and a dense one; the bits equal applying each
    patch in turn with the spec's reader."""
    from deltasync.format.patch import Patch
    from deltasync.history.replay import xor_patches

    numel = 700_000
    rng = np.random.default_rng(11)
    t, before, _ = random_case("bf16", numel, np.empty(0, np.int64), seed=12)
    expected = before.copy()
    patches = []
    for k in range(4):
        positions = np.sort(rng.choice(numel, 5000 * (k + 1), replace=False)).astype(np.int64)
        if k == 0:
            positions = escape_positions(numel)  # escapes that cross block ends
        xor = rng.integers(1, 2**16, positions.size, dtype=np.uint64).astype(np.uint16)
        patches.append(packed_of("bf16", numel, positions, xor))
        expected[positions] ^= xor
    positions = np.sort(rng.choice(numel, 777, replace=False)).astype(np.int64)
    xor = rng.integers(1, 2**16, positions.size, dtype=np.uint64).astype(np.uint16)
    patches.append(Patch(name="t", dtype="BF16", shape=(numel,), positions=positions, xor=xor, checksum=0))
    expected[positions] ^= xor
    dense = rng.integers(0, 2**16, numel, dtype=np.uint64).astype(np.uint16)
    patches.append(Patch(name="t", dtype="BF16", shape=(numel,), positions=None, xor=dense, checksum=0))
    expected ^= dense
    xor_patches(t, patches, block_bytes=1 << 13)  # 4096 elements a block: 171 blocks
    assert np.array_equal(np_bits(t), expected)
