"""Signed steps: who wrote a step, not only that its bytes are intact (docs/FORMAT.md section 5e).

Why Ed25519 from ``cryptography``: small keys and signatures, fast (tens of microseconds a step), no
parameters to get wrong, and the library every Python deployment already trusts for TLS. A DSSE envelope
(``securesystemslib``) would add a dependency for the same guarantee; the statement here is as plain.

The publisher signs a small statement naming the stream, the step, its base and kind, the state checksum
and every object's SHA-256 (:func:`statement`); the reader checks it against the manifest it read
(:meth:`TrustedKeys.check`). Keys rotate by endorsement: the old key signs the new public key with the
step from which it signs (``deltasync keygen NEW --endorsed-by OLD``).

Example::

    deltasync keygen trainer.key                       # trainer.key (0600) and trainer.key.pub
    DeltaPublisher(url, model, signing_key="trainer.key")
    Follower(url, target, trusted_keys=["trainer.key.pub"])
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import stat
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any

import msgspec

from deltasync.errors import ConfigError, SignatureError, UnsignedStepError, UntrustedKeyError
from deltasync.format.documents import Manifest, Step, decode

__all__ = ["SigningKey", "TrustedKeys", "keygen", "SIGNATURE"]

SIGNATURE = "signature.json"
STATEMENT_TYPE = "deltasync.step/1"
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


def statement(manifest: Manifest, stream_id: str | None) -> bytes:
    """What a step's signature covers (docs/FORMAT.md section 5e), as the exact bytes signed."""
    objects = {p.object: p.object_sha256 for p in manifest.stored_objects}
    return _canonical({"type": STATEMENT_TYPE, "stream_id": stream_id, "step": manifest.step,
                       "base_step": manifest.base_step, "kind": manifest.kind,
                       "state_checksum": manifest.state_checksum, "objects": objects})


def _b64(raw: bytes) -> str:
    return base64.b64encode(raw).decode()


class SigningKey:
    """A private Ed25519 key read from a PEM file only its owner may read (mode 0600 or stricter), and the
    endorsement that hands signing over to it (``<path>.endorsement.json``, when the key was rotated in).

    Raises ``ConfigError`` for a missing, unreadable, group- or world-readable file, or one that is not an
    Ed25519 private key.
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
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

    def sign_step(self, manifest: Manifest, stream_id: str | None) -> bytes:
        """``signature.json`` for ``manifest``'s step."""
        text = statement(manifest, stream_id)
        doc = SignatureDoc(format_version=1, algorithm="ed25519", public_key=_b64(self.public_key),
                           statement=text.decode(), signature=_b64(self.sign(text)), endorsements=self.endorsements)
        return msgspec.json.encode(doc)

    def endorse(self, public_key: bytes, from_step: int) -> Endorsement:
        """Hand signing over to ``public_key`` from ``from_step`` on."""
        e = Endorsement(public_key=_b64(public_key), signed_by=_b64(self.public_key), from_step=from_step,
                        signature=_b64(b"\0" * 64))
        return msgspec.structs.replace(e, signature=_b64(self.sign(e.payload())))


PEM_PUBLIC = "-----BEGIN PUBLIC KEY-----"


