"""Clients of the deltasync weight-transfer engine inside a vLLM engine, in this process or over HTTP.

Both speak vLLM's own weight-transfer API, so only step numbers travel and the engine reads the store itself:

* :class:`HttpWeightTransfer`: the routes of a server started with ``--weight-transfer-config '{"backend":
  "deltasync"}'`` and ``VLLM_SERVER_DEV_MODE=1``. What ``deltasync follow URL --server HOST`` uses.
* :class:`LocalWeightTransfer`: the same calls on an offline ``vllm.LLM`` in this process.

:class:`~rollout_loader.vllm.VllmTarget` drives either for a ``Follower``. Imports no vLLM.

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
from typing import Annotated, Any, Literal, Protocol, get_args

import msgspec

from deltasync import DeltaSyncError
from deltasync.engine import redact_url
from deltasync.errors import (
    ConfigError,
    EngineConfigError,
    EngineError,
    EngineUnreachableError,
    in_text,
)

from .settings import EngineSettings

log = logging.getLogger(__name__)

WORKER_EXTENSION = "rollout_loader.vllm.worker.DeltaWorkerExtension"
WEIGHT_TRANSFER_CONFIG = '{"backend": "deltasync"}'
DEV_MODE_ENV = "VLLM_SERVER_DEV_MODE"
PauseMode = Literal["keep", "wait", "abort"]
# routes of vLLM's weight-transfer API, some only with VLLM_SERVER_DEV_MODE=1 (vllm/entrypoints/rl/online)
WEIGHT_ROUTES = ("/init_weight_transfer_engine", "/start_weight_update", "/update_weights", "/finish_weight_update",
                 "/weight_info", "/pause", "/resume", "/reset_prefix_cache", "/collective_rpc", "/server_info")
# how vLLM 0.32 reports a collective_rpc method the workers do not have: the multiprocess executor relays the
# worker's AttributeError, the in-process one raises NotImplementedError (vllm/v1/serial_utils.py run_method)
_NO_METHOD = re.compile(r"has no attribute '(deltasync_\w+)'|Method '(deltasync_\w+)' is not implemented")
_NOT_CONFIGURED = "Weight transfer not configured"  # vllm/v1/worker/gpu_worker.py _check_weight_transfer_engine


def _missing_method(text: str) -> str | None:
    """The deltasync worker method an engine says its workers lack, if that is what ``text`` says."""
    m = _NO_METHOD.search(text)
    return (m.group(1) or m.group(2)) if m else None


def _relayed(where: str, text: str, *, engine: str, setup: str) -> DeltaSyncError | None:
    """What a worker's error means, from the text vLLM relays (``None``: not one of these): a vLLM engine without
    a weight-transfer engine (``setup`` says how to give it one), or the deltasync engine's own error, rebuilt from
    the record leading its text (``deltasync.errors.in_text``: its class, and whether retrying can help).
    ``engine`` names the engine in the message."""
    if _NOT_CONFIGURED in text:
        return EngineConfigError(f"{where}: {engine} has no weight-transfer engine: {setup}")
    return in_text(text, where=f"{where}: {engine}'s deltasync engine")


def _step_of(version: Any) -> int | None:
    """The step a weight version names (None: one that names none, such as vLLM's ``"default"``). ASCII digits
    only, whole: ``str.isdigit`` also takes "²", which ``int`` then refuses."""
    return int(version) if isinstance(version, str) and re.fullmatch(r"[0-9]{1,12}", version) else None


MAX_REPLY_BYTES = 64 << 20  # a status of every tensor's checksum on a large model is megabytes; nothing is more
# an error's body: vLLM's JSON around the engine's error (its record and a message of up to a few thousand characters,
# JSON-escaped); read whole, or the record in it cannot be parsed and the error's class is lost
MAX_ERROR_BODY_BYTES = 64 << 10


class _NoRedirect(urllib.request.HTTPRedirectHandler):
    """Redirects are refused: a server that sends the client elsewhere (another host) would otherwise receive
    nothing while the client reported each step live."""

    def redirect_request(self, req, fp, code, msg, headers, newurl):  # noqa: ANN001 - urllib's signature
        raise urllib.error.HTTPError(req.full_url, code, f"redirect to {newurl!r} refused", headers, fp)


_OPENER = urllib.request.build_opener(_NoRedirect)


def combine_status(ranks: list[Any], *, where: str) -> dict[str, Any]:
    """One status from every rank's ``deltasync_transfer_status`` reply (:mod:`rollout_loader.vllm.worker`): the
    held step every rank agrees on, per step ``"rdma"`` only if every rank read it over NIXL (else the first
    rank's reason), rank 0's pauses, each tensor's checksum with the ranks' parts added up, and the host memory
    the ranks keep as host copies of checkpoint tensors (``host_bytes``, summed). A reply that
    is not one is an ``EngineError`` naming ``where``."""
    from deltasync.engine import add_checksums

    keys = {"held_step", "arrived", "pauses_s", "checksums"}
    checked: list[_RankStatus] = []
    for rank, r in enumerate(ranks):
        if isinstance(r, dict) and isinstance(r.get("error"), str):
            raise EngineError(f"{where}: rank {rank}: {r['error'][:2000]}")
        try:  # every field typed and ranged: a reply that is not a status is an error, never a crash
            checked.append(msgspec.convert(r, _RankStatus, strict=True))
            if any(v >> 64 for v in checked[-1].checksums.values()):
                raise msgspec.ValidationError("a checksum past 64 bits")
        except msgspec.ValidationError as e:
            raise EngineError(f"{where}: rank {rank}: expected a deltasync status with {sorted(keys)}, got "
                              f"{str(r)[:200]} ({e})") from None
    held = {r.held_step for r in checked}
    if len(held) != 1:
        raise EngineError(f"{where}: the engine's ranks hold different steps: {[r.held_step for r in checked]}")
    arrived: dict[int, str] = {}
    for r in checked:
        for step, how in r.arrived.items():
            if arrived.get(int(step), "rdma") == "rdma":
                arrived[int(step)] = how
    names = checked[0].checksums
    if any(r.checksums.keys() != names.keys() for r in checked):
        raise EngineError(f"{where}: the engine's ranks report checksums of different tensors")
    sums = {n: add_checksums(*(r.checksums[n] for r in checked)) for n in names}
    return {"held_step": held.pop(), "arrived": arrived, "pauses_s": checked[0].pauses_s, "checksums": sums,
            "host_bytes": sum(r.host_bytes for r in checked),
            "fingerprint": _combine_prints([r.fingerprint for r in checked], where=where),
            "applied_unix_s": checked[0].applied_unix_s,
            "last_error": next((r.last_error for r in checked if r.last_error is not None), None)}


_CHECK_ORDER = ("mismatch", "refused", "pending", "no reference", "match", "off")  # the worst rank's decides


def _combine_prints(prints: list[_RankPrint | None], *, where: str) -> dict[str, Any] | None:
    """The engine's runtime fingerprint from its ranks' (docs/FORMAT.md section 5f): one configuration key, the
    step every rank fingerprinted, the engine digest of the ranks' digests in rank order (None until every rank
    has one for the same step), the worst rank's comparison with the reference."""
    from deltasync.engine import engine_fingerprint

    if any(p is None for p in prints):
        return None  # an engine that predates fingerprints
    ranks = sorted((p for p in prints if p is not None), key=lambda p: p.rank)
    if [p.rank for p in ranks] != list(range(len(ranks))):
        raise EngineError(f"{where}: the engine's ranks report fingerprints of ranks {[p.rank for p in ranks]}")
    if len({p.config_key for p in ranks}) != 1:
        raise EngineError(f"{where}: the engine's ranks report different configurations: "
                          f"{sorted({str(p.config_key) for p in ranks})}")
    steps = {p.step for p in ranks}
    digests = [p.digest for p in ranks]
    whole = len(steps) == 1 and all(d is not None for d in digests)
    checks = [p.check for p in ranks if p.check is not None]
    out: dict[str, Any] = {
        "config_key": ranks[0].config_key, "config": ranks[0].config, "when": ranks[0].when,
        "step": steps.pop() if len(steps) == 1 else None,
        "fingerprint": engine_fingerprint([d for d in digests if d is not None]) if whole else None,
        "ranks": digests,
        "check": min(checks, key=_CHECK_ORDER.index) if checks else None,
        "note": next((p.note for p in ranks if p.note), ""),
        "seconds": max((p.seconds for p in ranks if p.seconds is not None), default=None),
        "opaque": sum(p.opaque for p in ranks),
        "unhealthy": next((p.unhealthy for p in ranks if p.unhealthy), None),
    }
    if all(p.tensors is not None for p in ranks):
        out["tensors"] = [p.tensors for p in ranks]
    return out


_Text = Annotated[str, msgspec.Meta(max_length=4000)]


class _RankPrint(msgspec.Struct, forbid_unknown_fields=False):
    """One rank's ``fingerprint`` record in its status (rollout_loader/vllm/engine.py ``fingerprint_status``)."""

    # whole matches (\Z): "$" also matches before a trailing newline, which the heartbeat's patterns refuse
    config_key: Annotated[str, msgspec.Meta(pattern=r"^[0-9a-f]{16}\Z")] | None
    config: dict[Annotated[str, msgspec.Meta(max_length=64)], str | int | float | bool | None] = {}
    when: Literal["after", "pause", "off"] | None = None
    step: Annotated[int, msgspec.Meta(ge=0, le=10**12 - 1)] | None = None
    digest: Annotated[str, msgspec.Meta(pattern=r"^[0-9a-f]{64}\Z")] | None = None
    check: Literal["match", "mismatch", "no reference", "refused", "pending", "off"] | None = None
    note: _Text = ""
    seconds: Annotated[float, msgspec.Meta(ge=0.0, le=1e9)] | None = None
    opaque: Annotated[int, msgspec.Meta(ge=0, le=1 << 30)] = 0
    unhealthy: _Text | None = None
    rank: Annotated[int, msgspec.Meta(ge=0, le=1 << 16)] = 0
    tensors: dict[Annotated[str, msgspec.Meta(max_length=1024)], list[Any]] | None = None


class _RankStatus(msgspec.Struct, forbid_unknown_fields=False):
    """One rank's ``deltasync_transfer_status`` reply (rollout_loader/vllm/worker.py), as it must be."""

    held_step: Annotated[int, msgspec.Meta(ge=0, le=10**12 - 1)] | None
    arrived: dict[Annotated[str, msgspec.Meta(pattern=r"^[0-9]{1,12}\Z")],
                  Annotated[str, msgspec.Meta(max_length=2000)]]
    pauses_s: list[Annotated[float, msgspec.Meta(ge=0.0, le=1e9)]]
    # and < 2**64
    checksums: dict[Annotated[str, msgspec.Meta(min_length=1, max_length=1024)], Annotated[int, msgspec.Meta(ge=0)]]
    # bytes of host copies of checkpoint tensors this rank keeps (stated at init; 0 from an engine that predates it)
    host_bytes: Annotated[int, msgspec.Meta(ge=0, le=2**62)] = 0
    fingerprint: _RankPrint | None = None  # None from an engine that predates runtime fingerprints
    applied_unix_s: Annotated[float, msgspec.Meta(ge=0.0, le=1e11)] | None = None
    last_error: _Text | None = None


def _read_bounded(reply: Any, url: str, deadline: float, timeout_s: float) -> bytes:
    """The reply's body, at most ``MAX_REPLY_BYTES``, read before ``deadline``; else an ``EngineError``."""
    chunks: list[bytes] = []
    total = 0
    while True:
        if time.monotonic() > deadline:
            raise EngineError(f"{url}: the reply did not arrive whole within {timeout_s:g}s")
        chunk = reply.read1(1 << 16) if hasattr(reply, "read1") else reply.read(1 << 16)
        if not chunk:
            return b"".join(chunks)
        total += len(chunk)
        if total > MAX_REPLY_BYTES:
            raise EngineError(f"{url}: the reply is over {MAX_REPLY_BYTES} bytes: not a vLLM server's answer")
        chunks.append(chunk)


class HttpWeightTransfer:
    """vLLM's weight-transfer routes on a server running the deltasync engine; only step numbers are sent.

    The server needs ``VLLM_SERVER_DEV_MODE=1`` and ``--weight-transfer-config '{"backend": "deltasync"}'``
    (plus ``DELTASYNC_CPU_LIVE_WEIGHTS=1`` on CPU for in-place writes); the stream must be readable from the
    server (its URL and storage options are sent in ``init_info``). ``/weight_info`` tells which step the
    server holds (:meth:`held_step`), so a restarted client goes on from there.
    """

    def __init__(self, base_url: str, *, timeout_s: float = 600.0, check_timeout_s: float = 30.0,
                 pause_mode: PauseMode = "keep") -> None:
        parts = urllib.parse.urlsplit(base_url)
        if parts.scheme not in ("http", "https") or not parts.netloc:
            raise ConfigError(f"{redact_url(base_url)!r} is not a server URL: expected http://host:port (a vLLM OpenAI "
                              "server)")
        if parts.username is not None or parts.password is not None:  # never sent, and it would show in messages
            raise ConfigError(f"{redact_url(base_url)!r}: a server URL carries no user or password (they would not be "
                              "sent, and messages would show them); expected http://host:port")
        if pause_mode not in get_args(PauseMode):
            raise ConfigError(f"{type(self).__name__}: pause_mode must be one of {get_args(PauseMode)}, not "
                              f"{pause_mode!r}")
        self.base_url = base_url.rstrip("/")
        self.timeout_s = timeout_s
        self.check_timeout_s = check_timeout_s
        self.pause_mode = pause_mode
        self.pauses_s: list[float] = []

    def _request(self, method: str, route: str, body: dict | None = None, *, timeout_s: float | None = None,
                 **query: str) -> Any:
        url = f"{self.base_url}{route}" + (f"?{urllib.parse.urlencode(query)}" if query else "")
        data = json.dumps(body).encode() if body is not None else (b"" if method == "POST" else None)
        req = urllib.request.Request(url, data=data, method=method, headers={"Content-Type": "application/json"})
        timeout_s = self.timeout_s if timeout_s is None else timeout_s
        deadline = time.monotonic() + timeout_s  # for the whole call: a reply dripping a byte at a time ends too
        try:
            with _OPENER.open(req, timeout=timeout_s) as r:
                if r.status != 200:  # 201, 204, ...: not what these routes answer
                    raise EngineError(f"{url}: expected HTTP 200, got {r.status} {r.reason}")
                text = _read_bounded(r, url, deadline, timeout_s)
        except urllib.error.HTTPError as e:
            if 300 <= e.code < 400:
                raise EngineError(f"{url}: HTTP {e.code}: {e.reason} (the client follows no redirect: give the "
                                  f"server's own address)") from None
            said = (e.read(MAX_ERROR_BODY_BYTES) or b"").decode(errors="replace")
            raise self._refusal(url, route, e.code, said) from None
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

    def reset_prefix_cache(self) -> None:
        reply = self._post("/reset_prefix_cache")
        if isinstance(reply, dict) and reply.get("success") is False:  # blocks still held by paused requests
            log.warning("%s: the prefix cache could not be reset now (blocks in use); vLLM resets it when free",
                        self.base_url)

    def pause(self) -> None:
        self._post("/pause", mode=self.pause_mode)

    def resume(self) -> None:
        self._post("/resume")

    def _refusal(self, url: str, route: str, status: int, text: str) -> DeltaSyncError:
        if status == 404 and route in WEIGHT_ROUTES:
            return EngineConfigError(
                f"{url}: HTTP 404, the server has no {route} endpoint: start the vLLM server with {DEV_MODE_ENV}=1 "
                f"(it enables vLLM's weight-transfer routes); is {self.base_url} a vLLM server?"
            )
        if "Invalid init_info" in text or "Invalid update_info" in text:  # vLLM's words for unknown keys
            return EngineConfigError(f"{url}: HTTP {status}: {' '.join(text[:600].split())}")
        relayed = _relayed(url, text, engine="the server",
                           setup=f"start it with --weight-transfer-config '{WEIGHT_TRANSFER_CONFIG}'")
        if relayed is not None:
            return relayed
        missing = _missing_method(text) if route == "/collective_rpc" else None
        if missing:
            return EngineConfigError(f"{url}: the server's workers have no method {missing!r}: start the server with "
                                     f"--worker-extension-cls {WORKER_EXTENSION} to read its status")
        return EngineError(f"{url}: HTTP {status}: {' '.join(text[:500].split())}")

    def weight_version(self) -> str:
        """The server's weight version (``GET /weight_info``); changes nothing."""
        reply = self._request("GET", "/weight_info", timeout_s=self.check_timeout_s)
        version = reply.get("weight_version") if isinstance(reply, dict) else None
        if not isinstance(version, str):
            raise EngineError(f"{self.base_url}/weight_info: expected {{'weight_version': str}}, got "
                              f"{str(reply)[:200]}")
        return version

    def held_step(self) -> int | None:
        """The step the server holds, from its weight version (None: a version that names no step, such as
        vLLM's ``"default"`` of a server that was never updated)."""
        return _step_of(self.weight_version())

    def served_dtype(self) -> str:
        """The dtype the server holds its model in, as vLLM names it (``"torch.bfloat16"``), from ``GET
        /server_info?config_format=json`` (a route of ``VLLM_SERVER_DEV_MODE=1``); changes nothing."""
        reply = self._request("GET", "/server_info", timeout_s=self.check_timeout_s, config_format="json")
        config = reply.get("vllm_config") if isinstance(reply, dict) else None
        model = config.get("model_config") if isinstance(config, dict) else None
        dtype = model.get("dtype") if isinstance(model, dict) else None
        if not isinstance(dtype, str) or len(dtype) > 64:
            raise EngineError(f"{self.base_url}/server_info: expected vllm_config.model_config.dtype, got "
                              f"{str(reply)[:200]}")
        return dtype

    def init(self, settings: EngineSettings) -> None:
        """``/init_weight_transfer_engine``: point the server's deltasync engine at a stream (again, the same
        stream: a no-op that keeps the step it holds)."""
        self._post("/init_weight_transfer_engine", {"init_info": settings.init_info()})

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
            held = self.held_step()  # read back: the server itself must name the step, not only answer 200
            if held != step:
                raise EngineError(f"{self.base_url}/weight_info: the server says it holds step {held} after an update "
                                  f"to step {step} answered as done")
        finally:
            try:
                self.reset_prefix_cache()
            finally:
                self.resume()
                self.pauses_s.append(time.perf_counter() - t0)

    def status(self, *, checksums: bool = True) -> dict[str, Any]:
        """What the server's deltasync engine holds (see :func:`rollout_loader.vllm.worker.transfer_status`),
        through ``/collective_rpc``; needs ``--worker-extension-cls
        rollout_loader.vllm.worker.DeltaWorkerExtension``."""
        reply = self._post("/collective_rpc", {"method": "deltasync_transfer_status", "args": [checksums]})
        ranks = reply.get("results") if isinstance(reply, dict) else None
        if not (isinstance(ranks, list) and ranks and all(isinstance(r, dict) for r in ranks)):
            raise EngineError(f"{self.base_url}/collective_rpc: expected one status per rank, got {str(reply)[:200]}")
        return combine_status(ranks, where=f"{self.base_url}/collective_rpc")


class LocalWeightTransfer:
    """The same calls as :class:`HttpWeightTransfer` on an offline ``vllm.LLM`` in this process, created with
    ``weight_transfer_config={"backend": "deltasync"}`` (:func:`~rollout_loader.vllm.start_engine` does).

    Calls run between ``generate()`` calls (a safe point): nothing is paused. Raises ``EngineConfigError``
    when the engine has no weight-transfer engine.
    """

    def __init__(self, llm: Any) -> None:
        self.llm = llm
        self.pauses_s: list[float] = []

    def _call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        """``llm.<method>(...)``; an error relayed from a worker process comes back as the error it was (its class
        named in the text: see :func:`rollout_loader.vllm.engine._named`), an in-process one as it is."""
        try:
            return getattr(self.llm, method)(*args, **kwargs)
        except DeltaSyncError as e:  # raised in this process, its record leading its text: the same error, plainly
            plain = in_text(str(e))
            raise (plain if plain is not None else e) from e
        except Exception as e:
            relayed = _relayed(method, str(e), engine="the vLLM engine", setup=(
                f"create it with LLM(..., weight_transfer_config={WEIGHT_TRANSFER_CONFIG}) or "
                "rollout_loader.vllm.start_engine"))
            if relayed is None:
                raise
            raise relayed from e

    def held_step(self) -> int | None:
        """The step the engine holds, from its weight version (None: one that names no step)."""
        return _step_of(self._call("get_weight_version"))

    def init(self, settings: EngineSettings) -> None:
        """``init_weight_transfer_engine``: point the engine at a stream (see :meth:`HttpWeightTransfer.init`)."""
        self._call("init_weight_transfer_engine", {"init_info": settings.init_info()})

    def update(self, step: int) -> None:
        """Bring the engine to ``step``, verified, with version ``str(step)``; on a failure it keeps its step."""
        t0 = time.perf_counter()
        try:
            self._call("start_weight_update")
            self._call("update_weights", {"update_info": {"step": step}})
            self._call("finish_weight_update", weight_version=str(step))
        finally:
            try:
                self.llm.reset_prefix_cache()
            finally:
                self.pauses_s.append(time.perf_counter() - t0)

    def status(self, *, checksums: bool = True) -> dict[str, Any]:
        """What the engine's deltasync engine holds (:func:`rollout_loader.vllm.worker.transfer_status`)."""
        try:
            ranks = self.llm.collective_rpc("deltasync_transfer_status", args=(checksums,))
        except Exception as e:
            if _missing_method(str(e)) is None:
                raise
            raise EngineConfigError(f"the engine's workers have no method 'deltasync_transfer_status': create it with "
                                    f"LLM(..., worker_extension_cls={WORKER_EXTENSION!r}) or "
                                    f"rollout_loader.vllm.start_engine") from e
        return combine_status(ranks, where="collective_rpc")


class WeightTransfer(Protocol):
    """What :class:`~rollout_loader.vllm.VllmTarget` needs from an engine's weight-transfer API: which step the
    engine holds (None: unknown), pointing it at a stream, moving it to a step (verified, all or nothing), and its
    own account of its weights."""

    pauses_s: list[float]

    def held_step(self) -> int | None: ...
    def init(self, settings: EngineSettings) -> None: ...
    def update(self, step: int) -> None: ...
    def status(self, *, checksums: bool = True) -> dict[str, Any]: ...


SYNC_CLIENT_METHODS = ("init_weight_transfer_engine", "start_weight_update", "update_weights", "finish_weight_update")
"""vLLM's ``VLLMWeightSyncClient`` protocol (vllm/distributed/weight_transfer/base.py): any object with these."""


class SyncClientTransfer:
    """Any vLLM ``VLLMWeightSyncClient`` (vLLM's ``HTTPVLLMWeightSyncClient``, a framework's own) driving the
    deltasync engine: ``init_weight_transfer_engine(init_info)``, then per step ``start_weight_update``,
    ``update_weights({"step": N})``, ``finish_weight_update(str(N))``.

    The protocol has four methods and nothing more, so this client gets what they give: it cannot pause
    generation (a step is applied between forward passes, as vLLM applies any update), cannot ask which step the
    engine holds (a :class:`~rollout_loader.vllm.VllmTarget` then trusts the step it set, or the settings'
    ``step``), cannot reset the prefix cache (prompts cached before the update keep their old KV: the caller
    resets it, or uses :class:`HttpWeightTransfer` / :class:`~rollout_loader.vllm.RayWeightTransfer`, which do)
    and cannot read the engine's status (``EngineConfigError``). Errors relayed from the engine come back as the
    deltasync errors they were.
    """

    def __init__(self, client: Any) -> None:
        missing = [m for m in SYNC_CLIENT_METHODS if not callable(getattr(client, m, None))]
        if missing:
            raise ConfigError(f"expected a vLLM VLLMWeightSyncClient (methods {', '.join(SYNC_CLIENT_METHODS)}), got "
                              f"{type(client).__name__} without {', '.join(missing)}")
        self.client = client
        self.pauses_s: list[float] = []
        self._warned = False
        self._held: int | None = None  # the step this client's last update brought the engine to

    def _call(self, method: str, *args: Any) -> Any:
        try:
            return getattr(self.client, method)(*args)
        except DeltaSyncError as e:
            plain = in_text(str(e))
            raise (plain if plain is not None else e) from e
        except Exception as e:  # the client's own error type (requests' HTTPError, Ray's RayTaskError, ...)
            # an HTTP client's error names the status; the server's body (vLLM's JSON holding the engine's error) is
            # its response's text: each read on its own, as a relayed error's text must begin with its record
            body = getattr(getattr(e, "response", None), "text", None)
            for text in ([body] if isinstance(body, str) else []) + [str(e)]:
                relayed = _relayed(f"{type(self.client).__name__}.{method}", text, engine="the vLLM engine",
                                   setup=f"start it with --weight-transfer-config '{WEIGHT_TRANSFER_CONFIG}'")
                if relayed is not None:
                    raise relayed from e
            raise

    def held_step(self) -> int | None:
        """The step this client's last completed update named (the protocol has no way to ask the engine): None
        before its first. A new client of an engine updated before starts from the settings' ``step``."""
        return self._held

    def init(self, settings: EngineSettings) -> None:
        self._call("init_weight_transfer_engine", settings.init_info())

    def update(self, step: int) -> None:
        """``start_weight_update``, ``update_weights({"step": step})``, ``finish_weight_update(str(step))``."""
        if not self._warned:
            log.warning("%s: a plain vLLM weight-sync client cannot reset the engine's prefix cache after an update: "
                        "prompts cached before it keep their old KV until the caller resets it",
                        type(self.client).__name__)
            self._warned = True
        t0 = time.perf_counter()
        try:
            self._call("start_weight_update")
            self._call("update_weights", {"step": step})
            self._call("finish_weight_update", str(step))
            self._held = step
        finally:
            self.pauses_s.append(time.perf_counter() - t0)

    def status(self, *, checksums: bool = True) -> dict[str, Any]:
        raise EngineConfigError(f"{type(self.client).__name__}: a vLLM weight-sync client cannot read the engine's "
                                "status; use a server URL, an LLM, or Ray actor handles (RayWeightTransfer)")


def is_vllm_class(obj: Any, name: str) -> bool:
    """Whether ``obj`` is an instance of vLLM's own class ``name`` (exactly: a subclass may change what it sends),
    told without importing vLLM."""
    return type(obj).__name__ == name and type(obj).__module__.split(".")[0] == "vllm"
