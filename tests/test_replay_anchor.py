"""An anchor read once (history/_anchor.py): reconstruct_state_dict hashes a local anchor while it reads it,
and refuses every damage with the same error as the path that hashes each object first (replay_to_folder)."""


import pytest
import torch

from deltasync import StreamReader, replay_to_folder
from deltasync.errors import ChecksumMismatchError, CorruptObjectError, FormatError
from deltasync.history import reconstruct_state_dict
from deltasync.history.replay import Chain
from deltasync.store import Store
from tests.conftest import states_equal
from tests.damage import damage_blob, object_path, rewrite_header, write_manifest_agreeing, wrong_checksum


def both_refuse(url, step, tmp_path, error, match):
    """reconstruct_state_dict (anchor read once) and replay_to_folder (hashed first) raise the same error."""
    with pytest.raises(error, match=match) as fed:
        reconstruct_state_dict(url, step)
    with pytest.raises(error, match=match) as hashed:
        replay_to_folder(url, step, tmp_path / "out")
    assert str(fed.value) == str(hashed.value)


def flip(path, offset):
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x40
    path.write_bytes(bytes(data))


def test_the_anchor_is_fed_and_the_result_exact(qwen_stream):
    reader = StreamReader(qwen_stream.url)
    with Chain.open(reader, 7, read_anchor_once=True) as chain:
        assert chain._feed is not None  # a local anchor: read once, hashed as it lands
        got = dict(chain.tensors())
    assert states_equal({n: got[n] for n in got}, {n: qwen_stream.truth[7][n] for n in got})
    for step in (0, 4, 5, 9):  # an anchor alone (the full load), and chains of 1 to 2 deltas
        assert states_equal(reconstruct_state_dict(qwen_stream.url, step), qwen_stream.truth[step]), step


@pytest.mark.parametrize("where", ["data", "header", "end"])
def test_a_corrupt_anchor_is_named_as_such(stream_copy, tmp_path, where):
    path = object_path(Store(stream_copy), 4)
    size = path.stat().st_size
    flip(path, {"data": size // 2, "header": 40, "end": size - 1}[where])
    both_refuse(stream_copy, 6, tmp_path, CorruptObjectError,
                r"step 4 object anchor-[0-9a-f]{16}\.safetensors: digest blake3:")


def test_a_truncated_anchor_is_named_as_such(stream_copy, tmp_path):
    path = object_path(Store(stream_copy), 4)
    path.write_bytes(path.read_bytes()[:-10])
    both_refuse(stream_copy, 5, tmp_path, CorruptObjectError, "step 4 object anchor-.*bytes, manifest says")


def test_a_corrupt_delta_in_the_middle_of_a_chain(stream_copy, tmp_path):
    store = Store(stream_copy)
    flip(object_path(store, 6), object_path(store, 6).stat().st_size // 2)
    both_refuse(stream_copy, 7, tmp_path, CorruptObjectError,
                r"step 6 object delta-[0-9a-f]{16}\.safetensors: digest blake3:")
    flip(object_path(store, 6), object_path(store, 6).stat().st_size // 2)  # restored
    name = damage_blob(store, 5)  # passes the digest: decoding finds it
    both_refuse(stream_copy, 7, tmp_path, FormatError, f"step 5 tensor '{name}'")


def test_a_lying_anchor_header_fails_its_own_step_only(qwen_stream, stream_copy, tmp_path):
    store = Store(stream_copy)
    rewrite_header(store, 4, wrong_checksum)  # the anchor's header lies about a tensor, consistently
    both_refuse(stream_copy, 4, tmp_path, ChecksumMismatchError,
                "step 4: tensor .* does not match the trainer's checksum")
    # a later step is proven by its own checksums, of the bits returned: the anchor's are not needed
    assert states_equal(reconstruct_state_dict(stream_copy, 6), qwen_stream.truth[6])


def test_anchor_bits_changed_with_a_matching_manifest_fail_the_checksum(stream_copy, tmp_path):
    store = Store(stream_copy)
    path = object_path(store, 8)
    flip(path, path.stat().st_size - 3)  # a tensor's bits (the data buffer ends the file), manifest made to agree
    data = path.read_bytes()
    write_manifest_agreeing(store, 8, data)
    both_refuse(stream_copy, 9, tmp_path, ChecksumMismatchError,
                "step 9: tensor .* does not match the trainer's checksum")


def test_closing_a_chain_early_stops_the_feed(qwen_stream):
    with Chain.open(StreamReader(qwen_stream.url), 6, read_anchor_once=True) as chain:
        feed = chain._feed
        first = next(chain.tensors())
    assert not feed._thread.is_alive() and not feed._tensors
    assert isinstance(first[1], torch.Tensor)


def test_a_remote_anchor_is_hashed_first(qwen_stream):
    reader = StreamReader(qwen_stream.url)
    reader.store.is_local = False  # as a remote store: objects are downloaded into the cache, hashed there
    assert reader.open_unhashed(4) is None
    with Chain.open(reader, 6, read_anchor_once=True) as chain:
        assert chain._feed is None
    assert states_equal(reconstruct_state_dict(reader, 6), qwen_stream.truth[6])
