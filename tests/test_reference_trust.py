"""Signed streams read by an independent reference of docs/FORMAT.md sections 1b and 5e, against deltasync's
validator.

The reference below is written from the format text alone: it imports nothing from deltasync (``json``,
``hashlib``, ``blake3`` and ``cryptography``'s Ed25519 only), reads a local stream's files as stored, and decides
for each step and for the head in ``latest.json`` whether a reader pinned to a stream and a key must accept it.
Each attacked variant of a signed stream (a manifest byte, another stream's id, a renumbered step, a deleted
signature, model files rewritten, a non-canonical statement, a head for another stream, a BLAKE3 step downgraded
to SHA-256, swapped or unknown digests, a damaged object) must get the same verdict from the reference and from
:class:`deltasync.trust.TrustedKeys` (through ``StreamReader``), so the code and the text cannot drift apart
unnoticed.
"""

from __future__ import annotations

import base64
import hashlib
import json
import shutil
from collections.abc import Callable
from pathlib import Path

import blake3
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


def reference_objects(m: dict) -> dict[str, tuple[int, str]] | None:
    """Section 1b: every object a manifest names, with its size and digest as the statement writes it (bare SHA-256
    hex for versions 1 and 2, ``"blake3:<hex>"`` for version 3), or None for a manifest a reader refuses."""
    version, digest = m.get("format_version"), m.get("digest")
    entries = [*(m.get("parts") or [m]), *([m["delta"]] if m.get("delta") else [])]
    if version in (1, 2):
        if digest is not None or any("object_sha256" not in e or "object_digest" in e for e in entries):
            return None
        return {e["object"]: (e["object_bytes"], e["object_sha256"]) for e in entries}
    if version != 3 or digest != "blake3":
        return None
    if any("object_sha256" in e or not str(e.get("object_digest")).startswith("blake3:") for e in entries):
        return None
    return {e["object"]: (e["object_bytes"], e["object_digest"]) for e in entries}


def reference_object_ok(stream: Path, step: int) -> bool:
    """Section 1b and 5: each object of the step has the manifest's size and digest (SHA-256 or BLAKE3, hashed here
    with hashlib and blake3 directly). Names are the writer's business (older streams call it delta.safetensors):
    readers take them from the manifest."""
    folder = stream / "steps" / f"{step:012d}"
    objects = reference_objects(json.loads((folder / "manifest.json").read_bytes()))
    if objects is None:
        return False
    for name, (size, digest) in objects.items():
        data = (folder / name).read_bytes() if (folder / name).exists() else None
        if data is None or len(data) != size:
            return False
        got = ("blake3:" + blake3.blake3(data).hexdigest() if digest.startswith("blake3:")
               else hashlib.sha256(data).hexdigest())
        if got != digest:
            return False
    return True


def reference_accepts_step(stream: Path, step: int, key: Ed25519PublicKey, stream_id: str) -> bool:
    """Section 5e: signature.json exists, verifies, names this stream, step N, the manifest's base, kind, state
    checksum and objects, and the SHA-256 of manifest.json as stored; of type deltasync.step/2 for a manifest of
    version 1 or 2, deltasync.step/3 (with the digest's name, every digest prefixed) for version 3."""
    folder = stream / "steps" / f"{step:012d}"
    try:
        raw = (folder / "manifest.json").read_bytes()
        envelope = json.loads((folder / "signature.json").read_text())
    except FileNotFoundError:
        return False
    s = verified_statement(envelope, key)
    m = json.loads(raw)
    objects = reference_objects(m)
    if s is None or objects is None:
        return False
    named = m["format_version"] == 3
    if s.get("type") != ("deltasync.step/3" if named else "deltasync.step/2"):
        return False
    want = {"type": s["type"], "stream_id": stream_id, "step": step, "base_step": m["base_step"],
            "kind": m["kind"], "state_checksum": m["state_checksum"],
            "objects": {name: digest for name, (_, digest) in objects.items()},
            "manifest": ("sha256:" if named else "") + hashlib.sha256(raw).hexdigest(), "files": s.get("files")}
    if named:
        want["digest"] = m["digest"]
    return canonical(s) == canonical(want) and m["step"] == step


def reference_files_ok(stream: Path, step: int, key: Ed25519PublicKey) -> bool:
    """Model files may be used with step N only when files.json as stored has the SHA-256 its statement names."""
    envelope = json.loads((stream / "steps" / f"{step:012d}" / "signature.json").read_text())
    s = verified_statement(envelope, key)
    index = stream / "files.json"
    if not index.exists():
        return True
    prefix = "sha256:" if s is not None and s.get("type") == "deltasync.step/3" else ""
    return s is not None and s.get("files") == prefix + hashlib.sha256(index.read_bytes()).hexdigest()


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
    from deltasync.errors import FormatError, SignatureError, StepNotFoundError
    from deltasync.trust import TrustedKeys

    with StreamReader(str(stream), trusted_keys=TrustedKeys.load([public], stream_id=stream_id)) as reader:
        try:
            reader.manifest(step)
        except (SignatureError, StepNotFoundError, FormatError):
            return False
    return True


def library_object_ok(stream: Path, step: int) -> bool:
    from deltasync.errors import CorruptObjectError, FormatError
    from deltasync.store import Store

    store = Store(str(stream))
    try:
        m = store.manifest(step)
        for part in m.stored_objects:
            store.read_object(m, part=part)
    except (CorruptObjectError, FormatError):
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


