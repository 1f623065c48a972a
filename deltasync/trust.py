"""Who a reader trusts, for what: the one validator of signed steps, chains and heads (docs/FORMAT.md section 5e).

A :class:`TrustedKeys` is the trust setting a reader is configured with, and the state it learns while it
reads: the public keys it was given (``roots``), the stream they sign for (``stream_id``: pinned beside the
keys, never read from the store), the keys it refuses outright (``revoked``), how fresh the stream's signed
head must be (``max_age_s``), and, learned from verified steps, the keys those keys endorsed and the steps
from which a rotated key is retired. Every consumer checks through it: a reader's manifests (each step's
statement), a reader's chains (oldest first, so the order manifests were read in never decides which key is
trusted: :meth:`TrustedKeys.accept_chain`), a watch's heads (rollback and freshness), a mirror's copies,
replay's model files, a signing writer's own stream (where it resumes). One record crosses every seam: an
engine elsewhere receives :meth:`TrustedKeys.to_info` (plain JSON) and rebuilds it with :meth:`from_info`.

Example::

    trust = TrustedKeys.load(["trainer.key.pub"], stream_id="run-7", revoked=["leaked.key.pub"], max_age_s=600)
    Follower(url, target, trusted_keys=trust)
"""

from __future__ import annotations

import base64
import json
import logging
import math
import os
import threading
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from deltasync.errors import (
    ConfigError,
    FormatError,
    SignatureError,
    StepNotFoundError,
    UnsignedStepError,
    UntrustedKeyError,
)
from deltasync.format.documents import CatchupManifest, Manifest, StreamInfo, decode
from deltasync.format.names import SHA256, STREAM_ID, check
from deltasync.signing import (
    CATCHUP_TYPE,
    CATCHUP_TYPE_V2,
    FINGERPRINT_TYPE,
    HEAD_TYPE,
    MAX_CHAIN,
    MAX_SIGNATURE_BYTES,
    PEM_PUBLIC,
    SIGNATURE,
    STATEMENT_TYPE,
    STATEMENT_TYPE_V1,
    STATEMENT_TYPE_V3,
    Endorsement,
    SignatureDoc,
    SigningKey,
    StreamSigner,
    _canonical,
    catchup_fields,
    catchup_manifest_digest,
    catchup_type,
    document_digests,
    key_id,
    pem_text,
    read_public_key,
    statement_fields,
    statement_type,
    statement_v1,
    verify_signature,
)

log = logging.getLogger(__name__)

__all__ = ["Head", "SignedStep", "TrustedKeys", "newest_trusted", "own_trust", "writer_signer"]

MAX_KEYS = 64
NO_PIN = ("trusted keys need the id of the stream they sign for (stream_id=..., CLI --stream-id or "
          "DELTASYNC_STREAM_ID): a key may sign several streams, and a reader that took the id from the store would "
          "follow whichever stream a bucket writer copied there. The trainer logs it (DeltaPublisher.stream_id), or "
          "give the trainer one (PublishOptions.stream_id)")


@dataclass(frozen=True)
class SignedStep:
    """A step whose signature verified over a statement that matches its manifest: who signed it (``key``, with
    the ``endorsements`` it carried), the ``files.json`` digest it vouches for (None: none, or a statement of
    type ``deltasync.step/1``, which vouches for no model files) and the statement's ``version`` (1, 2 or 3)."""

    step: int
    key: bytes
    endorsements: tuple[Endorsement, ...]
    files_sha256: str | None
    version: int

    @property
    def key_id(self) -> str:
        return key_id(self.key)


@dataclass(frozen=True)
class Head:
    """A verified head: at ``signed_unix_s`` (the publisher's clock) ``step`` was the stream's newest step;
    ``closed``: its publisher closed after it."""

    step: int
    signed_unix_s: float
    closed: bool
    key_id: str


