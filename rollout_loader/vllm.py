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
"""

from __future__ import annotations

import json
import logging
import time
import urllib.error
import urllib.parse
import urllib.request
from typing import Any, Literal, Protocol

from deltasync.checksum import add, format_checksum, parse_checksum
from deltasync.errors import BaseStepMismatchError, ChecksumMismatchError, StoreError
from deltasync.format import StepObject

from .worker import rpc, unwrap_replies

log = logging.getLogger(__name__)

WORKER_EXTENSION = "rollout_loader.worker.DeltaWorkerExtension"
Verify = Literal["incremental", "changed", "all"]


class EngineClient(Protocol):
    """The four things the target needs from an engine."""

    def rpc(self, method: str, *args: str | None) -> list[Any]: ...
    def reset_prefix_cache(self) -> None: ...
    def pause(self) -> None: ...
    def resume(self) -> None: ...


class LocalEngine:
    """An offline ``vllm.LLM`` in this process. Calls run between engine steps: no explicit pause."""

    def __init__(self, llm: Any) -> None:
        self.llm = llm

    def rpc(self, method: str, *args: str | None) -> list[Any]:
        return rpc(self.llm, method, *args)

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
    """

    def __init__(self, base_url: str, *, timeout_s: float = 300.0, pause_mode: str = "keep") -> None:
        self.base_url = base_url.rstrip("/")
        self.timeout_s = timeout_s
        self.pause_mode = pause_mode

    def _post(self, route: str, body: dict | None = None, **query: str) -> Any:
        url = f"{self.base_url}{route}" + (f"?{urllib.parse.urlencode(query)}" if query else "")
        data = json.dumps(body).encode() if body is not None else b""
        req = urllib.request.Request(url, data=data, method="POST", headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=self.timeout_s) as r:
                text = r.read()
        except urllib.error.HTTPError as e:
            raise StoreError(f"{url}: HTTP {e.code}: {e.read()[:500].decode(errors='replace')}") from None
        except (urllib.error.URLError, OSError) as e:
            raise StoreError(f"{url}: the vLLM server is not reachable ({e})") from None
        return json.loads(text) if text else None

    def rpc(self, method: str, *args: str | None) -> list[Any]:
        reply = self._post("/collective_rpc", {"method": method, "args": ["" if a is None else a for a in args]})
        return unwrap_replies(method, reply["results"])

    def reset_prefix_cache(self) -> None:
        self._post("/reset_prefix_cache")

    def pause(self) -> None:
        self._post("/pause", mode=self.pause_mode)

    def resume(self) -> None:
        self._post("/resume")


def engine_client(engine: Any) -> EngineClient:
    if isinstance(engine, str):
        return HttpEngine(engine)
    if hasattr(engine, "collective_rpc"):
        return LocalEngine(engine)
    return engine


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
    """

    def __init__(
        self, engine: Any, *, step: int | None = None, mode: str = "auto", verify: Verify = "incremental"
    ) -> None:
        self.engine = engine_client(engine)
        self.mode = mode
        self.verify = verify
        self._step = step
        self.pauses_s: list[float] = []
        self._ready = False
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
                self.engine.rpc("deltasync_rollback")  # ranks that failed restored themselves; undo the others
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
                self.engine.rpc("deltasync_rollback")
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


def start_engine(model_dir: str, *, live_cpu_weights: bool = True, in_process: bool = False, **llm_kwargs: Any) -> Any:
    """A ``vllm.LLM`` ready to follow a stream: the worker extension installed, and on CPU (with
    ``live_cpu_weights``) linear weights kept live so that updates are in-place writes, as on GPU.

    ``in_process`` runs the engine in this process (starts in seconds; one engine per process at a time).
    """
    import os

    from .worker import enable_live_cpu_weights

    if live_cpu_weights:
        enable_live_cpu_weights()
    if in_process:
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        llm_kwargs.setdefault("distributed_executor_backend", "uni")
    from vllm import LLM

    return LLM(model=str(model_dir), worker_extension_cls=WORKER_EXTENSION, **llm_kwargs)
