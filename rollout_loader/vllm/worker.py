"""A vLLM worker extension that applies deltasync delta objects to the live weights, on every rank.

Use with ``LLM(..., worker_extension_cls="rollout_loader.worker.DeltaWorkerExtension")``; from the driver::

    rpc(llm, "deltasync_init", layout_json, "auto")  # once: routing table (JSON {name: shape}, or None)
    apply_patch(llm, delta_object)  # every step: a FORMAT.md delta object (bytes, or a path); all ranks or none
    engine_checksums(llm) == trainer_checksums  # bit-exact proof
    rpc(llm, "deltasync_rollback")  # undo the last apply
    transfer_status(llm)  # the weight-transfer engine's view: held step, how each step arrived, checksums

The only wire format is the deltasync object (docs/FORMAT.md): the worker opens it with deltasync's own
validating reader, so a damaged object is a ``FormatError`` and changes nothing. The worker methods take
plain arguments (JSON strings, bytes, file paths: tensors do not survive ``collective_rpc`` in multiprocess
mode) and reply ``{"ok": ..., "result" | "error", "message"}`` rather than raising (see :func:`rpc`). After
every apply or rollback call ``llm.reset_prefix_cache()`` (:func:`apply_patch` does).

For a server, the weight-transfer engine (:mod:`rollout_loader.vllm.engine`) is the better path: it reads
the store itself and is driven by vLLM's own routes.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import time
from collections.abc import Callable
from typing import Any

import torch

from deltasync import CorruptObjectError, FormatError, StepObject, TensorMismatchError
from rollout_loader.routing import RoutingError

from . import state as st
from .layout import checkpoint_layout, parse_layout
from .plan import build_state
from .live_cpu import LIVE_ENV, enable_live_cpu_weights, install_dispatch_hook, live_linear
from .state import Mode, PatchError, WorkerState

log = logging.getLogger(__name__)

__all__ = ["LIVE_ENV", "DeltaWorkerExtension", "PatchError", "RoutingError", "apply_patch", "enable_live_cpu_weights",
           "engine_checksums", "install_dispatch_hook", "live_linear", "rpc", "transfer_status", "unwrap_replies"]

_ERRORS: dict[str, type[Exception]] = {
    e.__name__: e for e in (PatchError, RoutingError, FormatError, CorruptObjectError, TensorMismatchError)
}


def rpc(llm: Any, method: str, *args: Any, timeout: float | None = None) -> list[Any]:
    """``llm.collective_rpc(method, args=args)`` for the deltasync methods: one result per rank.

    Raises the first failed rank's error with its own type (PatchError, RoutingError, FormatError, ...;
    else RuntimeError).
    """
    return unwrap_replies(method, llm.collective_rpc(method, timeout=timeout, args=args))


def unwrap_replies(method: str, replies: list[dict[str, Any]]) -> list[Any]:
    """The per-rank results of a deltasync worker method, or its error raised (for ``AsyncLLM`` callers too)."""
    failed = [(rank, r) for rank, r in enumerate(replies) if not r["ok"]]
    if failed:
        rank, r = failed[0]
        where = f"{method} failed on {len(failed)} of {len(replies)} rank(s); rank {rank}"
        raise _ERRORS.get(r["error"], RuntimeError)(f"{where}: {r['error']}: {r['message']}")
    return [r["result"] for r in replies]


def apply_patch(llm: Any, obj: bytes | str, *, timeout: float | None = None) -> list[dict[str, Any]]:
    """Apply a delta object (its bytes, or a path) on every rank, all or nothing, then drop the prefix cache.

    If any rank fails, every rank rolls back (those that failed have already restored themselves).
    """
    try:
        return rpc(llm, "deltasync_apply", obj, timeout=timeout)
    except Exception:
        rpc(llm, "deltasync_rollback", timeout=timeout)
        raise
    finally:
        llm.reset_prefix_cache()


def engine_checksums(llm: Any, names: list[str] | None = None) -> dict[str, int]:
    """Checksum of every checkpoint tensor as the engine holds it: the ranks' owned parts added up."""
    parts = rpc(llm, "deltasync_checksums", names)
    return {name: sum(p[name] for p in parts) & ((1 << 64) - 1) for name in parts[0]}