def _keys(value: Any, what: str, *, pem_only: bool = False) -> set[bytes]:
    """Raw public keys from a path, PEM text or a list of them (at most 64); ``pem_only``: PEM text only (a
    record that came from elsewhere names no file to read here)."""
    if isinstance(value, (str, bytes, os.PathLike)):
        value = [value.decode() if isinstance(value, bytes) else value]
    if not isinstance(value, (list, tuple, set, frozenset)) or len(value) > MAX_KEYS:
        raise ConfigError(f"{what}: expected a list of public keys (files made by `deltasync keygen`, or PEM text; at "
                          f"most {MAX_KEYS}), got {type(value).__name__}")
    if pem_only and not all(isinstance(k, str) and k.lstrip().startswith(PEM_PUBLIC) for k in value):
        raise ConfigError(f"{what}: expected public keys as PEM text ({PEM_PUBLIC}...): a trust record from elsewhere "
                          "names no key file to read here")
    return {read_public_key(k) for k in value}


def check_stream_id(stream_id: object, *, what: str = "stream_id") -> str:
    """``stream_id`` if it can name a stream (docs/FORMAT.md section 5e), else ``ConfigError``."""
    if not check(STREAM_ID, stream_id):
        raise ConfigError(f"{what}: expected a stream id (1 to 128 letters, digits, '.', '_' or '-', starting with a "
                          f"letter or digit, as stream.json names it), got {str(stream_id)[:140]!r}")
    assert isinstance(stream_id, str)
    return stream_id


def check_max_age_s(value: object, *, what: str = "max_age_s") -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < 1e9 or math.isnan(value):
        raise ConfigError(f"{what}: expected a positive number of seconds (how old the stream's newest signed head may "
                          f"be), got {value!r}")
    return float(value)


