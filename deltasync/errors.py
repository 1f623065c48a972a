"""One exception hierarchy for the whole library.

Every error says what was expected, what arrived, and where (URL, step, tensor). Subclasses also inherit
the matching builtin so that callers can catch ``FileNotFoundError`` or ``ValueError`` as they already do.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Sequence
from typing import Any, ClassVar

CONTEXT = ("url", "step", "key", "tensor", "expected", "found")
"""What an error is about, as attributes a program reads instead of parsing the message (as huggingface_hub's
errors carry their response): the stream's ``url``, the ``step``, the store ``key`` (an object, a manifest), the
``tensor``, and the ``expected`` and ``found`` values (a checksum, a step, a digest, a size). None: not known there."""


class DeltaSyncError(Exception):
    """Base class of every error raised by deltasync and rollout_loader.

    ``retryable`` says whether trying the same operation again can help (a store that comes back, a step that
    is committed later, a damaged download read again): the one answer every follower, mirror and client asks
    (:func:`can_retry`). Subclasses that name a wrong setting, a stream that does not fit the model or a missing
    package set it False.

    The message says what was expected, what arrived and where, for people; :data:`CONTEXT` says it for programs,
    as keyword arguments and attributes (each None where the raiser did not know it)::

        try:
            reader.state_dict(12)
        except StepNotFoundError as e:
            print(e.url, e.step)  # "s3://bucket/run-7", 12
    """

    retryable: ClassVar[bool] = True
    url: str | None = None
    step: int | None = None
    key: str | None = None
    tensor: str | None = None
    expected: Any = None
    found: Any = None

    def __init__(self, *args: Any, url: str | None = None, step: int | None = None, key: str | None = None,
                 tensor: str | None = None, expected: Any = None, found: Any = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)  # (``name=`` of an ImportError)
        for field, value in (("url", url), ("step", step), ("key", key), ("tensor", tensor), ("expected", expected),
                             ("found", found)):
            if value is not None:
                setattr(self, field, value)

    def context(self) -> dict[str, Any]:
        """The :data:`CONTEXT` attributes that are known (not None)."""
        return {f: getattr(self, f) for f in CONTEXT if getattr(self, f) is not None}


class FormatError(DeltaSyncError, ValueError):
    """An object or header does not follow docs/FORMAT.md (bad JSON, unknown version, bad index)."""


class CorruptObjectError(FormatError):
    """An object's bytes are not what its manifest promised (truncated, overwritten, damaged)."""


class TensorMismatchError(DeltaSyncError, ValueError):
    """Tensor names, shapes or dtypes differ between a delta and the state it is applied to."""

    retryable = False


class BaseStepMismatchError(DeltaSyncError, ValueError):
    """A delta's base step is not the step the consumer holds."""


class ChecksumMismatchError(DeltaSyncError, ValueError):
    """After applying a step the weights do not match the trainer's checksums."""


class HeldStepError(ChecksumMismatchError):
    """The step a consumer is said to hold (``init_info.step``, ``--engine-step``) is not the step its weights
    are: some tensor's checksum differs from that step's. Retrying cannot help: name the right step, or none."""

    retryable = False


class FingerprintMismatchError(ChecksumMismatchError):
    """An engine's runtime fingerprint (every parameter and buffer it computes with, in its own layout) is not
    the reference one stored for its configuration and step (docs/FORMAT.md section 5f): what vLLM derived
    after loading (a repacked, permuted or quantized weight) is wrong though the checkpoint-format checksums
    matched. The engine undid the update, or marked itself unhealthy; the message says which."""


class StepNotFoundError(DeltaSyncError, FileNotFoundError):
    """A step was never published, is not committed yet, or has been collected."""


class StepOrderError(DeltaSyncError, ValueError):
    """A step number does not increase past what the stream already holds."""


class StoreError(DeltaSyncError, OSError):
    """The store could not be reached or refused an operation (after retries)."""


class WriterConflictError(StoreError):
    """Another publisher holds this stream, or took it over from this one (its lease expired)."""

    retryable = False


class StepExistsError(DeltaSyncError, FileExistsError):
    """A step is already committed: a committed step is never replaced."""

    retryable = False


class PublishError(DeltaSyncError, RuntimeError):
    """A background publishing stage failed; the step was not committed."""


