"""Signed streams read by an independent reference of docs/FORMAT.md section 5e, against deltasync's validator.

The reference below is written from the format text alone: it imports nothing from deltasync (``json``,
``hashlib`` and ``cryptography``'s Ed25519 only), reads a local stream's files as stored, and decides for each step
and for the head in ``latest.json`` whether a reader pinned to a stream and a key must accept it. Each attacked
variant of a signed stream (a manifest byte, another stream's id, a renumbered step, a deleted signature, model
files rewritten, a non-canonical statement, a head for another stream) must get the same verdict from the
reference and from :class:`deltasync.trust.TrustedKeys` (through ``StreamReader``), so the code and the text
cannot drift apart unnoticed.
"""

from __future__ import annotations

import base64
import hashlib
import json
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey
from cryptography.hazmat.primitives.serialization import load_pem_public_key

from tests.test_signing import STREAM, _publish, _state, _step_dir

# --- the reference: docs/FORMAT.md section 5e, nothing else ---


def canonical(value: object) -> bytes:
    """Sorted keys, no spaces, ASCII (section 5e)."""
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode()


def verified_statement(envelope: dict, key: Ed25519PublicKey) -> dict | None:
    """The statement of an envelope whose signature verifies with ``key`` and whose text is canonical, else None."""
    if envelope.get("format_version") != 1 or envelope.get("algorithm") != "ed25519":
        return None
    if base64.b64decode(envelope["public_key"]) != key.public_bytes_raw():
        return None
    text = envelope["statement"].encode()
    try:
        key.verify(base64.b64decode(envelope["signature"]), text)
        statement = json.loads(text)
    except (InvalidSignature, ValueError):
        return None
    return statement if isinstance(statement, dict) and canonical(statement) == text else None


def reference_accepts_step(stream: Path, step: int, key: Ed25519PublicKey, stream_id: str) -> bool:
    """Section 5e: signature.json exists, verifies, names this stream, step N, the manifest's base, kind, state
    checksum and objects, and the SHA-256 of manifest.json as stored."""
    folder = stream / "steps" / f"{step:012d}"
    try:
        raw = (folder / "manifest.json").read_bytes()
        envelope = json.loads((folder / "signature.json").read_text())
    except FileNotFoundError:
        return False
    s = verified_statement(envelope, key)
    if s is None or s.get("type") != "deltasync.step/2":
        return False
    m = json.loads(raw)
    objects = ({p["object"]: p["object_sha256"] for p in m["parts"]} if m.get("parts")
               else {m["object"]: m["object_sha256"]})
    if m.get("delta"):
        objects[m["delta"]["object"]] = m["delta"]["object_sha256"]
    want = {"type": "deltasync.step/2", "stream_id": stream_id, "step": step, "base_step": m["base_step"],
            "kind": m["kind"], "state_checksum": m["state_checksum"], "objects": objects,
            "manifest": hashlib.sha256(raw).hexdigest(), "files": s.get("files")}
    return canonical(s) == canonical(want) and m["step"] == step


def reference_files_ok(stream: Path, step: int, key: Ed25519PublicKey) -> bool:
    """Model files may be used with step N only when files.json as stored has the SHA-256 its statement names."""
    envelope = json.loads((stream / "steps" / f"{step:012d}" / "signature.json").read_text())
    s = verified_statement(envelope, key)
    index = stream / "files.json"
    if not index.exists():
        return True
    return s is not None and s.get("files") == hashlib.sha256(index.read_bytes()).hexdigest()


def reference_head(stream: Path, key: Ed25519PublicKey, stream_id: str) -> tuple[int, bool] | None:
    """latest.json's head: (step, closed) when its statement verifies, is of type deltasync.head/1 with exactly
    its five fields, and names the pinned stream; else None."""
    head = json.loads((stream / "latest.json").read_text()).get("head")
    if not isinstance(head, dict):
        return None
    s = verified_statement(head, key)
    fields = {"type", "stream_id", "step", "signed_unix_ms", "closed"}
    if s is None or set(s) != fields or s["type"] != "deltasync.head/1" or s["stream_id"] != stream_id:
        return None
    return s["step"], s["closed"]


# --- deltasync's verdicts ---


def library_accepts_step(stream: Path, step: int, public: Path, stream_id: str) -> bool:
    from deltasync import StreamReader
    from deltasync.errors import SignatureError, StepNotFoundError
    from deltasync.trust import TrustedKeys

    with StreamReader(str(stream), trusted_keys=TrustedKeys.load([public], stream_id=stream_id)) as reader:
        try:
            reader.manifest(step)
        except (SignatureError, StepNotFoundError):
            return False
    return True