class TrustedKeys:
    """The keys a reader accepts steps from, for which stream, which it refuses, how fresh the stream must be;
    and what it learned (endorsed keys, retired keys). See the module docstring.

    Args:
        keys: raw 32-byte Ed25519 public keys (``load`` takes files or PEM text).
        stream_id: the stream these keys sign for (required: docs/FORMAT.md section 5e, "pinned").
        revoked: keys trusted for nothing, nor any key they endorsed.
        max_age_s: the oldest a stream's newest signed head may be (None: freshness is not required).
        retired: keys already known to hand over at a step (a signing writer's own endorsements).

    Raises:
        ConfigError: no key, more than 64, or a ``stream_id`` that cannot name a stream.

    Thread-safe: a follower's thread and an engine's prefetcher check with one instance.
    """

    def __init__(self, keys: Iterable[bytes], *, stream_id: str, revoked: Iterable[bytes] = (),
                 max_age_s: float | None = None, retired: Mapping[bytes, int] | None = None) -> None:
        roots = frozenset(keys)
        if not roots:
            raise ConfigError("trusted keys: none given (a path to a public key made by `deltasync keygen`)")
        if len(roots) > MAX_KEYS:
            raise ConfigError(f"trusted keys: {len(roots)} given, at most {MAX_KEYS}")
        if stream_id is None:
            raise ConfigError(NO_PIN)
        self.stream_id = check_stream_id(stream_id)
        self.roots = roots
        self.revoked = frozenset(revoked)
        self.max_age_s = check_max_age_s(max_age_s)
        self.keys: set[bytes] = set(roots)  # grows with keys endorsed in verified steps
        self._handovers: dict[bytes, int] = dict(retired or {})  # endorsing key -> step it hands over at
        self._lock = threading.RLock()

    @classmethod
    def load(cls, keys: Any, revoked: Any = (), *, stream_id: str | None = None,
             max_age_s: float | None = None) -> TrustedKeys:
        """From paths to PEM public keys or PEM text (a path, a list), with the stream they sign for; a
        ``TrustedKeys`` as it is; a mapping as :meth:`from_info` reads it.

        Raises ``ConfigError`` for a bad key, no key, no ``stream_id`` (say which stream: docs/FORMAT.md 5e), or
        settings given beside a ``TrustedKeys`` (it holds its own).

        Example: ``TrustedKeys.load(["trainer.key.pub"], stream_id="run-7")``.
        """
        if isinstance(keys, TrustedKeys):
            if revoked or stream_id is not None or max_age_s is not None:
                if stream_id in (None, keys.stream_id) and not revoked and max_age_s in (None, keys.max_age_s):
                    return keys
                raise ConfigError("trusted keys: a TrustedKeys holds its own stream_id, revoked keys and max_age_s; "
                                  "give them to TrustedKeys.load with the key files instead")
            return keys
        if isinstance(keys, Mapping):
            return cls.from_info(keys)
        roots = _keys(keys, "trusted keys")
        bad = _keys(revoked, "revoked keys") if revoked else set()
        return cls(roots, stream_id=stream_id, revoked=bad, max_age_s=max_age_s)  # type: ignore[arg-type]

    def to_info(self) -> dict[str, Any]:
        """The trust setting as plain JSON (what an engine elsewhere is sent): keys and revoked keys as PEM text.
        What was learned is not sent: the receiver learns it from the steps it verifies."""
        return {"keys": [pem_text(k) for k in sorted(self.roots)], "stream_id": self.stream_id,
                "revoked": [pem_text(k) for k in sorted(self.revoked)], "max_age_s": self.max_age_s}

    @classmethod
    def from_info(cls, info: Mapping[str, Any]) -> TrustedKeys:
        """:meth:`to_info`'s object back; ``ConfigError`` naming an unknown or bad field."""
        known = {"keys", "stream_id", "revoked", "max_age_s"}
        unknown = sorted(str(k) for k in info if k not in known)
        if unknown:
            raise ConfigError(f"trusted keys: unknown field(s) {unknown}; expected {sorted(known)}")
        if "keys" not in info:
            raise ConfigError("trusted keys: no 'keys' (a list of PEM public keys)")
        revoked = info.get("revoked") or ()
        return cls(_keys(info["keys"], "trusted keys", pem_only=True), stream_id=info.get("stream_id"),  # type: ignore[arg-type]
                   revoked=_keys(revoked, "revoked keys", pem_only=True) if revoked else set(),
                   max_age_s=info.get("max_age_s"))

    def fresh(self) -> TrustedKeys:
        """The same setting with nothing learned (for a reader that must not inherit another's history)."""
        return TrustedKeys(self.roots, stream_id=self.stream_id, revoked=self.revoked, max_age_s=self.max_age_s)

    def setting(self) -> tuple[Any, ...]:
        """What the trust was configured with (equal settings trust the same steps from scratch)."""
        return (self.roots, self.stream_id, self.revoked, self.max_age_s)

    def __repr__(self) -> str:
        revoked = f", {len(self.revoked)} revoked" if self.revoked else ""
        age = f", max_age_s={self.max_age_s:g}" if self.max_age_s is not None else ""
        return (f"TrustedKeys({len(self.roots)} key(s) {', '.join(sorted(key_id(k) for k in self.roots))}, stream "
                f"{self.stream_id!r}{revoked}{age})")

    # --- steps ---

    def check(self, raw: bytes | None, manifest: Manifest, *, manifest_sha256: str | None, where: str) -> SignedStep:
        """Accept ``manifest``'s step as signed by a key trusted for it, for the pinned stream, over exactly this
        manifest (``manifest_sha256``: of its bytes as stored); return what was signed.

        Raises ``UnsignedStepError`` (no signature), ``UntrustedKeyError`` (a key not trusted for this step) or
        ``SignatureError`` (a bad signature, or a statement that does not match the step, the manifest or the
        pinned stream).
        """
        step = manifest.step
        if raw is None:
            raise UnsignedStepError(f"{where}: step {step} is not signed (no {SIGNATURE}); this reader trusts only "
                                    "signed steps", step=step)
        doc, text, fields = self._verified(raw, where=f"{where}/steps/{step:012d}/{SIGNATURE}", what=f"step {step}")
        kind = fields.get("type")
        expected = statement_type(manifest)
        if kind in (STATEMENT_TYPE, STATEMENT_TYPE_V1, STATEMENT_TYPE_V3) and kind != expected and not (
                kind == STATEMENT_TYPE_V1 and expected == STATEMENT_TYPE):
            # a manifest that names its digest is signed only by a statement that names it too, and the reverse:
            # no statement of one digest stands for a manifest of another (docs/FORMAT.md section 5e)
            raise SignatureError(f"{where}: step {step}'s statement is of type {kind!r}, its manifest "
                                 f"(format version {manifest.format_version}, digest {manifest.algorithm}) is signed "
                                 f"by {expected!r}")
        if kind == STATEMENT_TYPE_V1:
            want = statement_v1(manifest, self.stream_id)
            if text != want:
                raise SignatureError(f"{where}: step {step} is signed, but for other contents: the statement signed "
                                     f"says {_diff(text, want)}")
            if manifest.is_multipart:
                raise SignatureError(f"{where}: step {step} has several parts and a statement of type "
                                     f"{STATEMENT_TYPE_V1}, which does not cover a multi-part manifest's aliases "
                                     "(docs/FORMAT.md section 5e): republish it with this version")
            files = None
        elif kind in (STATEMENT_TYPE, STATEMENT_TYPE_V3):
            files = fields.get("files")
            if kind == STATEMENT_TYPE_V3 and isinstance(files, str) and files.startswith("sha256:"):
                files = files[len("sha256:"):]
            if files is not None and not check(SHA256, files):
                raise SignatureError(f"{where}: step {step}'s statement names files {str(fields.get('files'))[:80]!r}, "
                                     f"not a SHA-256{' (sha256:<64 hex>)' if kind == STATEMENT_TYPE_V3 else ''}")
            want_fields = {"type": kind, "stream_id": self.stream_id, **statement_fields(manifest),
                           **document_digests(manifest_sha256, files, prefixed=kind == STATEMENT_TYPE_V3)}
            if set(fields) != set(want_fields) or any(fields[k] != v for k, v in want_fields.items()):
                raise SignatureError(f"{where}: step {step} is signed, but for other contents: the statement signed "
                                     f"says {_diff(text, _canonical(want_fields))}")
        else:
            raise SignatureError(f"{where}: step {step}'s statement is of type {str(kind)[:80]!r}; expected "
                                 f"{expected!r}")
        signer = base64.b64decode(doc.public_key)
        signed = SignedStep(step=step, key=signer, endorsements=tuple(doc.endorsements), files_sha256=files,
                            version=1 if kind == STATEMENT_TYPE_V1 else 2 if kind == STATEMENT_TYPE else 3)
        self.accept(signed, where=where)
        return signed

    def check_catchup(self, raw: bytes | None, manifest: CatchupManifest, *, manifest_sha256: str,
                      where: str) -> SignedStep:
        """Accept a catch-up delta (docs/FORMAT.md section 5g) as signed by a key trusted for its step, for the pinned
        stream, over exactly this manifest; return what was signed (``files_sha256`` None: a catch-up vouches for no
        model files). Raises what :meth:`check` raises, for the catch-up."""
        what = f"catch-up {manifest.base_step}->{manifest.step}"
        if raw is None:
            raise UnsignedStepError(f"{where}: {what} is not signed (no {SIGNATURE}); this reader trusts only signed "
                                    "catch-ups")
        doc, text, fields = self._verified(
            raw, where=f"{where}/catchup/{manifest.step:012d}/{manifest.base_step:012d}/{SIGNATURE}", what=what)
        kind = fields.get("type")
        if kind in (CATCHUP_TYPE, CATCHUP_TYPE_V2) and kind != catchup_type(manifest):
            raise SignatureError(f"{where}: {what}'s statement is of type {kind!r}, its manifest (digest "
                                 f"{manifest.algorithm}) is signed by {catchup_type(manifest)!r}")
        want = {"type": catchup_type(manifest), "stream_id": self.stream_id, **catchup_fields(manifest),
                "manifest": catchup_manifest_digest(manifest, manifest_sha256)}
        if set(fields) != set(want) or any(fields[k] != v for k, v in want.items()):
            raise SignatureError(f"{where}: {what} is signed, but for other contents: the statement signed says "
                                 f"{_diff(text, _canonical(want))}")
        signed = SignedStep(step=manifest.step, key=base64.b64decode(doc.public_key),
                            endorsements=tuple(doc.endorsements), files_sha256=None, version=2)
        self.accept(signed, where=where)
        return signed

    def accept(self, signed: SignedStep, *, where: str) -> None:
        """The key decision alone (the signature already verified): ``UntrustedKeyError`` unless ``signed``'s key
        is trusted for its step, learning the endorsements it carried."""
        with self._lock:
            self._trust(signed.key, list(signed.endorsements), signed.step, where=where)

    def accept_chain(self, signed: Iterable[SignedStep], *, where: str) -> None:
        """The key decision for every step of a chain, oldest first: an endorsement carried by an earlier step
        retires the old key for every later step, whatever order the manifests were read in."""
        with self._lock:
            for s in sorted(signed, key=lambda s: s.step):
                self._trust(s.key, list(s.endorsements), s.step, where=where)

    # --- heads ---

    def check_head(self, raw: bytes, *, where: str) -> Head:
        """A head envelope (``latest.json``'s ``head``) verified: signed by a key trusted for its step, for the
        pinned stream; ``SignatureError`` (or ``FormatError``) otherwise."""
        doc, _, fields = self._verified(raw, where=f"{where}/latest.json head", what="the head")
        types = {"type": str, "stream_id": str, "step": int, "signed_unix_ms": int, "closed": bool}
        if set(fields) != set(types) or fields["type"] != HEAD_TYPE or any(
                type(fields[k]) is not t for k, t in types.items()):
            raise SignatureError(f"{where}: latest.json's head is not a statement of type {HEAD_TYPE!r} with exactly "
                                 f"{sorted(types)}")
        step, ms = fields["step"], fields["signed_unix_ms"]
        if not 0 <= step < 10**12 or not 0 <= ms < 10**14:
            raise SignatureError(f"{where}: latest.json's head names step {step} at {ms} ms: out of range")
        if fields["stream_id"] != self.stream_id:
            theirs = str(fields["stream_id"])[:140]
            raise SignatureError(f"{where}: latest.json's head is signed for stream {theirs!r}, this reader follows "
                                 f"stream {self.stream_id!r}")
        signer = base64.b64decode(doc.public_key)
        with self._lock:
            self._trust(signer, list(doc.endorsements), step, where=where)
        return Head(step=step, signed_unix_s=ms / 1000.0, closed=fields["closed"], key_id=key_id(signer))

    # --- reference fingerprints ---

    def check_fingerprint(self, raw: bytes, *, step: int, config_key: str, document_sha256: str, where: str) -> None:
        """A reference fingerprint's signature envelope verified (docs/FORMAT.md section 5f): signed by a key trusted
        for ``step``, for the pinned stream, over exactly the document with SHA-256 ``document_sha256`` for
        ``config_key`` and ``step``; ``SignatureError`` (or ``UntrustedKeyError``, ``FormatError``) otherwise."""
        doc, text, fields = self._verified(raw, where=f"{where} signature", what="the reference fingerprint")
        want = {"type": FINGERPRINT_TYPE, "stream_id": self.stream_id, "step": step, "config_key": config_key,
                "document": document_sha256}
        if fields != want:
            raise SignatureError(f"{where}: the reference fingerprint is signed, but for other contents: the statement "
                                 f"signed says {_diff(text, _canonical(want))}")
        with self._lock:
            self._trust(base64.b64decode(doc.public_key), list(doc.endorsements), step, where=where)

    # --- internals ---

    def _verified(self, raw: bytes, *, where: str, what: str) -> tuple[SignatureDoc, bytes, dict[str, Any]]:
        """The envelope parsed, its signature verified over its statement, the statement canonical JSON."""
        doc = decode(raw, SignatureDoc, where=where, max_bytes=MAX_SIGNATURE_BYTES)
        if doc.format_version != 1 or doc.algorithm != "ed25519":
            raise SignatureError(f"{where}: a signature of format {doc.format_version} with {doc.algorithm[:40]!r}; "
                                 "expected format 1, ed25519")
        signer = base64.b64decode(doc.public_key)
        text = doc.statement.encode()
        if not verify_signature(signer, base64.b64decode(doc.signature), text):
            raise SignatureError(f"{where}: {what}'s signature does not verify over its statement "
                                 f"(key {key_id(signer)})")
        try:
            fields = json.loads(text)
        except (ValueError, RecursionError):
            fields = None
        if not isinstance(fields, dict) or _canonical(fields) != text:
            raise SignatureError(f"{where}: {what}'s statement is not a canonical JSON object (sorted keys, no spaces)")
        return doc, text, fields

    def _trust(self, signer: bytes, endorsements: list[Endorsement], step: int, *, where: str) -> None:
        if signer in self.revoked:
            raise UntrustedKeyError(f"{where}: step {step} is signed by key {key_id(signer)}, which is revoked",
                                    step=step, found=key_id(signer))
        handover = self._handovers.get(signer)
        if signer in self.keys and (handover is None or step < handover):
            return
        if signer in self.keys:
            raise UntrustedKeyError(f"{where}: step {step} is signed by key {key_id(signer)}, which handed signing "
                                    f"over to another key from step {handover} on", step=step, found=key_id(signer))
        # a key endorsed, in a chain, by a trusted key, for steps from the endorsement's step on
        by_key = {base64.b64decode(e.public_key): e for e in endorsements}
        key, chain = signer, []
        for _ in range(MAX_CHAIN):
            e = by_key.get(key)
            if e is None:
                break
            endorser = base64.b64decode(e.signed_by)
            if not verify_signature(endorser, base64.b64decode(e.signature), e.payload()):
                break
            if endorser in self.revoked:
                raise UntrustedKeyError(f"{where}: step {step} is signed by key {key_id(signer)}, endorsed by key "
                                        f"{key_id(endorser)}, which is revoked", step=step, found=key_id(signer))
            if step < e.from_step:
                raise UntrustedKeyError(f"{where}: step {step} is signed by key {key_id(signer)}, endorsed only "
                                        f"from step {e.from_step}", step=step, found=key_id(signer))
            chain.append((endorser, key, e.from_step))
            if endorser in self.keys and (self._handovers.get(endorser) is None
                                          or e.from_step <= self._handovers[endorser]):
                for old, new, at in chain:  # seen in a verified step: later steps of the old key are refused
                    self.keys.add(new)
                    self._handovers[old] = min(at, self._handovers.get(old, at))
                return
            key = endorser
        raise UntrustedKeyError(f"{where}: step {step} is signed by key {key_id(signer)}, which is not trusted "
                                f"(trusted: {', '.join(sorted(key_id(k) for k in self.keys))})", step=step,
                                found=key_id(signer))


