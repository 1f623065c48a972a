"""The deltasync engine's settings, declared once: what vLLM's ``init_weight_transfer_engine`` carries.

One record crosses every seam: the engine inside vLLM parses it (``EngineSettings`` is the engine's
``init_info_cls``), every client sends it (:meth:`EngineSettings.init_info`), :class:`~rollout_loader.vllm.VllmTarget`
holds it, the command line builds it. A setting added here reaches every one of them; a test walks the fields.

Imports no vLLM: clients and the command line use it where vLLM is not installed.
"""

from __future__ import annotations

import dataclasses
import json
import reprlib
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal, get_args

from deltasync.engine import (
    CONSUMER_ID,
    MAX_STEP,
    StoreLocation,
    TrustedKeys,
    check_max_age_s,
    check_stream_id,
    name_matches,
    pem_text,
    pem_texts,
    rdma_options,
    reveal,
)
from deltasync.errors import ConfigError

__all__ = ["EngineSettings", "EngineVerify", "FingerprintWhen", "Mode", "Representation"]

EngineVerify = Literal["incremental", "changed", "all"]
Mode = Literal["auto", "live", "reload"]
Representation = Literal["checkpoint", "fp8"]
FingerprintWhen = Literal["after", "pause", "off"]
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
            checkpoint); proved before it is believed (``HeldStepError``): by checksums of the checkpoint-format
            weights, and by deriving again what vLLM derives from them after loading (prepacked experts, FP8
            weights) and comparing. None: the first update writes an anchor over every tensor, whatever the engine
            started from (random weights, ``load_format="dummy"``, another step's checkpoint).
        prefetch: stage the next committed step (fetch, verify, decode) before the update asks for it.
        rdma: read steps over NIXL first: ``{"controller": "tcp://host:port", ...}`` (deltasync.rdma.options),
            or just the controller's address.
        notify: an event feed (``http://HOST:PORT/events``: a mirror's or a publisher's) the engine listens to (its
            first tensor-parallel rank, which tells the others what to stage), polling the store only as a safety
            net.
        trusted_keys: public keys (PEM text, or files where these settings are made; or a follower's whole
            ``TrustedKeys``, which also gives ``stream_id``, ``max_age_s`` and ``revoked_keys`` where those are not
            set): the engine then applies only steps one of them signed. Kept as PEM text, so a server elsewhere
            needs no file.
        revoked_keys: public keys (the same forms) the engine refuses, with every key they endorsed, even where a
            trusted key endorsed them: a leaked key (docs/SECURITY.md). Only beside ``trusted_keys``.
        stream_id: the stream the trusted keys sign for (docs/FORMAT.md section 5e: pinned beside the keys, never
            read from the store; a key may sign several streams). Required beside ``trusted_keys``.
        max_age_s: the engine refuses a stream whose newest signed head is older than this (a frozen or held-back
            stream; docs/FORMAT.md section 5e). Only beside ``trusted_keys``.
        representation: what the stream's tensors are: ``"checkpoint"`` (the engine's checkpoint tensors; layers
            vLLM transforms after loading are re-loaded from host copies) or ``"fp8"`` (an FP8 engine's own
            representation, docs/FORMAT.md section 7: FP8 bytes and scales written in place, no host copy).
        max_host_bytes: the most host memory, in bytes, the engine may keep as host copies of checkpoint tensors
            (stated at init); above it init is refused with a ``ConfigError`` before anything is read. None: no
            limit.
        fingerprint: when each rank computes the runtime fingerprint of what it computes with (docs/FORMAT.md
            section 5f) after an update: ``"after"`` (on a thread of its own once the update returned, off the
            pause; a mismatch with the reference marks the engine unhealthy, and the next update undoes the step
            first and raises), ``"pause"`` (inside the update: a mismatch undoes the update whole before it returns,
            at the cost of one pass over the weights in the pause) or ``"off"``.

    Raises:
        ConfigError: a value of the wrong type or out of range, naming the setting.

    Example::

        settings = EngineSettings(url="s3://bucket/run-7", storage_options={"endpoint_url": "http://s3:9000"})
        llm.init_weight_transfer_engine({"init_info": settings.init_info()})
    """

    url: str | None = None
    # the store's URL and options as two fields, not one StoreLocation: this record *is* vLLM's init_info, a flat
    # JSON object whose ``url``/``storage_options`` keys clients and trainer configs send (StoreLocation.to_record's
    # shape); location() makes the one value on arrival, reading() fills both from one
    storage_options: dict[str, Any] = field(default_factory=dict)
    verify: EngineVerify = "incremental"
    mode: Mode = "auto"
    step: int | None = None
    prefetch: bool = True
    rdma: Mapping[str, Any] | None = None
    notify: str | None = None
    trusted_keys: tuple[str, ...] | None = None
    revoked_keys: tuple[str, ...] | None = None
    stream_id: str | None = None
    max_age_s: float | None = None
    representation: Representation = "checkpoint"
    max_host_bytes: int | None = None
    fingerprint: FingerprintWhen = "after"

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
        _choice("representation", self.representation, Representation)
        _choice("fingerprint", self.fingerprint, FingerprintWhen)
        if self.max_host_bytes is not None and (isinstance(self.max_host_bytes, bool)
                                                or not isinstance(self.max_host_bytes, int) or self.max_host_bytes < 0):
            raise _bad("max_host_bytes", "a number of bytes (an integer >= 0) or null", self.max_host_bytes)
        if self.notify is not None and not (isinstance(self.notify, str)
                                            and self.notify.startswith(("http://", "https://"))):
            raise _bad("notify", "an event feed URL (http://HOST:PORT/events)", self.notify)
        trust = self.trusted_keys
        if isinstance(trust, TrustedKeys):  # a follower's whole trust: its keys, stream, freshness and revocations
            object.__setattr__(self, "trusted_keys", tuple(pem_texts(trust)))
            if self.stream_id is None:
                object.__setattr__(self, "stream_id", trust.stream_id)
            if self.max_age_s is None and trust.max_age_s is not None:
                object.__setattr__(self, "max_age_s", trust.max_age_s)
            if self.revoked_keys is None and trust.revoked:
                object.__setattr__(self, "revoked_keys", tuple(pem_text(k) for k in sorted(trust.revoked)))
        for name in ("trusted_keys", "revoked_keys"):
            keys = getattr(self, name)
            if keys is None:
                continue
            if isinstance(keys, (str, bytes)) or not isinstance(keys, (list, tuple)):
                keys = [keys]  # one key (a file or PEM text)
            try:
                object.__setattr__(self, name, tuple(pem_texts(list(keys))))
            except ConfigError as e:
                raise ConfigError(f"deltasync engine setting {name}: {e}") from None
        if self.stream_id is not None:
            check_stream_id(self.stream_id, what="deltasync engine setting stream_id")
        object.__setattr__(self, "max_age_s",
                           check_max_age_s(self.max_age_s, what="deltasync engine setting max_age_s"))
        size = 0
        for name, value in self.init_info().items():  # what travels is JSON: a value that is not is named here
            try:
                size += len(json.dumps(value))
            except (TypeError, ValueError, RecursionError) as e:
                raise _bad(name, "JSON values (strings, numbers, true/false, null, lists, objects), at most a few "
                           "levels deep", f"{type(e).__name__}: {str(e)[:100]}") from None
        if size > MAX_SETTINGS_BYTES:
            raise _bad("(all)", f"settings of at most {MAX_SETTINGS_BYTES} bytes as JSON", f"{size} bytes")

    @classmethod
    def parse(cls, info: Any, *, key_files: bool = False) -> EngineSettings:
        """Settings from ``init_info`` as it arrives (a JSON object); an unknown key or a bad value is a
        ``ConfigError`` naming it and the known ones.

        ``trusted_keys`` and ``revoked_keys`` must then be PEM text: ``init_info`` comes from whoever reaches the
        engine, and an engine never reads a file a client names (a device that never ends, a pipe that never
        answers, a probe of which files exist). ``key_files``: the settings are this process's own (a trainer's
        configuration), whose key files are read here, as the constructor does."""
        if not isinstance(info, Mapping):
            raise ConfigError(f"deltasync init_info: expected an object of engine settings, got {type(info).__name__}")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(str(k)[:64] for k in info if k not in known)
        if unknown:  # at most a few: the names are the sender's, and so is their number
            more = f" and {len(unknown) - 10} more" if len(unknown) > 10 else ""
            raise ConfigError(f"deltasync init_info: unknown setting(s) {unknown[:10]}{more}; the engine takes "
                              f"{sorted(known)}")
        for name in ("trusted_keys", "revoked_keys"):
            keys = info.get(name)
            if key_files or keys is None:
                continue
            listed = [keys] if isinstance(keys, (str, bytes)) else keys
            if not (isinstance(listed, (list, tuple)) and all(isinstance(k, str) and k.lstrip().startswith(PEM_PUBLIC)
                                                              for k in listed)):
                raise _bad(name, f"public keys as PEM text ({PEM_PUBLIC}...): an engine reads no key file a client "
                           "names", [k if isinstance(k, str) else type(k).__name__ for k in listed]
                           if isinstance(listed, (list, tuple)) else type(listed).__name__)
        return cls(**info)

    def __repr__(self) -> str:
        """Every setting, with credentials and secrets hidden (storage options' values, the RDMA secret; keys by
        count): a repr lands in logs."""
        shown = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        shown["storage_options"] = {k: "<hidden>" for k in self.storage_options}
        shown["rdma"] = None if self.rdma is None else _redacted(self.rdma)
        for name in ("trusted_keys", "revoked_keys"):
            keys = getattr(self, name)
            shown[name] = None if keys is None else f"<{len(keys)} key(s)>"
        return f"EngineSettings({', '.join(f'{k}={v!r}' for k, v in shown.items())})"

    def init_info(self) -> dict[str, Any]:
        """The settings as the ``init_info`` object vLLM's ``init_weight_transfer_engine`` carries (JSON)."""
        info = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        info["trusted_keys"] = None if self.trusted_keys is None else list(self.trusted_keys)
        info["revoked_keys"] = None if self.revoked_keys is None else list(self.revoked_keys)
        info["rdma"] = None if self.rdma is None else reveal(dict(self.rdma))
        info["storage_options"] = reveal(self.storage_options)  # a deltasync.Secret travels as its value (JSON)
        return info

    def location(self) -> StoreLocation:
        """Where the stream is (its URL and storage options, as one value); ``ConfigError`` when the URL is not set
        (the engine needs one)."""
        if self.url is None:
            raise ConfigError("deltasync init_info: url: expected the stream's URL, got none")
        return StoreLocation.from_record({"url": self.url, "storage_options": self.storage_options})

    def reading(self, where: StoreLocation) -> EngineSettings:
        """These settings completed by the store ``where`` (a follower's): where they name no stream of their own,
        its URL, and its options unless options are set here. Settings that name a stream are returned as they are.
        """
        if self.url is not None:
            return self
        return self.replace(url=where.url, storage_options=self.storage_options or dict(where.options))

    def trusted(self) -> TrustedKeys | None:
        """The trust the engine checks every step with (None: steps are not checked): the trusted keys, less the
        revoked ones and what they endorsed, pinned to ``stream_id``, with ``max_age_s``. ``ConfigError`` for
        trusted keys without a stream (docs/FORMAT.md section 5e), or revoked keys, a stream or ``max_age_s``
        without trusted keys (nothing would be checked: they would protect nothing)."""
        if self.trusted_keys is None:
            given = [n for n in ("revoked_keys", "stream_id", "max_age_s") if getattr(self, n)]
            if given:
                raise _bad(given[0], "trusted_keys beside it (without trusted keys no step is checked)",
                           f"{given[0]} and no trusted key")
            return None
        try:
            return TrustedKeys.load(list(self.trusted_keys), revoked=list(self.revoked_keys or ()),
                                    stream_id=self.stream_id, max_age_s=self.max_age_s)
        except ConfigError as e:
            raise ConfigError(f"deltasync engine setting trusted_keys: {e}") from None

    def replace(self, **changes: Any) -> EngineSettings:
        """A copy with ``changes`` (checked again)."""
        return dataclasses.replace(self, **changes)

    def same_stream(self, other: EngineSettings | None) -> bool:
        """Whether ``other`` follows the same stream in the same way (what an engine keeps its step across)."""
        mine = (self.url, self.storage_options, self.rdma, self.trusted_keys, self.revoked_keys, self.stream_id,
                self.max_age_s)
        return other is not None and mine == (other.url, other.storage_options, other.rdma, other.trusted_keys,
                                              other.revoked_keys, other.stream_id, other.max_age_s)


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


PEM_PUBLIC = "-----BEGIN PUBLIC KEY-----"
"""How a public key sent as text begins (deltasync.signing reads the same form)."""

_REPR = reprlib.Repr()
_REPR.maxlevel, _REPR.maxstring, _REPR.maxother, _REPR.maxlist, _REPR.maxdict = 3, 160, 160, 8, 8


def _shown(value: Any) -> str:
    """A value as an error message may show it: a mapping's secrets hidden, at most 200 characters, however large
    or deep the value (it may be anyone's)."""
    return _REPR.repr(_redacted(value))[:200]


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