class NonFiniteStepError(DeltaSyncError, ValueError):
    """A publisher refused a step: floating tensors that held only finite values in the step published before hold
    NaN or ±Inf in this one (a diverged optimizer), or, in a publisher's first step, hold NaN
    (``PublishOptions.refuse_nonfinite``). Nothing of the step was published, and the publisher still holds the last
    published step: the next ``publish`` with good weights is its delta from that step.

    Attributes:
        url, step: the stream and the step refused (the :data:`CONTEXT` fields; ``tensor``: the first tensor named).
        tensors: the names of every tensor that refused it (the message names the first few; empty when rebuilt from
            another process's record, whose context carries ``tensor`` only).
    """

    retryable = False

    def __init__(self, *args: Any, tensors: Sequence[str] = (), **context: Any) -> None:
        tensors = tuple(tensors)
        if tensors and context.get("tensor") is None:
            context["tensor"] = tensors[0]
        super().__init__(*args, **context)
        self.tensors: tuple[str, ...] = tensors


class CatchupError(DeltaSyncError, ValueError):
    """A catch-up delta (docs/FORMAT.md section 5g) cannot be used: missing, damaged, unsigned or signed for other
    contents. The reader refuses it from then on and takes the steps' own objects: trying again helps."""


class WaitTimeoutError(DeltaSyncError, TimeoutError):
    """A wait for a step ran out of time."""


class FollowError(DeltaSyncError, RuntimeError):
    """A follower stopped: a step cannot be applied and retrying cannot help (the cause is chained)."""


class OutputExistsError(DeltaSyncError, FileExistsError):
    """An output (a replayed checkpoint folder) already exists and replacing it was not asked for."""

    retryable = False


class SignatureError(DeltaSyncError, ValueError):
    """A step's signature does not prove that a trusted key wrote it: it does not verify, or it signs other
    contents than the step holds (docs/FORMAT.md section 5e)."""


class UnsignedStepError(SignatureError):
    """A reader that trusts only signed steps found a step without a signature."""


class UntrustedKeyError(SignatureError):
    """A step is signed by a key the reader does not trust for it (unknown, revoked, or retired by rotation)."""


class RollbackError(SignatureError):
    """A signed head names a step the store no longer holds: steps were deleted after they were committed
    (docs/FORMAT.md section 5e). The reader keeps the step it holds; it may be repaired (the steps put back)."""


class StaleStreamError(SignatureError):
    """No signed head of the stream is as recent as the reader requires (``max_age_s``): the publisher stopped,
    or somebody holds the stream's new steps back (docs/FORMAT.md section 5e)."""


class ConfigError(DeltaSyncError, ValueError):
    """An argument, option or setting has a value deltasync cannot use (a verify or worker mode, an engine)."""

    retryable = False


class MissingDependencyError(DeltaSyncError, ImportError):
    """An optional package a feature needs is not installed; the message names the extra to install."""

    retryable = False


class StreamNotFoundError(StepNotFoundError):
    """There is no deltasync stream at a URL (no ``stream.json``, no step): a wrong bucket, prefix or path."""


class ResourceLimitError(DeltaSyncError, OSError):
    """The machine ran out of something a read needs (open files, memory for a mapping): says which, and how to
    raise the limit. Not the store's fault, and not the data's."""


class StoreAuthError(StoreError, PermissionError):
    """The store refused access: no credentials, credentials it rejects, or no permission. Never retried."""

    retryable = False


class StoreUnreachableError(StoreError, ConnectionError):
    """The store's endpoint could not be connected to (wrong endpoint, no network, server down)."""


class StoreConfigError(StoreError, ConfigError):
    """The store's settings are wrong, e.g. a storage option its filesystem does not know."""

    retryable = False


class EngineError(DeltaSyncError, RuntimeError):
    """An inference engine (a vLLM server or ``LLM``) failed or refused a request: not a store problem."""


class EngineUnreachableError(EngineError, ConnectionError):
    """The inference server could not be connected to (not running, wrong URL or port)."""


class EngineConfigError(EngineError):
    """The engine is not set up for deltasync: a server flag or the worker extension is missing."""

    retryable = False


class ScheduleError(ConfigError):
    """A static transfer schedule cannot be made: a consumer needs a tensor no trainer rank holds, or trainer
    ranks describe one tensor inconsistently (gaps, overlaps, different shapes)."""

class RdmaError(StoreError):
    """The RDMA fast path could not deliver a step; the caller reads it from the object store instead."""


class RdmaTimeoutError(RdmaError, TimeoutError):
    """A transfer or an announcement did not complete in time (a dead peer, a lost notification)."""


class StaleSlotError(RdmaError):
    """A ring slot was overwritten before or while it was read (generation, length or digest differ)."""


class StaleMetadataError(RdmaError):
    """An announcement names a trainer agent this consumer has no metadata for (the trainer restarted)."""


