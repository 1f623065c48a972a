"""Runtime fingerprints: what an inference engine computes with, per engine configuration and step.

Checksums (docs/FORMAT.md section 4) prove an engine's *checkpoint-format* weights; what it computes with may be
something vLLM derived from them after loading (a CPU-prepacked MoE expert, a quantized or repacked weight),
written by vLLM's own reload code and otherwise never checked. A *runtime fingerprint* is the ``mix64-sum`` of
every parameter and buffer in the engine's own layout, digested per rank and per engine (section 5f). It depends
on the step and on everything that decides that layout (model, dtypes, quantization, parallel layout, kernels,
vLLM version): the *configuration*, named by its key. Two engines of one configuration at one step hold the same
fingerprint, so a follower compares its own with a *reference* (a fresh engine's, loaded from the step's
checkpoint: ``deltasync fingerprint``) and with its siblings' (``deltasync status``).

This module is the storing half: the digests, the reference document (``fingerprints/<key>/<step>.json``, signed
beside it when the stream is), and grouping heartbeats that disagree. Computing a fingerprint inside an engine is
the integration's (``rollout_loader.vllm.fingerprint``). Imports no torch.

Example::

    ref = read_reference(store, key, 12, trusted=None)       # None: no reference for that key and step
    bad = differing(ref.ranks[rank].tensors, mine)           # the tensors whose bytes differ
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
import time
from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from deltasync.errors import ConfigError, FormatError, SignatureError, UnsignedStepError, printable
from deltasync.format.documents import (
    MAX_FINGERPRINT_BYTES,
    ConfigValue,
    ConsumerPosition,
    FingerprintReference,
    RankFingerprint,
    TensorPrint,
    check_step,
    decode,
    encode,
)
from deltasync.signing import MAX_SIGNATURE_BYTES, SigningKey, fingerprint_statement, sha256_hex
from deltasync.store import Store

if TYPE_CHECKING:
    from deltasync.trust import TrustedKeys

__all__ = ["FINGERPRINTS_DIR", "config_key", "differing", "disagreements", "engine_fingerprint", "make_reference",
           "mismatch_note", "rank_digest", "read_reference", "reference_path", "write_reference"]

log = logging.getLogger(__name__)

FINGERPRINTS_DIR = "fingerprints"


def _canonical(value: Any) -> bytes:
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode()


def config_key(config: Mapping[str, ConfigValue]) -> str:
    """The key of an engine configuration: the first 16 hex digits of the SHA-256 of its canonical JSON (sorted
    keys, no spaces, ASCII). Equal configurations, and only those, share references."""
    return hashlib.sha256(_canonical(dict(config))).hexdigest()[:16]


def rank_digest(tensors: Mapping[str, TensorPrint]) -> str:
    """One rank's digest: SHA-256 of ``NAME<TAB>DTYPE<TAB>SHAPE<TAB>CHECKSUM<LF>`` per tensor, names sorted, the
    shape as its sizes joined by ``x`` (empty for a scalar)."""
    text = "".join(f"{n}\t{t.dtype}\t{'x'.join(map(str, t.shape))}\t{t.checksum}\n"
                   for n, t in sorted(tensors.items()))
    return hashlib.sha256(text.encode()).hexdigest()


def engine_fingerprint(rank_digests: Sequence[str]) -> str:
    """An engine's fingerprint: SHA-256 of ``RANK<TAB>DIGEST<LF>`` per rank, in rank order (section 5f)."""
    return hashlib.sha256("".join(f"{i}\t{d}\n" for i, d in enumerate(rank_digests)).encode()).hexdigest()


def differing(reference: Mapping[str, TensorPrint], mine: Mapping[str, TensorPrint]) -> list[str]:
    """The tensors whose fingerprints differ (or that only one side holds), sorted."""
    return sorted(n for n in set(reference) | set(mine) if reference.get(n) != mine.get(n))


def mismatch_note(where: str, rank: int, step: int, reference: FingerprintReference,
                  mine: Mapping[str, TensorPrint], *, signed: bool) -> str | None:
    """What an engine says when rank ``rank``'s tensors ``mine`` at ``step`` are not ``reference``'s (None: they
    are): how many differ, the first, what holds that, and who made the reference (``where``: its document). The
    reference's ``made_by`` is its writer's text (on an unsigned stream, anyone's who can write the bucket): shown
    on one line, control characters escaped, since the note reaches logs, errors and heartbeats."""
    bad = differing(reference.ranks[rank].tensors, mine)
    if not bad:
        return None
    first = bad[0]
    theirs, ours = reference.ranks[rank].tensors.get(first), mine.get(first)
    trust = ("signed by a trusted key" if signed else
             "unsigned: anyone who can write the bucket could have written it; follow with trusted keys and sign "
             "references (deltasync fingerprint --signing-key), docs/SECURITY.md")
    return (f"{where}: rank {rank}: the engine's runtime fingerprint at step {step} is not the reference's: "
            f"{len(bad)} of {len(mine)} tensor(s) differ, first {printable(repr(first))} (reference "
            f"{theirs.checksum if theirs else 'has none'}, engine {ours.checksum if ours else 'has none'}): what this "
            f"engine computes with is not what a fresh engine of its configuration loaded from step {step}'s "
            f"checkpoint holds, though the checkpoint checksums matched. The reference: "
            f"{printable(reference.made_by) or 'no maker named'}; {trust}")