def transfer_status(llm: Any, *, checksums: bool = True) -> dict[str, Any]:
    """What the deltasync weight-transfer engine holds, from every rank of an engine in any mode (the engine
    lives in the workers; an ``LLM`` in multiprocess mode reaches it only through ``collective_rpc``).

    Returns ``{"held_step", "arrived": {step: "rdma" | "store: <why>"}, "pauses_s": [...], "checksums"}``:
    the held step every rank agrees on (``EngineError`` when they differ), per step ``"rdma"`` only if every
    rank read it over NIXL (else the first rank's reason), rank 0's pauses, and each tensor's checksum with
    the ranks' parts added up (with ``checksums``).
    """
    from deltasync import EngineError

    ranks = rpc(llm, "deltasync_transfer_status", checksums)
    held = {r["held_step"] for r in ranks}
    if len(held) != 1:
        raise EngineError(f"the engine's ranks hold different steps: {[r['held_step'] for r in ranks]}")
    arrived: dict[int, str] = {}
    for r in ranks:
        for step, how in r["arrived"].items():
            if arrived.get(int(step), "rdma") == "rdma":
                arrived[int(step)] = how
    sums = {n: sum(r["checksums"][n] for r in ranks) & ((1 << 64) - 1) for n in ranks[0]["checksums"]} if checksums else {}
    return {"held_step": held.pop(), "arrived": arrived, "pauses_s": ranks[0]["pauses_s"], "checksums": sums}


def _replies(method: Callable[..., Any]) -> Callable[..., dict[str, Any]]:
    """Turn a worker method's exceptions into an error reply; :func:`rpc` raises them again on the driver.

    With several ranks, vLLM 0.32's multiprocess executor raises on the first rank that fails without reading
    the other ranks' replies, and every later ``collective_rpc`` then receives stale replies. A worker method
    that never raises keeps the channel in step (and the driver gets the error's own type back).
    """

    @functools.wraps(method)
    def call(self: Any, *args: Any, **kwargs: Any) -> dict[str, Any]:
        try:
            return {"ok": True, "result": method(self, *args, **kwargs)}
        except Exception as e:
            expected = isinstance(e, (FormatError, TensorMismatchError))
            log.log(logging.WARNING if expected else logging.ERROR, "%s failed: %s", method.__name__, e, exc_info=not expected)
            return {"ok": False, "error": type(e).__name__, "message": str(e)}

    return call


def _open(obj: bytes | str, where: str) -> StepObject:
    """A delta or anchor object from its bytes or a local path (validated by deltasync's reader)."""
    if isinstance(obj, str) and not obj:
        raise FormatError(f"{where}: expected a deltasync object (bytes or a path), got an empty string")
    if isinstance(obj, str) and not os.path.exists(obj):
        raise FormatError(f"{where}: no object at {obj!r} on the engine's machine (a server needs a shared filesystem)")
    return StepObject(obj, where=where if isinstance(obj, bytes) else obj)


