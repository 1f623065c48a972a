"""A vLLM engine as a follower target through the worker extension: deltas written in place, checksums proven.

    llm = start_engine(model_dir)                          # or LLM(..., worker_extension_cls=WORKER_EXTENSION)
    loader = Follower(url, VllmTarget(llm))
    loader.sync()                                          # between generate() calls: a safe point

Each step: the follower has already fetched and verified the object (before anything pauses); the target
pauses generation (server: ``/pause?mode=keep``), asks every rank to apply the delta object (all ranks or
none), drops the prefix cache, compares the engine's checksums with the trainer's, and resumes. On a
mismatch it rolls back to the exact previous weights and raises: the engine never serves under a step
number that is not true.

For a server, prefer the weight-transfer engine (:mod:`rollout_loader.vllm.engine`, driven by
``deltasync follow URL --server HOST``): it reads the store itself, so no shared filesystem is needed. A
server here receives object paths.

Errors: ``VllmTarget`` checks its settings (``ConfigError``) and asks the engine whether it is set up for
deltasync before anything pauses; an engine that cannot be reached, lacks a flag or the worker extension
(``EngineConfigError`` names which), or fails a request raises an ``EngineError``, never a ``StoreError``.
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, Literal, get_args

from deltasync import (
    BaseStepMismatchError,
    ChecksumMismatchError,
    ConfigError,
    StepObject,
)

from .client import WORKER_EXTENSION, engine_client, worker_module

log = logging.getLogger(__name__)

Verify = Literal["incremental", "changed", "all"]
Mode = Literal["auto", "live", "reload"]
_MASK64 = (1 << 64) - 1


def _choice(name: str, value: Any, allowed: Any) -> None:
    options = get_args(allowed)
    if value not in options:
        raise ConfigError(f"VllmTarget: {name} must be one of {', '.join(map(repr, options))}, not {value!r}")


def _add(*parts: int) -> int:
    return sum(parts) & _MASK64


class VllmTarget:
    """A vLLM engine (an ``LLM``, a server URL, or an ``EngineClient``) kept at a step of a stream.

    ``step``: the step the engine already holds, if known (e.g. it was started from that step's replayed
    checkpoint); otherwise the first step applied is an anchor. ``mode`` is the worker's ("auto", "live",
    "reload"). Verification after each delta: ``"incremental"`` (default) updates each changed tensor's
    checksum from the old and the read-back new bits of the patched elements, starting from a checksum of
    the engine's own bits: O(changed) inside the pause, a proof by induction; ``"changed"`` recomputes the
    changed tensors' checksums from all their bits; ``"all"`` every tensor's. Anchors are always verified in
    full. ``pauses_s`` records how long each update held generation.
    """

    def __init__(self, engine: Any, *, step: int | None = None, mode: Mode = "auto", verify: Verify = "incremental") -> None:
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
        return {name: _add(*(p[name] for p in parts)) for name in parts[0]}

    def apply(self, obj: StepObject) -> None:
        h = obj.header
        if h.kind == "delta" and h.base_step != self._step:
            raise BaseStepMismatchError(
                f"{obj.where}: delta to step {h.step} is based on step {h.base_step}, the engine holds step {self._step}"
            )
        if h.kind == "delta" and not self._ready:
            self._init()
        with _as_file(obj) as path:  # before the pause: the workers read the object by path
            self.engine.pause()
            t0 = time.perf_counter()
            try:
                self._apply(obj, path)
            finally:
                self.engine.resume()
                self.pauses_s.append(time.perf_counter() - t0)

    def _apply(self, obj: StepObject, path: str) -> None:
        h = obj.header
        if h.kind == "anchor":
            self._step = None  # until verified, the engine holds no step we can name
            try:
                self.engine.rpc("deltasync_load", path, self.mode)
            finally:
                self.engine.reset_prefix_cache()
            self._ready = True
            names = list(h.tensors)
        else:
            try:
                replies = self.engine.rpc("deltasync_apply", path)  # all ranks or none
            except Exception:
                self._rollback()  # ranks that failed restored themselves; undo the others
                raise
            finally:
                self.engine.reset_prefix_cache()  # or prompts reuse KV computed with other weights
            names = list(h.tensors) if self.verify == "all" else [n for n, t in h.tensors.items() if t.changed]
        if h.kind == "delta" and self.verify == "incremental":
            sums = {n: _add(*(r["checksums"][n] for r in replies)) for n in names}
        else:
            sums = self.checksums(names) if names else {}
        bad = [n for n in names if sums[n] != int(h.tensors[n].checksum, 16)]
        if bad:
            if h.kind == "delta":
                self._rollback()
                self.engine.reset_prefix_cache()
            n = bad[0]
            raise ChecksumMismatchError(
                f"{obj.where}: the engine's weights do not match the trainer's after step {h.step} "
                f"({len(bad)} tensor(s), first {n!r}: expected {h.tensors[n].checksum}, engine has 0x{sums[n]:016x}); "
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


def start_engine(model_dir: str, *, live_cpu_weights: bool = True, in_process: bool = False,
                 weight_transfer: bool = False, **llm_kwargs: Any) -> Any:
    """A ``vllm.LLM`` ready to follow a stream: the worker extension installed, and on CPU (with
    ``live_cpu_weights``) linear weights kept live so that updates are in-place writes, as on GPU.

    ``weight_transfer`` also configures the deltasync weight-transfer engine (``llm.init_weight_transfer_engine``
    etc.). ``in_process`` runs the engine in this process (starts in seconds; one engine per process at a
    time). Raises ``MissingDependencyError`` (naming the extra) where vLLM is not installed.
    """
    worker = worker_module()
    if live_cpu_weights:
        worker.enable_live_cpu_weights()
    if in_process:
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        llm_kwargs.setdefault("distributed_executor_backend", "uni")
    if weight_transfer:
        from .plugin import register

        register()  # this process too: an in-process engine creates it here
        llm_kwargs.setdefault("weight_transfer_config", {"backend": "deltasync"})
    from vllm import LLM

    return LLM(model=str(model_dir), worker_extension_cls=WORKER_EXTENSION, **llm_kwargs)


@contextmanager
def _as_file(obj: StepObject) -> Iterator[str]:
    """The object's path; an object fetched into memory (a small delta from a remote store) is written to a
    temporary file for the call and removed after it. A multi-part (sharded) step has no single object."""
    if obj.path is not None:
        yield obj.path
        return
    buf = getattr(obj, "buffer", None)
    if buf is None:
        raise ConfigError(f"{obj.where}: a multi-part (sharded) step cannot go through the worker extension; "
                          "start vLLM with --weight-transfer-config '{\"backend\": \"deltasync\"}' instead")
    fd, path = tempfile.mkstemp(prefix="deltasync-object-", suffix=".safetensors")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(buf)
        yield path
    finally:
        os.unlink(path)