def read_public_key(path: str | os.PathLike[str]) -> bytes:
    """The 32 raw bytes of the Ed25519 public key in a PEM file, or given as PEM text (what an engine's
    ``init_info`` carries: the server need not have the file); ``ConfigError`` otherwise."""
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
    """The PEM text of each public key in ``keys`` (files or PEM text), to send to an engine elsewhere."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

    raw = TrustedKeys.load(keys).keys
    return [Ed25519PublicKey.from_public_bytes(k).public_bytes(serialization.Encoding.PEM,
                                                                serialization.PublicFormat.SubjectPublicKeyInfo).decode()
            for k in sorted(raw)]


def _verify(public_key: bytes, signature: bytes, data: bytes) -> bool:
    from cryptography.exceptions import InvalidSignature
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

    try:
        Ed25519PublicKey.from_public_bytes(public_key).verify(signature, data)
        return True
    except (InvalidSignature, ValueError):
        return False


@dataclass
class TrustedKeys:
    """The keys a reader accepts steps from (``keys``: raw public keys, or PEM files), and those it refuses
    outright (``revoked``). Endorsements seen in verified steps extend the set for later steps (and retire
    the endorsing key from then on).

    Example: ``TrustedKeys.load(["trainer.key.pub"])``.
    """

    keys: set[bytes]
    revoked: set[bytes] = field(default_factory=set)
    _handovers: dict[bytes, int] = field(default_factory=dict)  # endorsing key -> step it hands over at

    @classmethod
    def load(cls, keys: Any, revoked: Any = ()) -> TrustedKeys:
        """From paths to PEM public keys (a path, a list, or ``TrustedKeys``); ``ConfigError`` for a bad one."""
        if isinstance(keys, TrustedKeys):
            return keys
        if isinstance(keys, (str, os.PathLike)):
            keys = [keys]
        if not isinstance(keys, (list, tuple, set)) or len(keys) > 64:
            raise ConfigError("trusted keys: expected a list of public key files (at most 64), got "
                              f"{type(keys).__name__}")
        loaded = {read_public_key(k) for k in keys}
        if not loaded:
            raise ConfigError("trusted keys: none given (a path to a public key made by `deltasync keygen`)")
        return cls(keys=loaded, revoked={read_public_key(k) for k in revoked})

    def check(self, raw: bytes | None, manifest: Manifest, stream_id: str | None, *, where: str) -> str:
        """Accept ``manifest``'s step as signed by a trusted key, returning that key's id; raise
        ``UnsignedStepError`` (no signature), ``UntrustedKeyError`` (signed by a key not trusted for this
        step) or ``SignatureError`` (a bad signature, or a statement that does not match the step)."""
        if raw is None:
            raise UnsignedStepError(f"{where}: step {manifest.step} is not signed (no {SIGNATURE}); this reader "
                                    "trusts only signed steps")
        doc = decode(raw, SignatureDoc, where=f"{where}/{SIGNATURE}", max_bytes=MAX_SIGNATURE_BYTES)
        if doc.format_version != 1 or doc.algorithm != "ed25519":
            raise SignatureError(f"{where}: a signature of format {doc.format_version} with {doc.algorithm!r}; "
                                 "expected format 1, ed25519")
        signer = base64.b64decode(doc.public_key)
        text = doc.statement.encode()
        if not _verify(signer, base64.b64decode(doc.signature), text):
            raise SignatureError(f"{where}: step {manifest.step}'s signature does not verify over its statement "
                                 f"(key {key_id(signer)})")
        want = statement(manifest, stream_id)
        if text != want:
            raise SignatureError(f"{where}: step {manifest.step} is signed, but for other contents: the statement "
                                 f"signed says {_diff(text, want)}")
        self._trust(signer, doc.endorsements, manifest.step, where=where)
        return key_id(signer)

    def _trust(self, signer: bytes, endorsements: list[Endorsement], step: int, *, where: str) -> None:
        if signer in self.revoked:
            raise UntrustedKeyError(f"{where}: step {step} is signed by key {key_id(signer)}, which is revoked")
        handover = self._handovers.get(signer)
        if signer in self.keys and (handover is None or step < handover):
            return
        if signer in self.keys:
            raise UntrustedKeyError(f"{where}: step {step} is signed by key {key_id(signer)}, which handed signing "
                                    f"over to another key from step {handover} on")
        # a key endorsed, in a chain, by a trusted key, for steps from the endorsement's step on
        by_key = {base64.b64decode(e.public_key): e for e in endorsements}
        key, chain = signer, []
        for _ in range(MAX_CHAIN):
            e = by_key.get(key)
            if e is None:
                break
            endorser = base64.b64decode(e.signed_by)
            if endorser in self.revoked or not _verify(endorser, base64.b64decode(e.signature), e.payload()):
                break
            if step < e.from_step:
                raise UntrustedKeyError(f"{where}: step {step} is signed by key {key_id(signer)}, endorsed only "
                                        f"from step {e.from_step}")
            chain.append((endorser, key, e.from_step))
            if endorser in self.keys and (self._handovers.get(endorser) is None
                                          or e.from_step <= self._handovers[endorser]):
                for old, new, at in chain:  # seen in a verified step: later steps of the old key are refused
                    self.keys.add(new)
                    self._handovers[old] = min(at, self._handovers.get(old, at))
                return
            key = endorser
        raise UntrustedKeyError(f"{where}: step {step} is signed by key {key_id(signer)}, which is not trusted "
                                f"(trusted: {', '.join(sorted(key_id(k) for k in self.keys))})")


def _diff(signed: bytes, want: bytes) -> str:
    try:
        a, b = json.loads(signed), json.loads(want)
    except ValueError:
        return "something unreadable"
    if not isinstance(a, dict):
        return "something that is not a statement"
    keys = sorted(k for k in set(a) | set(b) if a.get(k) != b.get(k))
    return "; ".join(f"{k}={json.dumps(a.get(k))[:80]} where the stream has {json.dumps(b.get(k))[:80]}" for k in keys)