class DeltaWorkerExtension:
    """Methods mixed into every vLLM worker; call them through ``collective_rpc``."""

    _deltasync: WorkerState | None = None

    @_replies
    def deltasync_init(self, layout_json: str | None = None, mode: Mode = "auto", weights_path: str | None = None,
                       ignore: list[str] | None = None) -> dict[str, Any]:
        """Build the routing table (once) for the checkpoint ``{name: shape}`` JSON (None: the engine's own
        checkpoint). ``mode``: see :func:`rollout_loader.vllm.plan.build_state`. Returns a summary."""
        checkpoint = weights_path or self.vllm_config.model_config.model  # type: ignore[attr-defined]
        if layout_json in ("", "null"):  # HTTP /collective_rpc passes strings only
            layout_json = None
        engine = getattr(self, "weight_transfer_engine", None)
        shared = getattr(engine, "_state", None) if layout_json is None and weights_path is None else None
        if shared is not None:  # the deltasync weight-transfer engine follows a stream here: one state, its routes
            self._deltasync = shared
            return {"mode": shared.mode, "tensors": len(shared.targets), "tp_rank": shared.table.tp_rank,
                    "tp_size": shared.table.tp_size, "shared_with": "weight-transfer engine"}
        layout = parse_layout(layout_json) if layout_json is not None else checkpoint_layout(checkpoint)
        self._deltasync, summary = build_state(
            self.get_model(), layout=layout, checkpoint=checkpoint, mode=mode, reload=self._reload, ignore=ignore,  # type: ignore[attr-defined]
        )
        return summary

    @_replies
    def deltasync_apply(self, obj: bytes | str) -> dict[str, Any]:
        """Apply a delta object in place; all or nothing on this rank. Returns this rank's checksum parts."""
        state = self._state()
        t0 = time.perf_counter()
        state.undo, state.undo_modules, state.undo_sums = [], set(), {}  # a failed apply leaves nothing to undo
        with _open(obj, "deltasync_apply") as step:
            if step.header.kind != "delta":
                raise PatchError(f"{step.where}: an anchor is loaded with deltasync_load, not applied as a patch")
            st.check_header(state, step.header, step.where)
            staged = st.stage(state, step.patches())
        sums = st.write(state, staged)
        return {
            "checksums": sums,  # this rank's parts after the apply, for verification by the driver
            "tensors": len(staged),
            "elements": sum(int(s.idx.numel()) for s in staged),
            "modules_synced": len(state.undo_modules),
            "seconds": round(time.perf_counter() - t0, 4),
        }

    @_replies
    def deltasync_load(self, path: str, mode: Mode = "auto") -> dict[str, Any]:
        """Load a full checkpoint (a deltasync anchor, by path) through vLLM's ``reload_weights``, then rebuild
        the routing table and host copies from it, so the following deltas apply to exactly these bits."""
        t0 = time.perf_counter()
        with _open(path, "deltasync_load") as obj, torch.inference_mode():
            if obj.header.kind != "anchor":
                raise PatchError(f"{obj.where}: a delta is applied with deltasync_apply, not loaded")
            from .shadow import moe_modules, reload_as_loaded

            model = self.get_model()  # type: ignore[attr-defined]
            reload_as_loaded(self.vllm_config, model,  # type: ignore[attr-defined]
                             ((name, obj.read_tensor(name)) for name in obj.header.tensors), moe_modules(model))
        reload_s = time.perf_counter() - t0
        self._deltasync = None  # parameters may have been replaced: routes are rebuilt
        summary = type(self).deltasync_init.__wrapped__(self, None, mode, path)  # type: ignore[attr-defined]
        return {**summary, "reload_s": round(reload_s, 4), "seconds": round(time.perf_counter() - t0, 4)}

    @_replies
    def deltasync_rollback(self) -> bool:
        """Put back the bits the last apply changed; False when there is nothing to undo."""
        return st.rollback(self._state())

    @_replies
    def deltasync_checksums(self, names: list[str] | str | None = None) -> dict[str, int]:
        """``mix64-sum`` checksum of each checkpoint tensor over the elements this rank owns.

        ``names`` may be a JSON list (HTTP ``/collective_rpc`` passes strings only); None or "" for all.
        """
        state = self._state()
        if isinstance(names, str):
            names = json.loads(names) if names else None
        return st.checksums(state, names)

    @_replies
    def deltasync_transfer_status(self, checksums: bool = True) -> dict[str, Any]:
        """This rank's deltasync weight-transfer engine: held step, how each step's object arrived, pauses, and
        (with ``checksums``) the ``mix64-sum`` parts of every checkpoint tensor from the bits as they are."""
        engine = getattr(self, "weight_transfer_engine", None)
        if engine is None or not hasattr(engine, "held_step"):
            raise RuntimeError("this engine has no deltasync weight-transfer engine: start vLLM with "
                               "--weight-transfer-config '{\"backend\": \"deltasync\"}'")
        state = engine._state  # the routes the engine writes through: its checksums are the engine's bits
        if state is None:
            raise RuntimeError("call init_weight_transfer_engine first")
        rdma = engine._rdma  # its RdmaConsumer (None without init_info rdma)
        return {
            "held_step": engine.held_step,
            "arrived": {str(s): how for s, how in (rdma.arrived if rdma is not None else {}).items()},
            "pauses_s": list(engine.pauses_s),
            "checksums": st.checksums(state) if checksums else {},
        }

    def _state(self) -> WorkerState:
        if self._deltasync is None:
            raise RuntimeError("call collective_rpc('deltasync_init', ...) first")
        return self._deltasync

    def _reload(self, weights: list[tuple[str, torch.Tensor]], modules: set[str]) -> None:
        from .shadow import reload_as_loaded

        reload_as_loaded(self.vllm_config, self.get_model(), weights, modules)  # type: ignore[attr-defined]


install_dispatch_hook()
