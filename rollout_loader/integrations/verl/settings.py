"""The ``deltasync`` backend's options in verl's config (``checkpoint_engine.engine_kwargs.deltasync``), and a
committed step as verl metrics. Imports no verl: the options are checked wherever they are read.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields
from typing import Any, get_args

import torch

from deltasync.engine import Manifest, StoreLocation, TrustedKeys, check_stream_id, pem_text, pem_texts
from deltasync.errors import ConfigError
from rollout_loader.vllm.settings import EngineSettings, EngineVerify

__all__ = ["BACKEND", "SETTINGS", "VerlSettings", "plain", "step_metrics"]

BACKEND = "deltasync"
SETTINGS = "actor_rollout_ref.rollout.checkpoint_engine.engine_kwargs.deltasync"  # where users set the options
_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def _refuse(name: str, expected: str, got: Any) -> ConfigError:
    """A bad option, named by the full path a verl user sets it at."""
    return ConfigError(f"{SETTINGS}.{name} must be {expected}, got {got!r}")


@dataclass(frozen=True, kw_only=True)
class VerlSettings:
    """The ``deltasync`` backend's options: ``checkpoint_engine.engine_kwargs.deltasync`` in verl's config.

    Args:
        url: the stream (``s3://bucket/run-7``, ``hf://buckets/me/rl/run-7``, a folder every process reaches).
        storage_options: fsspec options of the store (credentials, endpoint).
        dtype: the published dtype of floating tensors: ``"bfloat16"`` (the rollout's usual dtype: fp32 master
            weights publish as the bf16 bits vLLM would cast them to), ``"float16"``, ``"float32"`` or None (as the
            actor yields them).
        anchor_every: a full snapshot every this many published steps (>= 1).
        signing_key: a private key file (``deltasync keygen``, mode 0600) on the actor rank 0's node: every step
            is signed with it.
        stream_id: the stream's id (``PublishOptions.stream_id``): the actor creates or checks the stream with it,
            and readers given ``trusted_keys`` pin it (docs/FORMAT.md section 5e). Needed with ``trusted_keys``.
        trusted_keys: public keys (PEM text, or files where the reader runs): only steps they signed for
            ``stream_id`` are read.
        revoked_keys: public keys trusted for nothing, nor any key they endorsed (a leaked key).
        verify: how the vLLM engines check each step (manager path): ``"incremental"`` (each changed tensor's
            checksum follows from the patched elements), ``"changed"`` or ``"all"`` (recomputed from the bits).
            The registry path's host copy verifies incrementally, or from the bits with the other two.
        prefetch: the vLLM engines read, verify and decode the next step as soon as it is committed, before the
            update asks for it (manager path); False saves the host memory of that staged step.
        changed_only: the registry path yields only the tensors that changed since the step the rollout holds;
            False yields every tensor every step (for rollouts whose weight loading must see every tensor, such
            as quantized ones that re-quantize on load).
        timeout_s: how long a rollout worker waits for the actor's step to be committed (registry path).

    Raises:
        ConfigError: a missing ``url``, an unknown option, or a value of the wrong type or out of range, named as
            ``actor_rollout_ref.rollout.checkpoint_engine.engine_kwargs.deltasync.<option>``.

    Example::

        VerlSettings.parse({"url": "s3://bucket/run-7", "storage_options": {"anon": False}})
    """

    url: str
    # a plain dict, not a StoreLocation: verl hands its engine_kwargs over as plain containers (OmegaConf, then
    # JSON to the rollout workers), and this record is what a verl user writes; location() makes the one value
    storage_options: dict[str, Any] = field(default_factory=dict, repr=False)  # credentials: never in a repr
    dtype: str | None = "bfloat16"
    anchor_every: int = 20
    signing_key: str | None = None
    stream_id: str | None = None
    trusted_keys: tuple[str, ...] | None = None
    revoked_keys: tuple[str, ...] = ()
    verify: EngineVerify = "incremental"
    prefetch: bool = True
    changed_only: bool = True
    timeout_s: float = 600.0

    @classmethod
    def parse(cls, options: Mapping[str, Any] | None) -> VerlSettings:
        """The settings from verl's ``engine_kwargs.deltasync`` (a dict or an OmegaConf node), checked."""
        if options is None:
            options = {}
        if not isinstance(options, Mapping):
            raise ConfigError(f"{SETTINGS} must be a mapping of deltasync options, got {type(options).__name__}")
        known = [f.name for f in fields(cls)]
        unknown = sorted(str(k) for k in options if k not in known)
        if unknown:
            raise ConfigError(f"{SETTINGS}.{unknown[0]} is not a deltasync option; the options are {known}")
        if options.get("url") is None:
            raise ConfigError(f"{SETTINGS}.url is missing: the stream's URL, e.g. "
                              f"+{SETTINGS}.url=s3://bucket/run-7")
        return cls(**{k: plain(v) for k, v in options.items()})

    def __post_init__(self) -> None:
        if not isinstance(self.url, str) or not self.url.strip():
            raise _refuse("url", "the stream's URL (a non-empty string)", self.url)
        if not isinstance(self.storage_options, Mapping) or not all(isinstance(k, str) for k in self.storage_options):
            # never echo the value: it may hold credentials
            raise ConfigError(f"{SETTINGS}.storage_options must be a mapping of fsspec options, got "
                              f"{type(self.storage_options).__name__}")
        object.__setattr__(self, "storage_options", dict(self.storage_options))
        if self.dtype is not None and self.dtype not in _DTYPES:
            raise _refuse("dtype", f"one of {sorted(_DTYPES)} or null", self.dtype)
        if isinstance(self.anchor_every, bool) or not isinstance(self.anchor_every, int) or self.anchor_every < 1:
            raise _refuse("anchor_every", "a whole number >= 1", self.anchor_every)
        if self.signing_key is not None and (not isinstance(self.signing_key, str) or not self.signing_key):
            raise _refuse("signing_key", "the path of a private key file (deltasync keygen)", self.signing_key)
        if self.stream_id is not None:
            try:
                check_stream_id(self.stream_id, what=f"{SETTINGS}.stream_id")
            except ConfigError:
                raise _refuse("stream_id", "a stream id (letters, digits, '.', '_', '-')", self.stream_id) from None
        for name in ("trusted_keys", "revoked_keys"):
            keys = getattr(self, name)
            if keys is None or (name == "revoked_keys" and not keys):
                continue
            keys = [keys] if isinstance(keys, str) else keys
            if (not isinstance(keys, Sequence) or not keys or len(keys) > 64
                    or not all(isinstance(k, str) and k for k in keys)):
                raise _refuse(name, "a list of public keys (PEM text or key files), 1 to 64", keys)
            object.__setattr__(self, name, tuple(keys))
        if self.verify not in get_args(EngineVerify):
            raise _refuse("verify", f"one of {list(get_args(EngineVerify))}", self.verify)
        if not isinstance(self.prefetch, bool):
            raise _refuse("prefetch", "true or false", self.prefetch)
        if not isinstance(self.changed_only, bool):
            raise _refuse("changed_only", "true or false", self.changed_only)
        if (isinstance(self.timeout_s, bool) or not isinstance(self.timeout_s, (int, float))
                or not 0 < self.timeout_s <= 7 * 86400):
            raise _refuse("timeout_s", "seconds > 0 (at most a week)", self.timeout_s)

    @property
    def publish_dtype(self) -> torch.dtype | None:
        return None if self.dtype is None else _DTYPES[self.dtype]

    def trusted(self) -> TrustedKeys | None:
        """The trusted keys, loaded (files read here); ``ConfigError`` naming the option for a bad one."""
        if self.trusted_keys is None:
            return None
        try:
            return TrustedKeys.load(list(self.trusted_keys), list(self.revoked_keys), stream_id=self.stream_id)
        except ConfigError as e:
            raise ConfigError(f"{SETTINGS}.trusted_keys: {e}") from None

    def location(self) -> StoreLocation:
        """The stream as one value (its URL and storage options): what the actor's publisher and readers open."""
        return StoreLocation.of(self.url, self.storage_options)

    def init_info(self) -> dict[str, Any]:
        """The deltasync vLLM engine's ``init_info`` (JSON-safe: key files read here, sent as PEM text)."""
        trust = self.trusted()  # a bad key is named as verl's setting here, not by the engine's settings
        return EngineSettings(url=self.url, storage_options=self.storage_options, verify=self.verify,
                              prefetch=self.prefetch, trusted_keys=None if trust is None else tuple(pem_texts(trust)),
                              revoked_keys=tuple(pem_text(k) for k in sorted(trust.revoked)) if trust else None,
                              stream_id=None if trust is None else trust.stream_id).init_info()


def plain(value: Any) -> Any:
    """An OmegaConf node (verl's config) as plain Python containers; anything else unchanged."""
    try:
        from omegaconf import DictConfig, ListConfig, OmegaConf
    except ImportError:  # pragma: no cover - verl depends on omegaconf
        return value
    if isinstance(value, (DictConfig, ListConfig)):
        return OmegaConf.to_container(value, resolve=True)
    return value


def step_metrics(manifest: Manifest) -> dict[str, float]:
    """A committed step as verl metrics (floats; the names verl's own delta backend uses where they exist).

    ``payload_mbytes``: the step's stored bytes (what a follower that holds the step before it downloads, or the
    anchor's full bytes); ``changed_ratio``: the fraction of elements that changed; ``changed_elems``.
    """
    return {
        "checkpoint_engine/deltasync_step": float(manifest.step),
        "checkpoint_engine/deltasync_anchor": 1.0 if manifest.kind == "anchor" else 0.0,
        "checkpoint_engine/payload_mbytes": manifest.object_bytes / (1 << 20),
        "checkpoint_engine/changed_ratio": float(manifest.stats.density),
        "checkpoint_engine/changed_elems": float(manifest.stats.changed),
    }
