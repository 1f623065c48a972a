"""The deltasync engine's settings, declared once: what vLLM's ``init_weight_transfer_engine`` carries.

One record crosses every seam: the engine inside vLLM parses it (``EngineSettings`` is the engine's
``init_info_cls``), every client sends it (:meth:`EngineSettings.init_info`), :class:`~rollout_loader.vllm.VllmTarget`
holds it, the command line builds it. A setting added here reaches every one of them; a test walks the fields.

Imports no vLLM: clients and the command line use it where vLLM is not installed.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal, get_args

from deltasync.engine import CONSUMER_ID, MAX_STEP, TrustedKeys, name_matches, rdma_options, reveal
from deltasync.errors import ConfigError

__all__ = ["EngineSettings", "EngineVerify", "Mode"]

EngineVerify = Literal["incremental", "changed", "all"]
Mode = Literal["auto", "live", "reload"]
MAX_SETTINGS_BYTES = 1 << 20  # a few PEM keys and storage options: nothing legitimate is larger


@dataclass(frozen=True, kw_only=True)
class EngineSettings:
    """How the deltasync weight-transfer engine in a vLLM engine follows a stream.

    Args:
        url: the stream (``s3://bucket/run-7``, a path the engine can read, ...). ``None`` only in a
            :class:`~rollout_loader.vllm.VllmTarget`: its follower's reader then gives it.
        storage_options: fsspec options of the store (credentials, endpoint), as the engine needs them.
        verify: checksums after each delta: ``"incremental"`` (each changed tensor's, from the patched elements:
            O(change)), ``"changed"`` (recomputed for the changed tensors) or ``"all"``. Anchors: always all.
        mode: how parameters vLLM transforms after loading are written (``"auto"``, ``"live"``, ``"reload"``:
            rollout_loader/vllm/plan.py).
        step: the step the engine's weights are at when it holds none yet (started from that step's replayed
            checkpoint); proved by checksums before it is believed (``HeldStepError``). None: the first update
            writes an anchor.
        prefetch: stage the next committed step (fetch, verify, decode) before the update asks for it.
        rdma: read steps over NIXL first: ``{"controller": "tcp://host:port", ...}`` (deltasync.rdma.options),
            or just the controller's address.
        notify: an event feed (``http://HOST:PORT/events``: a mirror's or a publisher's) the engine's prefetchers
            listen to, polling the store only as a safety net.
        trusted_keys: the trust setting (a ``deltasync.TrustedKeys``, or its ``to_info()`` object: public keys,
            the stream they sign for, revoked keys, ``max_age_s``): the engine then applies only steps one of the
            keys signed for that stream (docs/FORMAT.md section 5e). Kept as JSON with the keys as PEM text, so a
            server elsewhere needs no file; a list of keys alone is refused (it names no stream).

    Raises:
        ConfigError: a value of the wrong type or out of range, naming the setting.

    Example::

        settings = EngineSettings(url="s3://bucket/run-7", storage_options={"endpoint_url": "http://s3:9000"})
        llm.init_weight_transfer_engine({"init_info": settings.init_info()})
    """

    url: str | None = None
    storage_options: dict[str, Any] = field(default_factory=dict)
    verify: EngineVerify = "incremental"
    mode: Mode = "auto"
    step: int | None = None
    prefetch: bool = True
    rdma: Mapping[str, Any] | None = None
    notify: str | None = None
    trusted_keys: Mapping[str, Any] | TrustedKeys | None = None  # kept as TrustedKeys.to_info(): plain JSON

    def __post_init__(self) -> None:
        if self.url is not None and not (isinstance(self.url, str) and self.url):
            raise _bad("url", "a stream URL (a non-empty string)", self.url)
        if not isinstance(self.storage_options, Mapping) or not all(isinstance(k, str) for k in self.storage_options):
            raise _bad("storage_options", "an object of fsspec options (string keys)",
                       type(self.storage_options).__name__)
        object.__setattr__(self, "storage_options", dict(self.storage_options))
        _choice("verify", self.verify, EngineVerify)
        _choice("mode", self.mode, Mode)
        if self.step is not None and (isinstance(self.step, bool) or not isinstance(self.step, int)
                                      or not 0 <= self.step <= MAX_STEP):
            raise _bad("step", f"a step number (0..{MAX_STEP}) or null", self.step)
        if not isinstance(self.prefetch, bool):
            raise _bad("prefetch", "true or false", self.prefetch)
        if self.rdma is not None:
            object.__setattr__(self, "rdma", _rdma(self.rdma))
        if self.notify is not None and not (isinstance(self.notify, str)
                                            and self.notify.startswith(("http://", "https://"))):
            raise _bad("notify", "an event feed URL (http://HOST:PORT/events)", self.notify)
        if self.trusted_keys is not None:
            try:
                object.__setattr__(self, "trusted_keys", self.trust().to_info())  # type: ignore[union-attr]
            except ConfigError as e:
                raise ConfigError(f"deltasync engine setting trusted_keys: {e}") from None
        size = len(json.dumps(self.init_info()))
        if size > MAX_SETTINGS_BYTES:
            raise _bad("(all)", f"settings of at most {MAX_SETTINGS_BYTES} bytes as JSON", f"{size} bytes")

    @classmethod
    def parse(cls, info: Any) -> EngineSettings:
        """Settings from ``init_info`` as it arrives (a JSON object); an unknown key or a bad value is a
        ``ConfigError`` naming it and the known ones."""
        if not isinstance(info, Mapping):
            raise ConfigError(f"deltasync init_info: expected an object of engine settings, got {type(info).__name__}")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(str(k) for k in info if k not in known)
        if unknown:
            raise ConfigError(f"deltasync init_info: unknown setting(s) {unknown}; the engine takes {sorted(known)}")
        return cls(**info)

    def __repr__(self) -> str:
        """Every setting, with credentials and secrets hidden (storage options' values, the RDMA secret; keys by
        count): a repr lands in logs."""
        shown = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        shown["storage_options"] = {k: "<hidden>" for k in self.storage_options}
        shown["rdma"] = None if self.rdma is None else _redacted(self.rdma)
        trust = self.trust()
        shown["trusted_keys"] = None if trust is None else (
            f"<{len(trust.roots)} key(s) for stream {trust.stream_id!r}, {len(trust.revoked)} revoked>")
        return f"EngineSettings({', '.join(f'{k}={v!r}' for k, v in shown.items())})"

    def init_info(self) -> dict[str, Any]:
        """The settings as the ``init_info`` object vLLM's ``init_weight_transfer_engine`` carries (JSON)."""
        info = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        info["trusted_keys"] = None if self.trusted_keys is None else dict(self.trusted_keys)  # type: ignore[arg-type]
        info["rdma"] = None if self.rdma is None else reveal(dict(self.rdma))
        info["storage_options"] = reveal(self.storage_options)  # a deltasync.Secret travels as its value (JSON)
        return info

    def trust(self) -> TrustedKeys | None:
        """The trust setting as the engine checks with it (a fresh ``TrustedKeys``: nothing learned yet)."""
        keys = self.trusted_keys
        if keys is None:
            return None
        if isinstance(keys, TrustedKeys):
            return keys.fresh()
        if isinstance(keys, Mapping):
            return TrustedKeys.from_info(keys)
        return TrustedKeys.load(keys)  # keys alone name no stream: a ConfigError saying so

    def stream(self) -> tuple[str, dict[str, Any]]:
        """The stream's URL and storage options; ``ConfigError`` when the URL is not set (the engine needs one)."""
        if self.url is None:
            raise ConfigError("deltasync init_info: url: expected the stream's URL, got none")
        return self.url, dict(self.storage_options)

    def replace(self, **changes: Any) -> EngineSettings:
        """A copy with ``changes`` (checked again)."""
        return dataclasses.replace(self, **changes)

    def same_stream(self, other: EngineSettings | None) -> bool:
        """Whether ``other`` follows the same stream in the same way (what an engine keeps its step across)."""
        return other is not None and (self.url, self.storage_options, self.rdma, self.trusted_keys) == (
            other.url, other.storage_options, other.rdma, other.trusted_keys)


def _bad(name: str, expected: str, got: Any) -> ConfigError:
    return ConfigError(f"deltasync engine setting {name}: expected {expected}, got {_shown(got)}")


SECRET_KEYS = ("secret", "key", "token", "password", "credential", "sas", "sig", "auth")
"""Parts of a setting's name that mark its value as a secret: never shown in a message or a repr."""


def _redacted(options: Any) -> Any:
    """A mapping with the values of secret-looking keys (and every storage option's value) hidden; others as they
    are. Storage options hold credentials under backend-specific names: all of their values are hidden."""
    if not isinstance(options, Mapping):
        return options
    return {k: "<hidden>" if any(part in str(k).lower() for part in SECRET_KEYS) else v for k, v in options.items()}


def _shown(value: Any) -> str:
    """A value as an error message may show it: a mapping's secrets hidden, at most 200 characters."""
    return repr(_redacted(value))[:200]


def _choice(name: str, value: Any, allowed: Any) -> None:
    options = get_args(allowed)
    if value not in options:
        raise _bad(name, f"one of {', '.join(map(repr, options))}", value)


def _rdma(rdma: Any) -> dict[str, Any]:
    """``rdma`` as the engine takes it: a controller address or an object of NIXL options (every field checked now,
    not in a thread later), plus ``engine`` (names this engine's consumers to the controller)."""
    options = {"controller": rdma} if isinstance(rdma, str) else rdma
    if not (isinstance(options, Mapping) and isinstance(options.get("controller"), str)):
        raise _bad("rdma", "a controller address (tcp://host:port) or an object naming a 'controller'", rdma)
    options = dict(options)
    engine = options.get("engine", "vllm")
    if not (isinstance(engine, str) and name_matches(CONSUMER_ID, engine)):
        raise _bad("rdma.engine", "a name (letters, digits, '.', '_', '-')", engine)
    try:
        rdma_options({k: v for k, v in options.items() if k != "engine"})
    except ConfigError as e:
        raise ConfigError(f"deltasync engine setting rdma: {e}") from None
    return options
