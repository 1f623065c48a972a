"""Signed steps: who wrote a step, not only that its bytes are intact (docs/FORMAT.md section 5e).

Why Ed25519 from ``cryptography``: small keys and signatures, fast (tens of microseconds a step), no
parameters to get wrong, and the library every Python deployment already trusts for TLS. A DSSE envelope
(``securesystemslib``) would add a dependency for the same guarantee; the statement here is as plain.

This module says *what* is signed and makes signatures: the step statement (:func:`statement`: the stream, the
step, its base and kind, the state checksum, every object's digest, and the SHA-256 of the manifest and of
``files.json`` as stored), the head statement (:func:`head_statement`: the newest step at a time), the keys
(:class:`SigningKey`, :func:`keygen`) and a writer's signer bound to its stream (:class:`StreamSigner`).
*Who* is trusted for what (pinned stream, rotation, revocation, freshness) is deltasync/trust.py's.
Keys rotate by endorsement: the old key signs the new public key with the step from which it signs
(``deltasync keygen NEW --endorsed-by OLD``).

Example::

    deltasync keygen trainer.key                       # trainer.key (0600) and trainer.key.pub
    DeltaPublisher(url, model, signing_key="trainer.key", stream_id="run-7")
    Follower(url, target, trusted_keys=TrustedKeys.load(["trainer.key.pub"], stream_id="run-7"))
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import stat
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any

import msgspec

from deltasync.errors import ConfigError, MissingDependencyError
from deltasync.format.documents import CatchupManifest, Manifest, Step, decode

__all__ = ["SIGNATURE", "SigningKey", "StreamSigner", "keygen"]

SIGNATURE = "signature.json"
STATEMENT_TYPE = "deltasync.step/2"  # what writers sign for a SHA-256 manifest (docs/FORMAT.md section 5e)
STATEMENT_TYPE_V3 = "deltasync.step/3"  # ... for a manifest that names its digest (format version 3)
STATEMENT_TYPE_V1 = "deltasync.step/1"  # what earlier writers signed: read where that is safe
HEAD_TYPE = "deltasync.head/1"
FINGERPRINT_TYPE = "deltasync.fingerprint/1"  # a reference runtime fingerprint (docs/FORMAT.md section 5f)
CATCHUP_TYPE = "deltasync.catchup/1"  # a catch-up delta's statement (docs/FORMAT.md section 5g)
CATCHUP_TYPE_V2 = "deltasync.catchup/2"  # ... for a catch-up manifest that names its digest (version 2)
ENDORSEMENT_CONTEXT = b"deltasync.key-endorsement/1\n"
MAX_SIGNATURE_BYTES = 64 << 10
MAX_CHAIN = 8
B64Key = Annotated[str, msgspec.Meta(min_length=44, max_length=44, pattern=r"^[A-Za-z0-9+/]{43}=$")]
B64Sig = Annotated[str, msgspec.Meta(min_length=88, max_length=88, pattern=r"^[A-Za-z0-9+/]{86}==$")]


class Endorsement(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    public_key: B64Key
    signed_by: B64Key
    from_step: Step
    signature: B64Sig

    def payload(self) -> bytes:
        return ENDORSEMENT_CONTEXT + _canonical({"from_step": self.from_step, "public_key": self.public_key})


class SignatureDoc(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    format_version: int
    algorithm: str
    public_key: B64Key
    statement: Annotated[str, msgspec.Meta(max_length=MAX_SIGNATURE_BYTES)]
    signature: B64Sig
    endorsements: Annotated[list[Endorsement], msgspec.Meta(max_length=MAX_CHAIN)] = []


def _canonical(value: Any) -> bytes:
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode()


def key_id(public_key: bytes) -> str:
    """A key's short name in messages: the first 16 hex digits of the SHA-256 of its 32 raw bytes."""
    return hashlib.sha256(public_key).hexdigest()[:16]


def statement_type(manifest: Manifest) -> str:
    """The statement type a writer signs for ``manifest``, the only one a reader accepts for it besides
    ``deltasync.step/1`` on a version-1 manifest: ``deltasync.step/3`` exactly when it names its digest."""
    return STATEMENT_TYPE if manifest.digest is None else STATEMENT_TYPE_V3


