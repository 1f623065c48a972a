"""Every stored document has one validating, bounded parser: bad input is a FormatError naming what and where."""

from __future__ import annotations

import json

import numpy as np
import pytest
import zstandard

from deltasync import DeltaPublisher, StreamReader, verify
from deltasync.errors import FormatError, StepNotFoundError
from deltasync.format.codecs import decode_change
from deltasync.format.documents import (
    MAX_DOCUMENT_BYTES,
    ConsumerPosition,
    FilesIndex,
    LatestHint,
    Lease,
    Manifest,
    StepHeader,
    StreamInfo,
    decode,
)
from deltasync.store import Store, step_dir

MANIFEST = {
    "format_version": 1, "step": 12, "base_step": 11, "kind": "delta", "object": "delta.safetensors",
    "object_bytes": 31337, "object_sha256": "a" * 64, "state_checksum": "b" * 64, "created_unix_s": 1.79e9,
    "stats": {"density": 0.021, "changed": 2100, "numel": 100000, "coalesced_steps": [], "capture_s": 0.1},
}
HEADER = {
    "format_version": 1, "kind": "delta", "step": 12, "base_step": 11, "checksum_algorithm": "mix64-sum",
    "state_checksum": "c" * 64, "aliases": {"lm_head.weight": "embed.weight"},
    "tensors": {
        "embed.weight": {"dtype": "BF16", "shape": [128, 384], "changed": 10, "checksum": "0x" + "1" * 16,
                         "positions": ["gap16", "shuffle", "zstd"], "values": ["xor", "shuffle", "zstd"]},
        "norm.weight": {"dtype": "F32", "shape": [3], "changed": 0, "checksum": "0x" + "2" * 16},
    },
}


def _edit(doc: dict, path: str, value) -> bytes:
    d = json.loads(json.dumps(doc))
    *keys, last = path.split(".")
    node = d
    for k in keys:
        node = node[k]
    if value is _DELETE:
        del node[last]
    else:
        node[last] = value
    return json.dumps(d).encode()


_DELETE = object()


def test_good_documents_round_trip():
    m = decode(json.dumps(MANIFEST), Manifest, where="m")
    assert m.step == 12 and m.stats.changed == 2100 and decode(m.to_json(), Manifest, where="again") == m
    h = StepHeader.from_json(json.dumps(HEADER), where="h")
    assert h.tensors["norm.weight"].numel == 3 and StepHeader.from_json(h.to_json(), where="again") == h
    for kind, doc in [(LatestHint, {"step": 3}), (StreamInfo, {"format_version": 1, "created_unix_s": 1.0}),
                      (Lease, {"owner": "host-1-ab", "expires_unix_s": 5.0}),
                      (ConsumerPosition, {"consumer_id": "rollout-0", "step": 4, "updated_unix_s": 2.0}),
                      (FilesIndex, {"format_version": 1, "files": {"config.json": {"bytes": 3, "sha256": "d" * 64}}})]:
        assert decode(json.dumps(doc), kind, where="x")