def library_files_ok(stream: Path, step: int, public: Path) -> bool:
    from deltasync import StreamReader
    from deltasync.errors import SignatureError
    from deltasync.store.model_files import read_model_files
    from deltasync.trust import TrustedKeys

    with StreamReader(str(stream), trusted_keys=TrustedKeys.load([public], stream_id=STREAM)) as reader:
        signed = reader.signed(step)
        try:
            read_model_files(reader.store, files_sha256=None if signed is None else signed.files_sha256)
        except SignatureError:
            return False
    return True


def library_head(stream: Path, public: Path, stream_id: str) -> tuple[int, bool] | None:
    from deltasync.errors import FormatError, SignatureError
    from deltasync.store import Store
    from deltasync.trust import TrustedKeys

    raw = Store(str(stream)).latest_hint().head_bytes
    if raw is None:
        return None
    try:
        head = TrustedKeys.load([public], stream_id=stream_id).check_head(raw, where="test")
    except (SignatureError, FormatError):
        return None
    return head.step, head.closed


# --- attacks, each a change to a copy of a signed stream ---


def _edit_json(path: Path, edit: Callable[[dict], dict]) -> None:
    path.write_text(json.dumps(edit(json.loads(path.read_text()))))


def _non_canonical(stream: Path) -> None:
    """Re-sign step 2's statement with spaces in it (a signer that is not this format's): refused by both."""
    from deltasync.signing import SigningKey

    key = SigningKey(stream.parent / "trainer.key")
    path = _step_dir(stream, 2) / "signature.json"
    doc = json.loads(path.read_text())
    text = json.dumps(json.loads(doc["statement"]), sort_keys=True)  # ", " and ": " separators
    doc["statement"], doc["signature"] = text, base64.b64encode(key.sign(text.encode())).decode()
    path.write_text(json.dumps(doc))


ATTACKS: dict[str, Callable[[Path], None]] = {
    "none": lambda s: None,
    "a manifest byte": lambda s: _edit_json(_step_dir(s, 2) / "manifest.json", lambda m: {**m, "created_unix_s": 2.0}),
    "the signature deleted": lambda s: (_step_dir(s, 2) / "signature.json").unlink(),
    "another step's folder renumbered": lambda s: (shutil.rmtree(_step_dir(s, 2)),
                                                   shutil.copytree(_step_dir(s, 1), _step_dir(s, 2)),
                                                   _edit_json(_step_dir(s, 2) / "manifest.json",
                                                              lambda m: {**m, "step": 2})),
    "a non-canonical statement": _non_canonical,
    "model files rewritten": lambda s: ((s / "files" / "config.json").write_text('{"auto_map": {}}'),
                                        _edit_json(s / "files.json", lambda d: {**d, "files": {
                                            **d["files"], "config.json": {
                                                "bytes": 16, "sha256": hashlib.sha256(b'{"auto_map": {}}').hexdigest()}
                                        }})),
    "the head's stream": lambda s: _edit_json(s / "latest.json", lambda d: {**d, "head": {
        **d["head"], "statement": d["head"]["statement"].replace(STREAM, "run-8")}}),
    "the head removed": lambda s: _edit_json(s / "latest.json", lambda d: {k: v for k, v in d.items() if k != "head"}),
}


@pytest.fixture(scope="module")
def signed_stream(tmp_path_factory):
    from deltasync.signing import keygen

    root = tmp_path_factory.mktemp("reference-trust")
    private, public = keygen(root / "trainer.key")
    files = root / "model-files"
    files.mkdir()
    (files / "config.json").write_text('{"model_type": "toy"}')
    _publish(str(root / "stream"), private, range(4), _state(), files=files)
    return root, public


@pytest.mark.parametrize("attack", list(ATTACKS))
def test_the_reference_and_the_library_agree(signed_stream, tmp_path, attack):
    root, public = signed_stream
    stream = tmp_path / "stream"
    shutil.copytree(root / "stream", stream)
    shutil.copy(root / "trainer.key", tmp_path / "trainer.key")
    ATTACKS[attack](stream)
    key = load_pem_public_key(public.read_bytes())
    assert isinstance(key, Ed25519PublicKey)
    for stream_id in (STREAM, "run-8"):  # the pinned stream, and another one
        for step in range(4):
            want = reference_accepts_step(stream, step, key, stream_id)
            assert library_accepts_step(stream, step, public, stream_id) == want, (attack, stream_id, step)
        assert library_head(stream, public, stream_id) == reference_head(stream, key, stream_id), (attack, stream_id)
    if reference_accepts_step(stream, 3, key, STREAM):
        assert library_files_ok(stream, 3, public) == reference_files_ok(stream, 3, key), attack
    if attack == "none":  # the reference itself accepts what the trainer wrote
        assert all(reference_accepts_step(stream, s, key, STREAM) for s in range(4))
        assert reference_head(stream, key, STREAM) == (3, True) and reference_files_ok(stream, 3, key)