def statement_fields(manifest: Manifest) -> dict[str, Any]:
    """The fields of a step statement that the manifest's parsed values decide (every statement type): for a
    manifest that names its digest, that name and each object's prefixed digest (``"blake3:…"``); else each
    object's bare SHA-256."""
    if manifest.digest is None:
        return {"step": manifest.step, "base_step": manifest.base_step, "kind": manifest.kind,
                "state_checksum": manifest.state_checksum,
                "objects": {p.object: p.object_sha256 for p in manifest.stored_objects}}
    return {"step": manifest.step, "base_step": manifest.base_step, "kind": manifest.kind,
            "state_checksum": manifest.state_checksum, "digest": manifest.digest,
            "objects": {p.object: p.digest for p in manifest.stored_objects}}


def document_digests(manifest_digest: str | None, files: str | None, *, prefixed: bool) -> dict[str, str | None]:
    """``manifest`` and ``files`` of a statement: SHA-256 of the documents as stored, bare (``step/2``,
    ``catchup/1``) or written ``"sha256:…"`` (``step/3``, ``catchup/2``: every digest names its algorithm)."""
    if not prefixed:
        return {"manifest": manifest_digest, "files": files}
    return {"manifest": None if manifest_digest is None else f"sha256:{manifest_digest}",
            "files": None if files is None else f"sha256:{files}"}


def statement(manifest: Manifest, stream_id: str, *, manifest_sha256: str, files_sha256: str | None) -> bytes:
    """What a step's signature covers (docs/FORMAT.md section 5e), as the exact bytes signed: the manifest's
    fields, the SHA-256 of ``manifest.json`` and of ``files.json`` as stored, and the stream."""
    kind = statement_type(manifest)
    return _canonical({"type": kind, "stream_id": stream_id, **statement_fields(manifest),
                       **document_digests(manifest_sha256, files_sha256, prefixed=kind == STATEMENT_TYPE_V3)})


def statement_v1(manifest: Manifest, stream_id: str | None) -> bytes:
    """What earlier writers signed for a step (``deltasync.step/1``: no manifest or files digest)."""
    return _canonical({"type": STATEMENT_TYPE_V1, "stream_id": stream_id, **statement_fields(manifest)})


def catchup_type(manifest: CatchupManifest) -> str:
    """``deltasync.catchup/2`` for a catch-up manifest that names its digest, else ``deltasync.catchup/1``."""
    return CATCHUP_TYPE if manifest.digest is None else CATCHUP_TYPE_V2


def catchup_fields(manifest: CatchupManifest) -> dict[str, Any]:
    """The fields of a catch-up statement that its manifest's parsed values decide (docs/FORMAT.md section 5g)."""
    fields = {"step": manifest.step, "base_step": manifest.base_step, "state_checksum": manifest.state_checksum,
              "base_state_checksum": manifest.base_state_checksum}
    if manifest.digest is None:
        return {**fields, "objects": {manifest.object: manifest.object_sha256}}
    return {**fields, "digest": manifest.digest, "objects": {manifest.object: manifest.part.digest}}


def catchup_manifest_digest(manifest: CatchupManifest, manifest_sha256: str) -> str:
    """The statement's ``manifest``: bare SHA-256 (``catchup/1``) or ``"sha256:…"`` (``catchup/2``)."""
    return manifest_sha256 if manifest.digest is None else f"sha256:{manifest_sha256}"


def catchup_statement(manifest: CatchupManifest, stream_id: str, *, manifest_sha256: str) -> bytes:
    """What a catch-up's signature covers, as the exact bytes signed: its own type (never a step's), the stream,
    the manifest's fields and the SHA-256 of ``manifest.json`` as stored."""
    return _canonical({"type": catchup_type(manifest), "stream_id": stream_id, **catchup_fields(manifest),
                       "manifest": catchup_manifest_digest(manifest, manifest_sha256)})


def head_statement(stream_id: str, step: int, *, signed_unix_ms: int, closed: bool) -> bytes:
    """A signed head (docs/FORMAT.md section 5e): at ``signed_unix_ms``, ``step`` was the stream's newest step."""
    return _canonical({"type": HEAD_TYPE, "stream_id": stream_id, "step": step, "signed_unix_ms": signed_unix_ms,
                       "closed": closed})


def fingerprint_statement(stream_id: str, step: int, config_key: str, document_sha256: str) -> bytes:
    """A reference fingerprint's statement (docs/FORMAT.md section 5f): the document with SHA-256
    ``document_sha256`` is the runtime fingerprint of configuration ``config_key`` at ``step`` of the stream."""
    return _canonical({"type": FINGERPRINT_TYPE, "stream_id": stream_id, "step": step, "config_key": config_key,
                       "document": document_sha256})


def sha256_hex(data: bytes | bytearray | memoryview) -> str:
    return hashlib.sha256(data).hexdigest()


def _b64(raw: bytes) -> str:
    return base64.b64encode(raw).decode()