@pytest.mark.parametrize(
    "data, message",
    [
        # the review's cases: a bit flip making base_step == step (verify looped forever)
        (_edit(MANIFEST, "base_step", 12), "base step must be an integer below its step 12"),
        (b'{"step": \xff\xfe}', "not valid JSON"),  # invalid UTF-8
        (_edit(MANIFEST, "step", "12"), r"Expected `int`, got `str` - at `\$.step`"),
        (_edit(MANIFEST, "step", True), r"Expected `int`, got `bool`"),
        (json.dumps(MANIFEST).replace('"step": 12', '"step": 1e400').encode(), r"\$.step"),
        (json.dumps(MANIFEST).replace('"step": 12', '"step": ' + "9" * 5000).encode(), r"\$.step"),
        (_edit(MANIFEST, "step", 10**12), r"\$.step"),  # past the 12-digit layout
        (_edit(MANIFEST, "step", -1), r"\$.step"),
        (b"[" * 100_000 + b"]" * 100_000, "Expected `object`"),
        (_edit(MANIFEST, "stats", {"x": [[[[[[1]]]]]]}), None),  # unknown stats keys are ignored, not parsed deeply
        (_edit(MANIFEST, "stats", []), r"\$.stats"),
        (_edit(MANIFEST, "object", "../../F.safetensors"), r"\$.object"),  # path traversal
        (_edit(MANIFEST, "object", "x/../../F.safetensors"), r"\$.object"),
        (_edit(MANIFEST, "object", "/abs.safetensors"), r"\$.object"),
        (_edit(MANIFEST, "object_bytes", 2**60), r"\$.object_bytes"),
        (_edit(MANIFEST, "object_sha256", "zz"), r"\$.object_sha256"),
        (_edit(MANIFEST, "kind", _DELETE), "missing required field `kind`"),
        (_edit(MANIFEST, "format_version", 2), r"\$.format_version"),
        (b"x" * (MAX_DOCUMENT_BYTES + 1), "expected a document of at most"),
        # an anchor's own delta (docs/FORMAT.md section 5): only on an anchor, from a step below it, its own name
        (_edit(MANIFEST, "delta", {"base_step": 11, "object": "delta-a.safetensors", "object_bytes": 9,
                                   "object_sha256": "a" * 64}), "only an anchor step of one object carries its delta"),
        (json.dumps({**MANIFEST, "kind": "anchor", "base_step": None, "delta": {
            "base_step": 12, "object": "delta-a.safetensors", "object_bytes": 9, "object_sha256": "a" * 64}}).encode(),
         "delta.base_step 12 is not below the step 12"),
        (json.dumps({**MANIFEST, "kind": "anchor", "base_step": None, "delta": {
            "base_step": 3, "object": MANIFEST["object"], "object_bytes": 9, "object_sha256": "a" * 64}}).encode(),
         "names the anchor's own object"),
        (json.dumps({**MANIFEST, "kind": "anchor", "base_step": None, "delta": {
            "base_step": 3, "object": "../x.safetensors", "object_bytes": 9, "object_sha256": "a" * 64}}).encode(),
         r"\$.delta.object"),
    ],
)
def test_bad_manifests_are_format_errors(data, message):
    if message is None:
        assert decode(data, Manifest, where="steps/000000000012/manifest.json").step == 12
        return
    with pytest.raises(FormatError, match=message) as e:
        decode(data, Manifest, where="steps/000000000012/manifest.json")
    assert "steps/000000000012/manifest.json" in str(e.value)


@pytest.mark.parametrize(
    "data, message",
    [
        (_edit(HEADER, "tensors", [1, 2]), r"\$.tensors"),  # non-dict tensors (AttributeError before)
        (_edit(HEADER, "tensors.embed\u2024weight", {}), None),
        (_edit(HEADER, "base_step", 12), "base step"),
        (_edit(HEADER, "aliases", {"lm_head.weight": "nope"}), "alias"),
        (json.dumps(HEADER).replace('[128, 384]', '[32768, 32768, 32768]').encode(), "elements, at most"),  # 2**45
        (json.dumps(HEADER).replace('"changed": 10', '"changed": 10000000').encode(),
         "changed elements in a tensor of"),
        (json.dumps(HEADER).replace('"shuffle", "zstd"]', '"rot13"]', 1).encode(), "'embed.weight'.*positions"),
        (json.dumps(HEADER).replace('"BF16"', '"F12"').encode(), "'embed.weight'.*dtype"),
        (json.dumps(HEADER).replace('"positions": ["gap16", "shuffle", "zstd"], ', "").encode(), "come together"),
        # a step header is version 1, or 2 for a part, whatever its manifest's (3 names the manifest's digest:
        # docs/FORMAT.md section 1b): the manifest's version is no header's
        (_edit(HEADER, "format_version", 3), r"Invalid enum value 3 - at `\$.format_version`"),
    ],
)
def test_bad_step_headers_are_format_errors(data, message):
    if message is None:
        return
    with pytest.raises(FormatError, match=message):
        StepHeader.from_json(data, where="step 12")


def _frame_claiming(size: int) -> bytes:
    """A 19-byte zstd frame whose header claims ``size`` bytes of content (and holds nothing)."""
    return b"\x28\xb5\x2f\xfd" + bytes([0xE4]) + size.to_bytes(8, "little") + b"\x01\x00\x00" + b"\x00" * 3