class RingFullError(RdmaError):
    """An object does not fit a slot: this step goes through the object store only."""


class ControlMessageError(FormatError):
    """A control message is not one this protocol knows (too large, not msgpack, wrong fields or ranges)."""


class ControlRefusedError(ConfigError):
    """The controller refused a registration or request (unknown peer, inconsistent metadata, no plan)."""



def can_retry(error: BaseException) -> bool:
    """Whether trying the same operation again can help: the error class's ``retryable`` for deltasync's errors;
    anything else (a network error of a library, a bug in a callback) is taken as transient."""
    return bool(getattr(error, "retryable", True)) if isinstance(error, DeltaSyncError) else True


def error_record(error: BaseException) -> dict[str, Any]:
    """An error as data, to cross a process boundary: ``{"type": class name, "kind": the nearest class of this
    module it is (itself, or a base: ``PatchError`` is a ``TensorMismatchError``), "retryable": bool, "message":
    str}``. The receiving side rebuilds it with :func:`from_record`; nothing is recovered from message text."""
    kind = next((c.__name__ for c in type(error).__mro__ if c.__name__ in __all__ and globals().get(c.__name__) is c),
                None)
    record = {"type": type(error).__name__, "kind": kind, "retryable": can_retry(error), "message": str(error)}
    context = {f: v for f, v in error.context().items() if _plain(v)} if isinstance(error, DeltaSyncError) else {}
    return {**record, "context": context} if context else record


def _plain(value: Any) -> bool:
    """A context value that crosses as JSON as it is: a bounded string, an int of 64 bits (a size, a step, a
    checksum) or a finite float (a bool is neither; JSON has no infinity, NaN or integer of thousands of digits
    that an error names, though Python's reads them)."""
    if type(value) is int:
        return -(2**63) <= value < 2**64
    if type(value) is float:
        return math.isfinite(value)
    return isinstance(value, str) and len(value) <= 1000


def _context(record: dict) -> dict[str, Any]:
    """The context of a record from another process: known fields of plain values only, text made printable, a
    step a step number; anything else is left out (it is another process's data, not ours to trust)."""
    context = record.get("context")
    if not isinstance(context, dict):
        return {}
    out: dict[str, Any] = {}
    for field in CONTEXT:
        value = context.get(field)
        if not _plain(value):
            continue
        if field == "step" and not (type(value) is int and 0 <= value < 10**12):
            continue
        if field in ("url", "key", "tensor") and not isinstance(value, str):
            continue
        out[field] = printable(value) if isinstance(value, str) else value
    return out


def from_record(record: Any, *, where: str = "") -> DeltaSyncError:
    """The error an :func:`error_record` describes: the class of that name when it is one of this module's, else
    its ``kind`` (the message then starts with the type's name), each only when its ``retryable`` is the one
    recorded; otherwise an ``EngineError`` (retryable) or ``EngineConfigError`` (not) carrying the type's name.
    ``where`` leads the message. A record that is not one is an ``EngineError`` saying so.

    The record comes from another process (a server, an actor) and its text reaches logs and terminals: control
    characters in the type and message are shown escaped (:func:`printable`), never passed on."""
    prefix = f"{where}: " if where else ""
    if not (isinstance(record, dict) and isinstance(record.get("type"), str) and isinstance(record.get("message"), str)
            and isinstance(record.get("retryable"), bool)):
        return EngineError(f"{prefix}expected an error record {{type, retryable, message}}, got "
                           f"{printable(str(record)[:200])}")
    name, message = printable(record["type"][:100]), printable(record["message"][:MAX_MESSAGE_CHARS])
    retryable = record["retryable"]
    kind = record.get("kind") if isinstance(record.get("kind"), str) else None
    for candidate, text in ((name, prefix + message), (kind, f"{prefix}{name}: {message}")):
        cls = globals().get(candidate) if candidate in __all__ else None
        if isinstance(cls, type) and issubclass(cls, DeltaSyncError) and cls.retryable == retryable:
            try:
                return cls(text, **_context(record))
            except TypeError:  # a class whose constructor wants more (none today): the generic form below
                break
    generic = EngineError if retryable else EngineConfigError
    return generic(f"{prefix}{name}: {message}")


MAX_MESSAGE_CHARS = 4000
"""The longest message a rebuilt error keeps (a record's message is another process's text)."""


def printable(text: str) -> str:
    """``text`` safe to show on one line of a terminal or a log: line breaks and other white space as spaces, every
    other control or format character (ESC, BEL, C1 codes, bidirectional overrides) as its escape (``\\x1b``)."""
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else " " if c.isspace() else ascii(c)[1:-1] for c in text)