def need_cryptography(what: str) -> None:
    """Raise ``MissingDependencyError`` (naming the ``sign`` extra) where the ``cryptography`` package is missing:
    ``what`` says which feature asked, e.g. "checking signed steps (--trusted-key)"."""
    try:
        import cryptography  # noqa: F401
    except ImportError as e:
        raise MissingDependencyError(f"{what} needs the cryptography package ({e}): pip install 'deltasync[sign]'",
                                     name="cryptography") from None


class SigningKey:
    """A private Ed25519 key read from a PEM file only its owner may read (mode 0600 or stricter), and the
    endorsement that hands signing over to it (``<path>.endorsement.json``, when the key was rotated in).

    Raises ``ConfigError`` for a missing, unreadable, group- or world-readable file, or one that is not an
    Ed25519 private key.
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        need_cryptography("a signing key")
        from cryptography.hazmat.primitives import serialization
        from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

        self.path = Path(path)
        try:
            mode = self.path.stat().st_mode
            data = self.path.read_bytes()
        except OSError as e:
            raise ConfigError(f"signing key {self.path}: cannot read it ({e.strerror or e})") from None
        if mode & (stat.S_IRWXG | stat.S_IRWXO):
            raise ConfigError(f"signing key {self.path}: mode {stat.S_IMODE(mode):04o} lets others read it; "
                              f"chmod 600 {self.path}")
        try:
            key = serialization.load_pem_private_key(data, password=None)
        except (ValueError, TypeError) as e:
            raise ConfigError(f"signing key {self.path}: not a PEM private key without a password ({e})") from None
        if not isinstance(key, Ed25519PrivateKey):
            raise ConfigError(f"signing key {self.path}: expected an Ed25519 key, got {type(key).__name__}")
        self._key = key
        self.public_key = key.public_key().public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
        self.endorsements: list[Endorsement] = []
        endorsement = Path(f"{self.path}.endorsement.json")
        if endorsement.exists():
            endorsed = decode(endorsement.read_bytes(), Endorsement, where=str(endorsement))
            if endorsed.public_key != _b64(self.public_key):
                raise ConfigError(f"{endorsement}: endorses another key than {self.path}'s")
            self.endorsements.append(endorsed)

    @property
    def key_id(self) -> str:
        return key_id(self.public_key)

    def sign(self, data: bytes) -> bytes:
        return self._key.sign(data)

    def envelope(self, text: bytes) -> bytes:
        """``text`` signed, as the JSON envelope ``signature.json`` and a head use."""
        doc = SignatureDoc(format_version=1, algorithm="ed25519", public_key=_b64(self.public_key),
                           statement=text.decode(), signature=_b64(self.sign(text)), endorsements=self.endorsements)
        return msgspec.json.encode(doc)

    def __repr__(self) -> str:
        return f"SigningKey({str(self.path)!r}, key {self.key_id})"

    def endorse(self, public_key: bytes, from_step: int) -> Endorsement:
        """Hand signing over to ``public_key`` from ``from_step`` on."""
        e = Endorsement(public_key=_b64(public_key), signed_by=_b64(self.public_key), from_step=from_step,
                        signature=_b64(b"\0" * 64))
        return msgspec.structs.replace(e, signature=_b64(self.sign(e.payload())))


@dataclass(kw_only=True)
class StreamSigner:
    """A writer's signing key bound to the stream it writes: what a step's and a head's statement name besides
    the step (docs/FORMAT.md section 5e). ``stream_id`` is the stream the writer was told or made itself, never
    one read from a store it has not checked; ``files_sha256`` the ``files.json`` it vouches for (one it wrote,
    or one a step it signed named already), else None.
    """

    key: SigningKey
    stream_id: str
    files_sha256: str | None = None

    def sign_step(self, manifest: Manifest, manifest_bytes: bytes) -> bytes:
        """``signature.json`` for ``manifest``'s step, whose stored bytes will be ``manifest_bytes``."""
        return self.key.envelope(statement(manifest, self.stream_id, manifest_sha256=sha256_hex(manifest_bytes),
                                           files_sha256=self.files_sha256))

    def sign_catchup(self, manifest: CatchupManifest, manifest_bytes: bytes) -> bytes:
        """``signature.json`` for a catch-up delta whose stored manifest will be ``manifest_bytes``."""
        digest = sha256_hex(manifest_bytes)
        return self.key.envelope(catchup_statement(manifest, self.stream_id, manifest_sha256=digest))

    def sign_head(self, step: int, *, closed: bool = False, now_unix_s: float | None = None) -> bytes:
        """A head envelope: ``step`` is the newest step now (``closed``: and the writer closed after it)."""
        now = time.time() if now_unix_s is None else now_unix_s
        return self.key.envelope(head_statement(self.stream_id, step, signed_unix_ms=int(now * 1000), closed=closed))