_KEY = re.compile(r"[0-9a-f]{16}")


def check_config_key(key: object) -> str:
    """``key`` if it is a configuration key (16 lowercase hex digits, whole), else ``ConfigError``: it names a folder
    of ``fingerprints/``, never one elsewhere in the stream."""
    if not (isinstance(key, str) and _KEY.fullmatch(key)):
        raise ConfigError(f"a configuration key is 16 lowercase hex digits (docs/FORMAT.md section 5f), got "
                          f"{printable(repr(key)[:80])}", expected="16 hex digits", found=str(key)[:80])
    return key


def reference_path(key: str, step: int) -> str:
    """The reference document of configuration ``key`` at ``step`` (``ConfigError`` for a key that is not one)."""
    return f"{FINGERPRINTS_DIR}/{check_config_key(key)}/{check_step(step):012d}.json"


def signature_path(key: str, step: int) -> str:
    return f"{FINGERPRINTS_DIR}/{check_config_key(key)}/{check_step(step):012d}.signature.json"


def make_reference(step: int, config: Mapping[str, ConfigValue], ranks: Sequence[RankFingerprint], *,
                   made_by: str = "") -> FingerprintReference:
    """The reference document for ``ranks`` (in rank order) of an engine of ``config`` at ``step``; the digests
    are computed here, from the tensors."""
    ranks = [RankFingerprint(digest=rank_digest(r.tensors), tensors=dict(r.tensors), opaque=list(r.opaque))
             for r in ranks]
    return FingerprintReference(step=check_step(step), config_key=config_key(config), config=dict(config),
                                fingerprint=engine_fingerprint([r.digest for r in ranks]), ranks=ranks,
                                created_unix_s=time.time(), made_by=made_by[:500])


def write_reference(store: Store, reference: FingerprintReference, *, signing_key: SigningKey | None = None,
                    stream_id: str | None = None) -> str:
    """Store ``reference`` (replacing one of the same key and step); with ``signing_key``, its signature first
    (``stream_id``: the stream's, required then), so that a reference a trusted reader can see is signed. Returns
    the document's path in the stream."""
    data = encode(reference)
    path = reference_path(reference.config_key, reference.step)
    if signing_key is not None:
        if stream_id is None:
            raise SignatureError(f"{store.url}: signing a reference needs the stream's id (stream.json has none)")
        statement = fingerprint_statement(stream_id, reference.step, reference.config_key, sha256_hex(data))
        store.write_bytes(signature_path(reference.config_key, reference.step), signing_key.envelope(statement))
    store.write_bytes(path, data)
    return path


def read_reference(store: Store, key: str, step: int, *, trusted: TrustedKeys | None) -> FingerprintReference | None:
    """The reference stored for configuration ``key`` at ``step``, checked; None where there is none.

    With ``trusted`` keys only a reference signed by one of them (trusted for ``step``, for the pinned stream,
    over exactly these bytes) is returned. Raises ``UnsignedStepError`` (a trusted reader and an unsigned
    reference), ``SignatureError`` (a bad signature), ``FormatError`` (not a reference, another key or step, or
    digests that are not its tensors'), ``ConfigError`` (a ``key`` that is no configuration key).
    """
    path = reference_path(key, step)
    where = f"{store.url}/{path}"
    try:
        data = store.read_bytes(path, max_bytes=MAX_FINGERPRINT_BYTES)
    except FileNotFoundError:
        return None
    if trusted is not None:
        try:
            raw = store.read_bytes(signature_path(key, step), max_bytes=MAX_SIGNATURE_BYTES)
        except FileNotFoundError:
            raise UnsignedStepError(f"{where}: the reference fingerprint is not signed; this reader trusts only "
                                    "references signed by its trusted keys (deltasync fingerprint --signing-key)"
                                    ) from None
        trusted.check_fingerprint(raw, step=step, config_key=key, document_sha256=sha256_hex(data), where=where)
    ref = decode(data, FingerprintReference, where=where, max_bytes=MAX_FINGERPRINT_BYTES)
    if ref.step != step or ref.config_key != key or config_key(ref.config) != key:
        raise FormatError(f"{where}: the document names step {ref.step}, key {ref.config_key} (its configuration's key "
                          f"{config_key(ref.config)}); expected step {step}, key {key}")
    for i, r in enumerate(ref.ranks):
        if rank_digest(r.tensors) != r.digest:
            raise FormatError(f"{where}: rank {i}'s digest is not its tensors'")
    if engine_fingerprint([r.digest for r in ref.ranks]) != ref.fingerprint:
        raise FormatError(f"{where}: the fingerprint is not its ranks' digests'")
    return ref


def disagreements(positions: Iterable[ConsumerPosition]) -> dict[tuple[str, int], dict[str, list[str]]]:
    """Replicas of one configuration at one step that hold different runtime fingerprints, from their heartbeats:
    ``{(config_key, step): {fingerprint: [consumer ids]}}`` for each group with more than one fingerprint."""
    groups: dict[tuple[str, int], dict[str, list[str]]] = {}
    for p in positions:
        if p.config_key is None or p.fingerprint is None or p.fingerprint_step is None:
            continue
        groups.setdefault((p.config_key, p.fingerprint_step), {}).setdefault(p.fingerprint, []).append(p.consumer_id)
    return {k: {f: sorted(ids) for f, ids in v.items()} for k, v in sorted(groups.items()) if len(v) > 1}
