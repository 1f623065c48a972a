"""Reference runtime fingerprints and replica records (deltasync/fingerprints.py, docs/FORMAT.md section 5f): the
digests as the spec writes them, the reference document signed and checked, hostile documents refused, and
replicas that disagree grouped from their heartbeats."""

from __future__ import annotations

import hashlib
import json

import pytest
import torch

from deltasync import DeltaPublisher
from deltasync.errors import FormatError, SignatureError, UnsignedStepError, UntrustedKeyError
from deltasync.fingerprints import (
    config_key,
    disagreements,
    make_reference,
    rank_digest,
    read_reference,
    reference_path,
    write_reference,
)
from deltasync.follow.consumers import ReplicaRecord, read_heartbeats, write_heartbeat
from deltasync.format.documents import RankFingerprint, TensorPrint
from deltasync.signing import SigningKey, keygen
from deltasync.store import Store
from deltasync.trust import TrustedKeys

CONFIG = {"architectures": "Qwen3MoeForCausalLM", "dtype": "bfloat16", "tensor_parallel_size": 1, "quantization": None}


def _prints(seed: int = 0) -> dict[str, TensorPrint]:
    return {"model.norm.weight": TensorPrint(checksum=f"0x{seed:016x}", dtype="bfloat16", shape=[128]),
            "buffer:rope.cos_sin_cache": TensorPrint(checksum="0x00000000000000ff", dtype="float32", shape=[512, 64]),
            "scale": TensorPrint(checksum="0x0000000000000001", dtype="float32", shape=[])}


def test_the_digests_are_the_ones_the_spec_writes():
    """Written from docs/FORMAT.md section 5f, not from the code: lines sorted by name, shape joined by x."""
    text = ("buffer:rope.cos_sin_cache\tfloat32\t512x64\t0x00000000000000ff\n"
            "model.norm.weight\tbfloat16\t128\t0x0000000000000003\n"
            "scale\tfloat32\t\t0x0000000000000001\n")
    assert rank_digest(_prints(3)) == hashlib.sha256(text.encode()).hexdigest()
    canonical = json.dumps(CONFIG, sort_keys=True, separators=(",", ":")).encode()
    assert config_key(CONFIG) == hashlib.sha256(canonical).hexdigest()[:16]
    ref = make_reference(4, CONFIG, [RankFingerprint(digest="0" * 64, tensors=_prints(3))])
    one = f"0\t{rank_digest(_prints(3))}\n"
    assert ref.fingerprint == hashlib.sha256(one.encode()).hexdigest()  # the rank digest recomputed, not believed


@pytest.fixture
def stream(tmp_path):
    url = str(tmp_path / "stream")
    private, public = keygen(str(tmp_path / "trainer.key"))
    keygen(str(tmp_path / "other.key"))
    with DeltaPublisher(url, {"w": torch.zeros(8)}, signing_key=private, stream_id="run-7") as pub:
        pub.publish(0)
    return url, private, public, str(tmp_path / "other.key")


def test_a_signed_reference_is_read_back_and_a_trusted_reader_refuses_what_it_cannot_trust(stream):
    url, private, public, other = stream
    trust = TrustedKeys.load([public], stream_id="run-7")
    ref = make_reference(0, CONFIG, [RankFingerprint(digest="0" * 64, tensors=_prints())], made_by="test")
    with Store(url) as store:
        assert read_reference(store, ref.config_key, 0, trusted=trust) is None  # none yet: nothing to compare
        write_reference(store, ref)  # unsigned
        assert read_reference(store, ref.config_key, 0, trusted=None) == ref
        with pytest.raises(UnsignedStepError, match="not signed"):
            read_reference(store, ref.config_key, 0, trusted=trust)
        write_reference(store, ref, signing_key=SigningKey(other), stream_id="run-7")
        with pytest.raises(UntrustedKeyError):
            read_reference(store, ref.config_key, 0, trusted=trust)
        write_reference(store, ref, signing_key=SigningKey(private), stream_id="run-7")
        assert read_reference(store, ref.config_key, 0, trusted=trust) == ref
        # a bucket writer swaps the document under the signature: refused, never compared
        forged = make_reference(0, CONFIG, [RankFingerprint(digest="0" * 64, tensors=_prints(9))])
        store.write_bytes(reference_path(ref.config_key, 0), json.dumps(forged.__dict__ | {
            "ranks": [{"digest": r.digest, "tensors": {n: t.__dict__ for n, t in r.tensors.items()}, "opaque": []}
                      for r in forged.ranks]}).encode())
        with pytest.raises(SignatureError, match="other contents"):
            read_reference(store, ref.config_key, 0, trusted=trust)