def _diff(signed: bytes, want: bytes) -> str:
    try:
        a, b = json.loads(signed), json.loads(want)
    except ValueError:
        return "something unreadable"
    if not isinstance(a, dict):
        return "something that is not a statement"
    keys = sorted(k for k in set(a) | set(b) if a.get(k) != b.get(k))
    return "; ".join(f"{k}={json.dumps(a.get(k))[:80]} where the stream has {json.dumps(b.get(k))[:80]}" for k in keys)


# --- what a reader or a writer finds newest ---

UNTRUSTED = (SignatureError, FormatError)
"""What makes a step not exist for a trusted reader or a signing writer (docs/FORMAT.md section 5e): a signature
that does not prove it, or a manifest (or signature) that cannot be parsed."""


def newest_trusted(steps: list[int], is_trusted: Any, *, refused: dict[int, str] | None = None, where: str,
                   budget: int = 256) -> int | None:
    """The newest of ``steps`` (ascending) for which ``is_trusted(step)`` returns without an error of
    :data:`UNTRUSTED` (each skipped one logged once, and remembered in ``refused``: step -> why); a step collected
    meanwhile (``StepNotFoundError``) is skipped. At most ``budget`` steps not yet refused are checked (a bucket
    writer who commits thousands of forged manifests makes a reader spend that many reads, once, per call)."""
    refused = {} if refused is None else refused
    for s in reversed(steps):
        if s in refused:
            continue
        if budget <= 0:
            return None
        budget -= 1
        try:
            is_trusted(s)
        except StepNotFoundError:
            continue
        except UNTRUSTED as e:
            if len(refused) < 100_000:
                refused[s] = str(e)
            log.warning("%s: step %d does not count as committed for this reader: %s: %s", where, s,
                        type(e).__name__, e)
            continue
        return s
    return None