PEM_PUBLIC = "-----BEGIN PUBLIC KEY-----"


def read_public_key(path: str | os.PathLike[str]) -> bytes:
    """The 32 raw bytes of the Ed25519 public key in a PEM file, or given as PEM text (what an engine's
    ``init_info`` carries: the server need not have the file); ``ConfigError`` otherwise."""
    need_cryptography("checking signed steps (a trusted key)")
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

    if isinstance(path, str) and path.lstrip().startswith(PEM_PUBLIC):
        data, path = path.encode(), "(PEM text)"
    else:
        try:
            data = Path(path).read_bytes()
        except OSError as e:
            raise ConfigError(f"trusted key {path}: cannot read it ({e.strerror or e})") from None
    try:
        key = serialization.load_pem_public_key(data)
    except (ValueError, TypeError) as e:
        raise ConfigError(f"trusted key {path}: not a PEM public key ({e})") from None
    if not isinstance(key, Ed25519PublicKey):
        raise ConfigError(f"trusted key {path}: expected an Ed25519 public key, got {type(key).__name__}")
    return key.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)


def keygen(path: str | os.PathLike[str], *, endorsed_by: str | os.PathLike[str] | None = None,
           from_step: int = 0, ecdsa: bool = False) -> tuple[Path, Path]:
    """Write a new Ed25519 private key to ``path`` (mode 0600, never replacing a file) and its public half to
    ``path.pub``; with ``endorsed_by`` (the current key), also ``path.endorsement.json``: the current key
    hands signing over to the new one from ``from_step`` on. ``ecdsa``: an ECDSA P-256 key instead, for
    exports that OpenSSF ``model_signing`` verifies (``replay --sign``). Returns (private, public) paths."""
    need_cryptography("making a signing key")
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    private, public = Path(path), Path(f"{path}.pub")
    if ecdsa and endorsed_by is not None:
        raise ConfigError("keygen: an ECDSA key signs exports; only stream keys (Ed25519) are endorsed")
    old = SigningKey(endorsed_by) if endorsed_by is not None else None
    for p in (private, public):
        if p.exists():
            raise ConfigError(f"keygen: {p} exists; a key is never overwritten")
    key: Any = ec.generate_private_key(ec.SECP256R1()) if ecdsa else Ed25519PrivateKey.generate()
    pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                            serialization.NoEncryption())
    fd = os.open(private, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(pem)
    public.write_bytes(key.public_key().public_bytes(serialization.Encoding.PEM,
                                                     serialization.PublicFormat.SubjectPublicKeyInfo))
    if old is not None:
        raw = key.public_key().public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
        Path(f"{path}.endorsement.json").write_bytes(msgspec.json.encode(old.endorse(raw, from_step)))
    return private, public


def pem_texts(keys: Any) -> list[str]:
    """The PEM text of each public key in ``keys`` (files or PEM text, or a ``TrustedKeys``: the keys it was
    given), to send to an engine elsewhere."""
    if hasattr(keys, "roots"):  # a TrustedKeys: the keys it was given (it learns the endorsed ones itself)
        raw = set(keys.roots)
    else:
        if isinstance(keys, (str, os.PathLike)):
            keys = [keys]
        if not isinstance(keys, (list, tuple, set)) or not keys or len(keys) > 64:
            raise ConfigError("trusted keys: expected 1 to 64 public keys (files made by `deltasync keygen`, or PEM "
                              f"text), got {type(keys).__name__}")
        raw = {read_public_key(k) for k in keys}
    return [pem_text(k) for k in sorted(raw)]


def pem_text(raw: bytes) -> str:
    """The PEM text of a raw Ed25519 public key."""
    need_cryptography("a public key's PEM text")
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

    return Ed25519PublicKey.from_public_bytes(raw).public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo).decode()


def _verify(public_key: bytes, signature: bytes, data: bytes) -> bool:
    need_cryptography("checking a signature")
    from cryptography.exceptions import InvalidSignature
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

    try:
        Ed25519PublicKey.from_public_bytes(public_key).verify(signature, data)
        return True
    except (InvalidSignature, ValueError):
        return False


def verify_signature(public_key: bytes, signature: bytes, data: bytes) -> bool:
    """Whether ``signature`` is ``public_key``'s Ed25519 signature over ``data``."""
    return _verify(public_key, signature, data)