def test_decompression_is_bounded_by_the_header_not_the_frame():
    kw = dict(numel=1000, width=2, changed=10, positions_chain=["gap16", "shuffle"], where="t")
    # a 19-byte frame claiming 1 TiB: refused before any allocation (MemoryError before)
    with pytest.raises(FormatError, match="claims 1099511627776 bytes"):
        decode_change(values_chain=["xor", "shuffle", "zstd"], positions=b"\x01\x00" * 10,
                      values=_frame_claiming(1 << 40), **kw)
    # a small frame that really expands to 1 GB, without a size claim: stopped at the 20 bytes the header allows
    bomb = zstandard.ZstdCompressor(level=19, write_content_size=False).compress(b"\0" * (64 << 20))
    assert len(bomb) < 64 << 10
    with pytest.raises(FormatError, match="values"):
        decode_change(values_chain=["xor", "shuffle", "zstd"], positions=b"\x01\x00" * 10, values=bomb, **kw)
    # positions: at most what `changed` and the tensor's size allow
    with pytest.raises(FormatError, match="positions"):
        decode_change(numel=1000, width=2, changed=10, positions_chain=["gap16", "shuffle", "zstd"],
                      values_chain=["xor"],
                      positions=bomb, values=b"\x01\x00" * 10, where="t")
    # a header claiming far more than a frame of this size can hold is refused before decompressing
    with pytest.raises(FormatError, match="cannot hold"):
        decode_change(numel=1 << 40, width=2, changed=0, positions_chain=["dense"], values_chain=["xor", "zstd"],
                      positions=None, values=b"\x28\xb5\x2f\xfd" + b"\0" * 20, where="t")


def test_decoding_still_works_on_honest_frames():
    rng = np.random.default_rng(0)
    pos = np.sort(rng.choice(5000, 50, replace=False)).astype(np.int64)
    xor = rng.integers(1, 1 << 16, 50).astype(np.uint16)
    from deltasync.format.codecs import encode_patch
    from deltasync.format.patch import Patch

    enc = encode_patch(Patch(name="t", dtype="BF16", shape=(5000,), positions=pos, xor=xor, checksum=0))
    got_pos, got_xor = decode_change(numel=5000, width=2, changed=50, positions_chain=list(enc.positions_chain),
                                     values_chain=list(enc.values_chain), positions=enc.positions, values=enc.values,
                                     where="t")
    assert np.array_equal(got_pos, pos) and np.array_equal(got_xor, xor)


def _publish(url, state, steps=3):
    import torch

    with DeltaPublisher(url, state, on_backlog="block") as pub:
        for s in range(steps):
            for t in state.values():
                flat = t.reshape(-1).view(torch.uint8)
                if flat.numel() > s:
                    flat[s] ^= 1
            pub.publish(s)


def test_a_manifest_bit_flip_cannot_make_verify_loop(tmp_path, small_state):
    """``base_step == step`` in a manifest made verify and replay walk the chain forever."""
    url = str(tmp_path / "s")
    _publish(url, small_state)
    path = tmp_path / "s" / step_dir(2) / "manifest.json"
    path.write_bytes(path.read_bytes().replace(b'"base_step": 1', b'"base_step": 2'))
    report = verify(url)
    assert not report.ok and report.problems[0].step == 2 and "base step" in report.problems[0].message
    with pytest.raises(FormatError, match="base step"):
        StreamReader(url).state_dict(2)


def test_steps_past_the_layout_are_refused_at_publish(tmp_path, small_state):
    from deltasync.errors import StepOrderError

    with DeltaPublisher(str(tmp_path / "s"), small_state) as pub:
        with pytest.raises(StepOrderError, match="0..999999999999"):
            pub.publish(10**12)
        pub.publish(10**12 - 1)  # the last step the layout holds
    assert Store(str(tmp_path / "s")).steps() == [10**12 - 1]


def test_stream_json_tells_no_stream_from_no_steps(tmp_path, small_state):
    empty = Store(str(tmp_path / "nothing"))
    assert empty.stream_info() is None
    with DeltaPublisher(str(tmp_path / "s"), small_state):
        pass  # created, nothing published
    store = Store(str(tmp_path / "s"))
    assert store.stream_info() is not None and store.steps() == []
    assert json.loads((tmp_path / "s" / "stream.json").read_text())["format_version"] == 1
    with pytest.raises(StepNotFoundError):
        StreamReader(str(tmp_path / "s")).state_dict()


@pytest.mark.parametrize("kind, doc", [
    (ConsumerPosition, {"consumer_id": "c1\n", "step": 4, "updated_unix_s": 2.0}),
    (FilesIndex, {"format_version": 1, "files": {"config.json\n": {"bytes": 3, "sha256": "d" * 64}}}),
    (FilesIndex, {"format_version": 1, "files": {"config.json": {"bytes": 3, "sha256": "d" * 64 + "\n"}}}),
    (Manifest, {**MANIFEST, "object": "delta.safetensors\n"}),
    (Manifest, {**MANIFEST, "object_sha256": "a" * 64 + "\n"}),
])
def test_names_match_whole_not_up_to_a_trailing_newline(kind, doc):
    """(issue 19, item 11) "$" alone matches before a trailing newline: every name from outside matches whole."""
    with pytest.raises(FormatError):
        decode(json.dumps(doc), kind, where="x")


