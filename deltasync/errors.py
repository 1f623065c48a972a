"""One exception hierarchy for the whole library.

Every error says what was expected, what arrived, and where (URL, step, tensor). Subclasses also inherit
the matching builtin so that callers can catch ``FileNotFoundError`` or ``ValueError`` as they already do.
"""

from __future__ import annotations


class DeltaSyncError(Exception):
    """Base class of every error raised by deltasync and rollout_loader."""


class FormatError(DeltaSyncError, ValueError):
    """An object or header does not follow docs/FORMAT.md (bad JSON, unknown version, bad index)."""


class CorruptObjectError(FormatError):
    """An object's bytes are not what its manifest promised (truncated, overwritten, damaged)."""


class TensorMismatchError(DeltaSyncError, ValueError):
    """Tensor names, shapes or dtypes differ between a delta and the state it is applied to."""


class BaseStepMismatchError(DeltaSyncError, ValueError):
    """A delta's base step is not the step the consumer holds."""


class ChecksumMismatchError(DeltaSyncError, ValueError):
    """After applying a step the weights do not match the trainer's checksums."""


class HeldStepError(ChecksumMismatchError):
    """The step a consumer is said to hold (``init_info.step``, ``--engine-step``) is not the step its weights
    are: some tensor's checksum differs from that step's. Retrying cannot help: name the right step, or none."""


class StepNotFoundError(DeltaSyncError, FileNotFoundError):
    """A step was never published, is not committed yet, or has been collected."""


class StepOrderError(DeltaSyncError, ValueError):
    """A step number does not increase past what the stream already holds."""


class StoreError(DeltaSyncError, OSError):
    """The store could not be reached or refused an operation (after retries)."""


class WriterConflictError(StoreError):
    """Another publisher holds this stream, or took it over from this one (its lease expired)."""


class StepExistsError(DeltaSyncError, FileExistsError):
    """A step is already committed: a committed step is never replaced."""


class PublishError(DeltaSyncError, RuntimeError):
    """A background publishing stage failed; the step was not committed."""


class WaitTimeoutError(DeltaSyncError, TimeoutError):
    """A wait for a step ran out of time."""


class FollowError(DeltaSyncError, RuntimeError):
    """A follower stopped: a step cannot be applied and retrying cannot help (the cause is chained)."""


class OutputExistsError(DeltaSyncError, FileExistsError):
    """An output (a replayed checkpoint folder) already exists and replacing it was not asked for."""


class SignatureError(DeltaSyncError, ValueError):
    """A step's signature does not prove that a trusted key wrote it: it does not verify, or it signs other
    contents than the step holds (docs/FORMAT.md section 5e)."""


class UnsignedStepError(SignatureError):
    """A reader that trusts only signed steps found a step without a signature."""


class UntrustedKeyError(SignatureError):
    """A step is signed by a key the reader does not trust for it (unknown, revoked, or retired by rotation)."""


class ConfigError(DeltaSyncError, ValueError):
    """An argument, option or setting has a value deltasync cannot use (a verify or worker mode, an engine)."""


class MissingDependencyError(DeltaSyncError, ImportError):
    """An optional package a feature needs is not installed; the message names the extra to install."""


class StreamNotFoundError(StepNotFoundError):
    """There is no deltasync stream at a URL (no ``stream.json``, no step): a wrong bucket, prefix or path."""


class ResourceLimitError(DeltaSyncError, OSError):
    """The machine ran out of something a read needs (open files, memory for a mapping): says which, and how to
    raise the limit. Not the store's fault, and not the data's."""


class StoreAuthError(StoreError, PermissionError):
    """The store refused access: no credentials, credentials it rejects, or no permission. Never retried."""


class StoreUnreachableError(StoreError, ConnectionError):
    """The store's endpoint could not be connected to (wrong endpoint, no network, server down)."""


class StoreConfigError(StoreError, ConfigError):
    """The store's settings are wrong, e.g. a storage option its filesystem does not know."""


class EngineError(DeltaSyncError, RuntimeError):
    """An inference engine (a vLLM server or ``LLM``) failed or refused a request: not a store problem."""


class EngineUnreachableError(EngineError, ConnectionError):
    """The inference server could not be connected to (not running, wrong URL or port)."""


class EngineConfigError(EngineError):
    """The engine is not set up for deltasync: a server flag or the worker extension is missing."""


class ScheduleError(ConfigError):
    """A static transfer schedule cannot be made: a consumer needs a tensor no trainer rank holds, or trainer
    ranks describe one tensor inconsistently (gaps, overlaps, different shapes)."""

class RdmaError(StoreError):
    """The RDMA fast path could not deliver a step; the caller reads it from the object store instead."""


class RdmaTimeoutError(RdmaError, TimeoutError):
    """A transfer or an announcement did not complete in time (a dead peer, a lost notification)."""


class StaleSlotError(RdmaError):
    """A ring slot was overwritten before or while it was read (generation, length or SHA-256 differ)."""


class StaleMetadataError(RdmaError):
    """An announcement names a trainer agent this consumer has no metadata for (the trainer restarted)."""


class RingFullError(RdmaError):
    """An object does not fit a slot: this step goes through the object store only."""


class ControlMessageError(FormatError):
    """A control message is not one this protocol knows (too large, not msgpack, wrong fields or ranges)."""


class ControlRefusedError(ConfigError):
    """The controller refused a registration or request (unknown peer, inconsistent metadata, no plan)."""


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
    "FollowError",
    "FormatError",
    "HeldStepError",
    "MissingDependencyError",
    "OutputExistsError",
    "PublishError",
    "RdmaError",
    "RdmaTimeoutError",
    "ResourceLimitError",
    "RingFullError",
    "ScheduleError",
    "SignatureError",
    "StaleMetadataError",
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