def _resign(stream: Path, step: int, edit: Callable[[dict], dict]) -> None:
    """Re-sign step ``step``'s statement, edited, with the trainer's own key (a signer that is not this format's,
    or a key holder's mistake): the signature verifies, so only the statement's rules can refuse it."""
    from deltasync.signing import SigningKey

    key = SigningKey(stream.parent / "trainer.key")
    path = _step_dir(stream, step) / "signature.json"
    doc = json.loads(path.read_text())
    text = canonical(edit(json.loads(doc["statement"]))).decode()
    doc["statement"], doc["signature"] = text, base64.b64encode(key.sign(text.encode())).decode()
    path.write_text(json.dumps(doc))


def _downgraded(m: dict, folder: Path) -> dict:
    """A version-3 manifest rewritten as version 1 with every object's true SHA-256: well formed, but not the
    manifest the signature covers."""
    out = {k: v for k, v in m.items() if k not in ("digest", "object_digest")}
    out["format_version"] = 1
    out["object_sha256"] = hashlib.sha256((folder / m["object"]).read_bytes()).hexdigest()
    if m.get("delta"):
        d = {k: v for k, v in m["delta"].items() if k != "object_digest"}
        d["object_sha256"] = hashlib.sha256((folder / d["object"]).read_bytes()).hexdigest()
        out["delta"] = d
    return out


def _step2_v2_statement(s: dict) -> dict:
    """What a step/2 statement over step 2's objects would say: bare hex, no digest name."""
    return {**{k: v for k, v in s.items() if k != "digest"}, "type": "deltasync.step/2",
            "objects": {n: d.removeprefix("blake3:") for n, d in s["objects"].items()},
            "manifest": s["manifest"].removeprefix("sha256:"), "files": s["files"] and s["files"][7:]}


def _flip_object_byte(stream: Path, step: int) -> None:
    folder = _step_dir(stream, step)
    path = folder / json.loads((folder / "manifest.json").read_text())["object"]
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 1
    path.write_bytes(bytes(data))


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
    # section 1b: a BLAKE3 step (step 2 and 3 here; 0 and 1 are SHA-256, written by an earlier writer)
    "a BLAKE3 step downgraded to SHA-256": lambda s: _edit_json(_step_dir(s, 2) / "manifest.json",
                                                                lambda m: _downgraded(m, _step_dir(s, 2))),
    "an unknown digest name": lambda s: _edit_json(_step_dir(s, 2) / "manifest.json",
                                                   lambda m: {**m, "digest": "sha3"}),
    "the digest named sha256": lambda s: _edit_json(_step_dir(s, 3) / "manifest.json",
                                                    lambda m: {**m, "digest": "sha256"}),
    "a step/2 statement re-signed for a BLAKE3 step": lambda s: _resign(s, 2, _step2_v2_statement),
    "a statement with a swapped digest": lambda s: _resign(s, 2, lambda st: {**st, "objects": {
        n: "sha256:" + d.removeprefix("blake3:") for n, d in st["objects"].items()}}),
    "a step/3 statement re-signed for a SHA-256 step": lambda s: _resign(s, 1, lambda st: {
        **st, "type": "deltasync.step/3", "digest": "blake3"}),
    "a BLAKE3 object's byte": lambda s: _flip_object_byte(s, 2),
    "a SHA-256 object's byte": lambda s: _flip_object_byte(s, 1),
}


@pytest.fixture(scope="module")
def signed_stream(tmp_path_factory):
    from deltasync.signing import keygen

    root = tmp_path_factory.mktemp("reference-trust")
    private, public = keygen(root / "trainer.key")
    files = root / "model-files"
    files.mkdir()
    (files / "config.json").write_text('{"model_type": "toy"}')
    state = _state()
    with pytest.MonkeyPatch.context() as mp:  # an earlier writer: SHA-256 (format versions 1 and 2)
        mp.setenv("DELTASYNC_DIGEST", "sha256")
        _publish(str(root / "stream"), private, range(2), state, files=files)
    _publish(str(root / "stream"), private, range(2, 4), state, files=files)  # continued by this version: BLAKE3
    versions = [json.loads((_step_dir(root / "stream", s) / "manifest.json").read_text())["format_version"]
                for s in range(4)]
    assert versions == [1, 1, 3, 3]
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
    for step in range(4):
        if reference_objects(json.loads((_step_dir(stream, step) / "manifest.json").read_text())) is not None:
            assert library_object_ok(stream, step) == reference_object_ok(stream, step), (attack, step)
        assert library_head(stream, public, stream_id) == reference_head(stream, key, stream_id), (attack, stream_id)
    if reference_accepts_step(stream, 3, key, STREAM):
        assert library_files_ok(stream, 3, public) == reference_files_ok(stream, 3, key), attack
    if attack == "none":  # the reference itself accepts what the trainer wrote
        assert all(reference_accepts_step(stream, s, key, STREAM) for s in range(4))
        assert all(reference_object_ok(stream, s) for s in range(4))
        for s in range(4):  # and a writer names each object by the first 16 hex digits of its digest
            for name, (_, digest) in (reference_objects(json.loads(
                    (_step_dir(stream, s) / "manifest.json").read_text())) or {}).items():
                assert digest.removeprefix("blake3:")[:16] in name
    refused = {"a BLAKE3 step downgraded to SHA-256": 2, "an unknown digest name": 2, "the digest named sha256": 3,
               "a step/2 statement re-signed for a BLAKE3 step": 2, "a statement with a swapped digest": 2,
               "a step/3 statement re-signed for a SHA-256 step": 1}
    if attack in refused:  # the verdict both give is the refusal, not an acceptance of both
        assert not reference_accepts_step(stream, refused[attack], key, STREAM)
    if attack.endswith("object's byte"):
        assert not reference_object_ok(stream, 2 if "BLAKE3" in attack else 1)
        assert reference_head(stream, key, STREAM) == (3, True) and reference_files_ok(stream, 3, key)