def own_trust(key: SigningKey, stream_id: str) -> TrustedKeys:
    """What a signing writer trusts of its own stream: its own key, and the key that endorsed it for the steps
    before the hand-over (history it continues), pinned to ``stream_id``."""
    retired = {base64.b64decode(e.signed_by): e.from_step for e in key.endorsements}
    return TrustedKeys({key.public_key, *retired}, stream_id=stream_id, retired=retired)


def writer_signer(store: Any, key: SigningKey, *, stream_id: str | None) -> tuple[StreamSigner, int | None]:
    """A signing writer's signer for ``store``'s stream, and the newest step of it the writer can trust (where it
    resumes): signed by its own key (or, before the hand-over, by the key that endorsed it), for its stream.

    The stream id is ``stream_id`` (the writer's configuration: ``stream.json`` is created with it, and one that
    names another stream is a ``ConfigError``), else ``stream.json``'s, which must be the one the writer's own
    newest signed step names (a bucket writer may have replaced it). The model files it vouches for are those
    its newest signed step vouched for, while ``files.json`` is still those bytes (a writer that stores files
    vouches for its own when it writes them: ``Store.write_model_files``).
    """
    info = store.stream_info()
    if stream_id is not None:
        check_stream_id(stream_id, what="stream_id")
        if info is None:
            import time

            info = store.create_stream(like=StreamInfo(created_unix_s=time.time(), stream_id=stream_id))
        if info.stream_id != stream_id:
            raise ConfigError(f"{store.url}: stream.json names stream {str(info.stream_id)!r}, this writer was told to "
                              f"sign for stream {stream_id!r}: another stream lives at this URL (or stream.json was "
                              "replaced)")
        pin = stream_id
    else:
        if info is None:
            info = store.create_stream()
        if info.stream_id is None:
            raise ConfigError(f"{store.url}: the stream has no id (made before streams had one): a signing writer "
                              "needs one; give stream_id=... or write a new stream")
        pin = info.stream_id
    trust = own_trust(key, pin)
    signed: dict[int, SignedStep] = {}

    def own(step: int) -> None:
        m, digest = store.manifest_and_digest(step, nearby=False)
        signed[step] = trust.check(store.signature(step), m, manifest_sha256=digest, where=store.url)

    newest = newest_trusted(store.steps(), own, where=f"{store.url} (signing writer)")
    if stream_id is None and newest is None and store.steps():
        log.warning("%s: no step here is signed by this writer's key; it signs for stream %r as stream.json names it "
                    "(pin it with stream_id=... where a bucket writer could have prepared the location)", store.url,
                    pin)
    files = signed[newest].files_sha256 if newest is not None else None
    if files is not None and store.files_sha256() != files:
        files = None  # files.json changed since: this writer vouches for none until it writes its own
    log.info("%s: signing steps of stream %r with key %s (followers pin it: stream_id=%r)", store.url, pin, key.key_id,
             pin)
    return StreamSigner(key=key, stream_id=pin, files_sha256=files), newest