def test_one_validator_for_names_from_outside():
    from deltasync.follow.consumers import check_consumer_id
    from deltasync.format.names import CONSUMER_ID, PEER_NAME, check

    assert check(CONSUMER_ID, "rollout-0") and check(PEER_NAME, "trainer-0:a")
    for bad in ("c1\n", "\nc1", "c1 ", "", ".hidden", "a/b", None, 3):
        assert not check(CONSUMER_ID, bad)
        with pytest.raises(FormatError, match="consumer id"):
            check_consumer_id(bad)  # type: ignore[arg-type]


CATCHUP_V2 = {
    "format_version": 2, "digest": "blake3", "kind": "catchup", "step": 8, "base_step": 4,
    "object": "catchup-abababababababab.safetensors", "object_bytes": 100, "object_digest": "blake3:" + "ab" * 32,
    "state_checksum": "0" * 64, "base_state_checksum": "1" * 64, "created_unix_s": 1.0,
}


@pytest.mark.parametrize(("edit", "message"), [
    (lambda c: {k: v for k, v in c.items() if k != "digest"},
     r"\$.digest: catch-up manifest format version 2 names its digest, expected one of blake3, got none"),
    (lambda c: {**c, "digest": "sha256", "object_digest": "sha256:" + "ab" * 32},
     r"\$.digest: catch-up manifest format version 2 names 'sha256'; SHA-256 catch-ups are format version 1"),
    (lambda c: {**c, "format_version": 1},
     r"\$.digest: catch-up manifest format version 1 digests with SHA-256 and names no digest, got 'blake3' "
     r"\(version 2 names its digest\)"),
    (lambda c: {**{k: v for k, v in c.items() if k not in ("digest", "object_digest")}, "format_version": 1},
     r"\$.object_sha256: catch-up manifest format version 1 names each object's SHA-256 \(object_sha256\), got "
     r"neither object_sha256 nor object_digest"),
    (lambda c: {k: v for k, v in c.items() if k != "object_digest"},
     r"\$.object_digest: catch-up manifest format version 2 names each object's blake3 digest \(object_digest\), "
     r"got neither object_sha256 nor object_digest"),
])
def test_a_catchup_manifest_naming_its_digest_wrongly_names_its_own_version(edit, message):
    """A catch-up manifest's versions are 1 (SHA-256) and 2 (names its digest: docs/FORMAT.md section 5g); an error
    names those, never the step manifest's version 3, and says what arrived (nothing, where nothing did)."""
    from deltasync.format.documents import CatchupManifest

    decode(json.dumps(CATCHUP_V2), CatchupManifest, where="c")  # the unedited one is valid
    with pytest.raises(FormatError, match=message):
        decode(json.dumps(edit(CATCHUP_V2)), CatchupManifest, where="c")


def test_a_step_manifest_naming_no_digest_at_all_says_so():
    no_digest = {k: v for k, v in MANIFEST.items() if k != "object_sha256"}
    with pytest.raises(FormatError, match=r"\$.object_sha256: format version 1 names each object's SHA-256 "
                                          r"\(object_sha256\), got neither object_sha256 nor object_digest"):
        Manifest.from_json(json.dumps(no_digest), where="m")


def test_an_object_whose_header_says_version_3_is_refused(tmp_path, small_state):
    """A real stream's object rewritten (its manifest agreeing, as a bucket writer of an unsigned stream can) with a
    step header of version 3, which only manifests have: refused by name, not read as a version-1 header."""
    from tests.damage import rewrite_header

    url = str(tmp_path / "s")
    with DeltaPublisher(url, small_state, on_backlog="block") as pub:
        pub.publish(0)
        next(iter(small_state.values())).view(-1)[0] += 1
        pub.publish(1)
    rewrite_header(Store(url), 1, lambda h: h.update(format_version=3))
    with pytest.raises(FormatError, match=r"step 1 .*step header: invalid _RawStepHeader: Invalid enum value 3 - at "
                                          r"`\$.format_version`"):
        StreamReader(url).state_dict(1)
