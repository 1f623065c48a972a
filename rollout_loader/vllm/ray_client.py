"""vLLM engines hosted in Ray actors (how verl, SkyRL, OpenRLHF and NeMo-RL host vLLM), driven as one target.

Each actor is a ``vllm.LLM`` or ``vllm.AsyncLLM`` (``ray.remote(LLM).remote(model, weight_transfer_config=
{"backend": "deltasync"}, ...)``, or a framework's actor class built on one) running the deltasync weight-transfer
engine. :class:`RayWeightTransfer` sends every actor the same calls that vLLM's own ``RayVLLMWeightSyncClient``
sends, and adds what a follower needs: it pauses generation where the actor is an ``AsyncLLM`` (a synchronous
``LLM`` actor runs one call at a time: an update lands between two ``generate`` calls), resets every prefix cache,
reads back every actor's weight version, unwraps Ray's errors into the deltasync errors the engines raised, and
after a partial failure says which actor holds which step (the next update converges: an engine that holds the
step already does nothing).

Importing this module imports neither Ray nor vLLM; the actors' requests are plain objects vLLM reads by
attribute (``request.init_info``), so the calling process needs no vLLM either.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from deltasync import DeltaSyncError
from deltasync.errors import (
    ConfigError,
    EngineConfigError,
    EngineError,
    EngineUnreachableError,
    MissingDependencyError,
    can_retry,
    in_text,
)

from .client import (
    WEIGHT_TRANSFER_CONFIG,
    WORKER_EXTENSION,
    _missing_method,
    _step_of,
    combine_status,
    is_vllm_class,
)
from .settings import EngineSettings

log = logging.getLogger(__name__)

__all__ = ["RayWeightTransfer", "ray_handles"]


@dataclass
class _InitRequest:
    """What ``LLM``/``AsyncLLM.init_weight_transfer_engine`` reads (``request.init_info``), without vLLM here."""

    init_info: dict[str, Any]


@dataclass
class _UpdateRequest:
    """What ``LLM``/``AsyncLLM.update_weights`` reads (``request.update_info``)."""

    update_info: dict[str, Any]


def _is_handle(obj: Any) -> bool:
    """A Ray actor handle, told without importing Ray (a process with handles has Ray imported already)."""
    return type(obj).__name__ == "ActorHandle" and type(obj).__module__.startswith("ray.")


def ray_handles(engine: Any) -> list[Any] | None:
    """The actor handles ``engine`` names: one handle, a list or tuple of them, or vLLM's
    ``RayVLLMWeightSyncClient`` (its ``handles``); None when it is none of these."""
    if is_vllm_class(engine, "RayVLLMWeightSyncClient"):
        engine = getattr(engine, "handles", None)
    if _is_handle(engine):
        return [engine]
    if isinstance(engine, (list, tuple)) and engine and all(_is_handle(h) for h in engine):
        return list(engine)
    return None


def _ray() -> Any:
    try:
        import ray
    except ImportError as e:
        raise MissingDependencyError("Ray actor handles need the ray package, which is not installed: pip install "
                                     "ray", name="ray") from e
    return ray


class RayWeightTransfer:
    """Ray actors hosting vLLM engines, kept at one step (see the module docstring).

    Args:
        handles: the actors' handles (every actor hosts an engine created with ``weight_transfer_config=
            {"backend": "deltasync"}``; ``start_engine``'s keyword arguments do it, as does vLLM's
            ``--weight-transfer-config`` in a framework's actor).
        timeout_s: how long one call may take on every actor (an update includes fetching the step).
        pause_mode: how an ``AsyncLLM`` actor pauses: ``"keep"`` (in-flight requests wait and resume), ``"wait"``
            or ``"abort"``.

    Raises:
        ConfigError: no handles, or a bad argument.

    Example::

        actors = [ray.remote(LLM).remote(model_dir, weight_transfer_config={"backend": "deltasync"}) for _ in "ab"]
        follower = Follower(url, VllmTarget(actors))     # a list of handles is a RayWeightTransfer
    """

    def __init__(self, handles: Sequence[Any], *, timeout_s: float = 600.0, pause_mode: str = "keep") -> None:
        handles = list(handles)
        if not handles or not all(_is_handle(h) for h in handles):
            raise ConfigError("RayWeightTransfer: expected Ray actor handles, got "
                              f"{[type(h).__name__ for h in handles]}")
        if pause_mode not in ("keep", "wait", "abort"):
            raise ConfigError(f"RayWeightTransfer: pause_mode must be 'keep', 'wait' or 'abort', not {pause_mode!r}")
        self.handles = handles
        self.timeout_s = float(timeout_s)
        self.pause_mode = pause_mode
        self.pauses_s: list[float] = []
        # an AsyncLLM actor pauses its scheduler; a synchronous LLM actor runs one call at a time
        self._pauses = [_has(h, "pause_generation") for h in handles]

    # --- calls on every actor ---

    def _each(self, method: str, *args: Any, only: Sequence[int] | None = None, **kwargs: Any) -> list[Any]:
        """``handle.method.remote(...)`` on every actor (or ``only`` those), waited for together; the first failure
        raised as the deltasync error it was (every call is waited for first)."""
        outcomes = self._outcomes(method, *args, only=only, **kwargs)
        for i, outcome in outcomes.items():
            if isinstance(outcome, BaseException):
                raise self._error(i, method, outcome)
        return list(outcomes.values())

    def _outcomes(self, method: str, *args: Any, only: Sequence[int] | None = None,
                  **kwargs: Any) -> dict[int, Any]:
        """Every actor's result or exception (per actor index), each waited for until ``timeout_s``."""
        ray = _ray()
        picked = range(len(self.handles)) if only is None else only
        refs = {i: getattr(self.handles[i], method).remote(*args, **kwargs) for i in picked}
        deadline = time.monotonic() + self.timeout_s
        outcomes: dict[int, Any] = {}
        for i, ref in refs.items():
            try:
                outcomes[i] = ray.get(ref, timeout=max(0.0, deadline - time.monotonic()))
            except Exception as e:  # noqa: BLE001 - each actor's failure is reported with its index
                outcomes[i] = e
        return outcomes

    def _error(self, i: int, method: str, e: BaseException) -> DeltaSyncError:
        """A Ray failure as the error the engine raised (its record rebuilt), or what happened to the actor."""
        where = f"Ray actor {i} ({method})"
        ray = _ray()
        if isinstance(e, DeltaSyncError) and not isinstance(e, ray.exceptions.RayError):
            return in_text(str(e), where=where) or e
        if isinstance(e, ray.exceptions.GetTimeoutError):
            return EngineError(f"{where}: no reply within {self.timeout_s:g}s")
        if isinstance(e, (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError)):
            return EngineUnreachableError(f"{where}: the actor is gone or unavailable ({type(e).__name__}); is it "
                                          "running?")
        cause = getattr(e, "cause", None)
        text = str(cause) if cause is not None else str(e)
        if "Weight transfer not configured" in text:
            return EngineConfigError(f"{where}: the actor's vLLM engine has no weight-transfer engine: create it with "
                                     f"weight_transfer_config={WEIGHT_TRANSFER_CONFIG}")
        missing = _missing_method(text)
        if missing is not None:
            return EngineConfigError(f"{where}: the actor's workers have no method {missing!r}: create the engine with "
                                     f"worker_extension_cls={WORKER_EXTENSION!r} to read its status")
        if isinstance(cause, AttributeError) or "has no attribute" in text and method in text:
            return EngineConfigError(f"{where}: the actor has no method {method!r}: expected an actor hosting vllm.LLM "
                                     f"or vllm.AsyncLLM ({' '.join(text.split())[:300]})")
        rebuilt = in_text(text, where=where)
        if rebuilt is not None:
            return rebuilt
        return EngineError(f"{where}: {type(cause or e).__name__}: {' '.join(text.split())[:600]}")

    # --- the WeightTransfer interface ---

    def versions(self) -> list[str]:
        """Every actor's weight version (``get_weight_version``)."""
        versions = self._each("get_weight_version")
        for i, v in enumerate(versions):
            if not isinstance(v, str):
                raise EngineError(f"Ray actor {i}: expected a weight version (a string), got {str(v)[:100]!r}")
        return versions

    def held_step(self) -> int | None:
        """The step every actor holds; None when one names no step, or when they differ (said in the log: the
        first update then brings each from where it is)."""
        steps = [_step_of(v) for v in self.versions()]
        if len(set(steps)) > 1:
            log.warning("Ray actors hold different steps (%s): each is brought from where it is",
                        ", ".join(f"actor {i}: {s}" for i, s in enumerate(steps)))
            return None
        return steps[0]

    def init(self, settings: EngineSettings) -> None:
        self._each("init_weight_transfer_engine", _InitRequest(settings.init_info()))

    def update(self, step: int) -> None:
        """Bring every actor to ``step``: pause (``AsyncLLM`` actors), start, update, finish, version ``str(step)``,
        prefix caches reset, resume; then every actor's version must name ``step``. On a failure on some actors,
        the error (the class the engine raised) says which actor holds which step."""
        t0 = time.perf_counter()
        failures: dict[int, DeltaSyncError] = {}
        pausing = [i for i, p in enumerate(self._pauses) if p]
        paused = []
        for i, outcome in (self._outcomes("pause_generation", mode=self.pause_mode, clear_cache=False, only=pausing)
                           if pausing else {}).items():
            if isinstance(outcome, BaseException):  # that actor is not updated: it says where it is below
                failures[i] = self._error(i, "pause_generation", outcome)
            else:
                paused.append(i)
        try:
            alive = [i for i in range(len(self.handles)) if i not in failures]
            for method, args in (("start_weight_update", ()), ("update_weights", (_UpdateRequest({"step": step}),)),
                                 ("finish_weight_update", ()), ("update_weight_version", (str(step),))):
                outcomes = self._outcomes(method, *args, only=alive) if alive else {}
                for i, outcome in outcomes.items():
                    if isinstance(outcome, BaseException):
                        failures[i] = self._error(i, method, outcome)
                        if method == "update_weights":  # the session stays open: close it for the next update
                            self._outcomes("finish_weight_update", only=[i])
                alive = [i for i in alive if i not in failures]
        finally:
            try:
                self._outcomes("reset_prefix_cache")
            finally:
                if paused:
                    resumed = self._outcomes("resume_generation", only=paused)
                    for i, outcome in resumed.items():
                        if isinstance(outcome, BaseException):
                            log.error("Ray actor %d: resume_generation failed: %s", i, outcome)
                self.pauses_s.append(time.perf_counter() - t0)
        if not failures:
            held = [_step_of(v) for v in self.versions()]
            if any(h != step for h in held):
                raise EngineError(f"after an update to step {step} answered as done, the actors hold steps {held}")
            return
        raise self._partial(step, failures)

    def _partial(self, step: int, failures: dict[int, DeltaSyncError]) -> DeltaSyncError:
        """The failure to raise: the first one retrying cannot help, else the first; its message says which actor
        holds which step now (read back; "unknown" where an actor cannot say)."""
        outcomes = self._outcomes("get_weight_version")
        holds = ", ".join(
            f"actor {i} holds {'an unknown step' if isinstance(v, BaseException) else f'step {_step_of(v)}'}"
            + (" (failed)" if i in failures else "") for i, v in outcomes.items())
        ordered = [failures[i] for i in sorted(failures)]
        first = next((e for e in ordered if not can_retry(e)), ordered[0])
        text = f"the update to step {step} failed on {len(failures)} of {len(self.handles)} actor(s): {first}; {holds}"
        try:
            return type(first)(text)
        except TypeError:
            return EngineError(text)

    def status(self, *, checksums: bool = True) -> dict[str, Any]:
        """Every actor's own account (:func:`rollout_loader.vllm.worker.transfer_status`, needs the status extension);
        the fields of the first, plus ``replicas`` (each actor's) and a check that all hold the same step."""
        replies = self._each("collective_rpc", "deltasync_transfer_status", args=(checksums,))
        replicas = []
        for i, ranks in enumerate(replies):
            if not (isinstance(ranks, list) and ranks):
                raise EngineError(f"Ray actor {i}: expected one status per rank, got {str(ranks)[:200]}")
            replicas.append(combine_status(ranks, where=f"Ray actor {i}"))
        held = [r["held_step"] for r in replicas]
        if len(set(held)) != 1:
            raise EngineError(f"the Ray actors hold different steps: {held}")
        return {**replicas[0], "replicas": replicas}


def _has(handle: Any, method: str) -> bool:
    """Whether an actor's class has ``method`` (an ``AsyncLLM`` has ``pause_generation``, an ``LLM`` has not)."""
    try:
        return callable(getattr(handle, method))
    except AttributeError:
        return False