ENVELOPE = "deltasync-error:"
"""Leads the text of an error that must cross a boundary that carries only text (vLLM relays a worker's error as
``str(e)``): ``deltasync-error:{"type": ..., "retryable": ...} message``; :func:`in_text` finds it again."""


def to_text(error: BaseException) -> str:
    """``error`` as text that carries its record (see :data:`ENVELOPE`); an error already in that form (its own
    record leading it: it crossed before) as it is. A message that merely starts with some record (words another
    process wrote) is wrapped like any other: the record in front is always this error's."""
    text = str(error)
    record = error_record(error)
    head = f"{ENVELOPE}{json.dumps({k: v for k, v in record.items() if k != 'message'}, separators=(',', ':'))} "
    return text if text.startswith(head) else head + text


# where a relayed error's own text begins: at the start, or after vLLM's words around a worker's error (the engine
# core's "Call to <method> method failed: ", the multiprocess executor's "Worker failed with error '"). An envelope
# anywhere else sits inside other words (another error's message quoting a name, a path, a server's reply) that
# whoever wrote them controls: it is not the record of the error being relayed.
_RELAYED = re.compile(r"\s*(?:Call to \w+ method failed: )?(?:Worker failed with error ['\"])?" + re.escape(ENVELOPE))
MAX_TEXT_CHARS = 1 << 20  # an HTTP body or a relayed message worth parsing; a record and its message are far smaller


def in_text(text: str, *, where: str = "") -> DeltaSyncError | None:
    """The error whose :func:`to_text` form the relayed error ``text`` is (as it is, inside vLLM's words around a
    worker's error, or in a string of an HTTP body's JSON), or None when it is none. The message is what follows the
    record, up to the end of the relayed error (vLLM appends its own words after a closing quote).

    Only a record where the relayed error's text begins counts: one inside other words (a tensor name, a server's
    body quoted in another error) is someone else's text, and is not believed."""
    if ENVELOPE not in text[:MAX_TEXT_CHARS]:
        return None
    match = _RELAYED.match(text)
    if match is None:
        if not text.lstrip().startswith("{") or len(text) > MAX_TEXT_CHARS:
            return None
        try:  # an HTTP body: the record sits in a JSON string, its quotes escaped
            strings = _strings(json.loads(text))
        except (ValueError, RecursionError):
            return None
        return next((e for e in (in_text(s, where=where) for s in strings if ENVELOPE in s) if e is not None), None)
    rest = text[match.end():match.end() + 4 * MAX_MESSAGE_CHARS]
    try:
        head, end = json.JSONDecoder().raw_decode(rest)
    except (ValueError, RecursionError):
        return None
    if not isinstance(head, dict):
        return None
    message = rest[end:].strip()
    for tail in ("', please check", '", please check'):  # vLLM's "Worker failed with error '...', please check ..."
        if tail in message:
            message = message[:message.index(tail)]
    return from_record({**head, "message": message.strip()}, where=where)


def _strings(value: Any, depth: int = 0) -> list[str]:
    """Every string in a decoded JSON value (a few levels deep: an error body is shallow)."""
    if isinstance(value, str):
        return [value]
    if depth > 8:
        return []
    items = value.values() if isinstance(value, dict) else value if isinstance(value, list) else ()
    return [s for v in items for s in _strings(v, depth + 1)]


__all__ = [
    "BaseStepMismatchError",
    "ChecksumMismatchError",
    "ConfigError",
    "ControlMessageError",
    "ControlRefusedError",
    "CorruptObjectError",
    "DeltaSyncError",
    "EngineConfigError",
    "EngineError",
    "EngineUnreachableError",
    "FingerprintMismatchError",
    "FollowError",
    "FormatError",
    "HeldStepError",
    "MissingDependencyError",
    "NonFiniteStepError",
    "OutputExistsError",
    "PublishError",
    "RdmaError",
    "RdmaTimeoutError",
    "ResourceLimitError",
    "RingFullError",
    "RollbackError",
    "ScheduleError",
    "SignatureError",
    "StaleMetadataError",
    "StaleStreamError",
    "StaleSlotError",
    "StepExistsError",
    "StepNotFoundError",
    "StepOrderError",
    "StoreAuthError",
    "StoreConfigError",
    "StoreError",
    "StoreUnreachableError",
    "StreamNotFoundError",
    "TensorMismatchError",
    "UnsignedStepError",
    "UntrustedKeyError",
    "WaitTimeoutError",
    "WriterConflictError",
]