@pytest.mark.parametrize(("change", "match"), [
    (lambda d: d | {"step": 5}, "expected step 0"),
    (lambda d: d | {"fingerprint": "f" * 64}, "not its ranks' digests"),
    (lambda d: d | {"ranks": [d["ranks"][0] | {"digest": "e" * 64}]}, "rank 0's digest is not its tensors'"),
    (lambda d: d | {"config": d["config"] | {"dtype": "float16"}}, "expected step 0, key"),
    (lambda d: d | {"ranks": []}, "invalid FingerprintReference"),
])
def test_a_hostile_reference_is_refused(stream, change, match):
    url = stream[0]
    ref = make_reference(0, CONFIG, [RankFingerprint(digest="0" * 64, tensors=_prints())])
    with Store(url) as store:
        write_reference(store, ref)
        path = reference_path(ref.config_key, 0)
        store.write_bytes(path, json.dumps(change(json.loads(store.read_bytes(path)))).encode())
        with pytest.raises(FormatError, match=match):
            read_reference(store, ref.config_key, 0, trusted=None)


def test_replicas_that_disagree_are_grouped_from_their_heartbeats(stream):
    url = stream[0]
    key = config_key(CONFIG)
    with Store(url) as store:
        for name, step, print_ in (("a", 3, "1" * 64), ("b", 3, "1" * 64), ("c", 3, "2" * 64), ("d", 4, "3" * 64)):
            write_heartbeat(store, name, step, record=ReplicaRecord(config_key=key, fingerprint=print_,
                                                                    fingerprint_step=step, pause_s=0.01,
                                                                    fingerprint_check="no reference"))
        write_heartbeat(store, "e", 3, record=ReplicaRecord(config_key="0" * 16, fingerprint="4" * 64,
                                                            fingerprint_step=3))  # another configuration
        positions = read_heartbeats(store)
        with pytest.raises(FormatError):  # a record that is not one is never written
            write_heartbeat(store, "f", 3, record=ReplicaRecord(fingerprint="not a digest"))
    assert disagreements(positions) == {(key, 3): {"1" * 64: ["a", "b"], "2" * 64: ["c"]}}


def test_a_mismatch_is_described_from_the_reference_inert(stream):
    """What an engine says on a mismatch (its error, its log line, its heartbeat's last error) names the reference's
    ``made_by``: on an unsigned stream a bucket writer's text, shown escaped on one line (no forged log lines, no
    escape sequences), and says the reference is unsigned; the first differing tensor's name is quoted."""
    from deltasync.fingerprints import mismatch_note

    ref = make_reference(0, CONFIG, [RankFingerprint(digest="0" * 64, tensors=_prints(1))],
                         made_by="ok\nERROR deltasync: forged line\x1b]52;c;ZXZpbA==\x07\u202e")
    mine = dict(_prints(1)) | {"model.norm.weight\x1b[2J": _prints(2)["model.norm.weight"]}
    assert mismatch_note("s/fingerprints/k/0.json", 0, 0, ref, _prints(1), signed=False) is None
    note = mismatch_note("s/fingerprints/k/0.json", 0, 0, ref, mine, signed=False)
    assert note is not None and note.isprintable(), note
    first = "first 'model.norm.weight\\x1b[2J' (reference has none, engine 0x0000000000000002)"
    assert f"1 of 4 tensor(s) differ, {first}" in note
    assert "ok ERROR deltasync: forged line\\x1b]52;c;ZXZpbA==\\x07\\u202e" in note and "unsigned" in note
    assert "signed by a trusted key" in mismatch_note("p", 0, 0, ref, mine, signed=True)


@pytest.mark.parametrize("key", ["../../steps", "0123456789abcdef/../x", "0123456789abcdef\n", "0123456789ABCDEF",
                                 "0123456789abcde", "", 12])
def test_a_configuration_key_names_one_folder_of_fingerprints(stream, key):
    """``fingerprints/<key>/<step>.json``: a key is 16 lowercase hex digits, whole, or a ``ConfigError`` naming it
    (a path from a caller, never a folder elsewhere in the stream, nor the store's plain ValueError)."""
    from deltasync.errors import ConfigError

    with Store(stream[0]) as store:
        with pytest.raises(ConfigError, match="configuration key"):
            read_reference(store, key, 0, trusted=None)  # type: ignore[arg-type]
        with pytest.raises(ConfigError, match="configuration key"):
            reference_path(key, 0)  # type: ignore[arg-type]
