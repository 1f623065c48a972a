"""A vLLM worker extension that applies sparse XOR patches to the live weights, in place, on every rank.

Use with ``LLM(..., worker_extension_cls="rollout_loader.worker.DeltaWorkerExtension")``; from the driver::

    rpc(llm, "deltasync_init", shapes_json, "auto")  # once: routing table (JSON {name: shape} or None)
    apply_patch(llm, encode_patch({name: (positions, xor)}))  # every step: all ranks or none
    engine_checksums(llm) == trainer_checksums  # bit-exact proof
    rpc(llm, "deltasync_rollback")  # undo the last apply

The worker methods (``deltasync_init``, ``deltasync_apply``, ``deltasync_checksums``, ``deltasync_rollback``)
take plain arguments (JSON strings, bytes, file paths: tensors do not survive ``collective_rpc`` in
multiprocess mode) and reply ``{"ok": ..., "result" | "error", "message"}`` rather than raising (see
:func:`rpc`). After every apply or rollback call ``llm.reset_prefix_cache()`` (:func:`apply_patch` does),
or prompts longer than one KV block reuse KV computed with the old weights.

A patch for one checkpoint tensor is ``positions`` (int64 flat indices, strictly ascending, or None for
every element) and ``xor`` (integers as wide as the dtype: old bits XOR new bits). It is mapped through a
routing table built once (:mod:`rollout_loader.routing`) onto this rank's slice of the engine parameter.

CPU backend: after loading, vLLM repacks CPU linear weights for oneDNN (``weight`` becomes an empty
tensor) or keeps a packed copy next to a still-present ``weight`` (the LM head), so writes to parameters
do not reach the matmuls. Two ways around it:

* live mode: :func:`enable_live_cpu_weights` before the engine loads (or env ``DELTASYNC_CPU_LIVE_WEIGHTS=1``)
  makes CPU linears run ``F.linear`` on their parameters, as on GPU; patches are pure in-place writes.
* reload mode, with the stock CPU path: layers whose weight is still there are patched in place and their
  kernel is rebuilt; layers whose weight was repacked away are re-loaded through vLLM's
  ``reload_weights`` from a host copy of their checkpoint tensors (all of q, k, v: a partial load leaves
  the other shards as garbage), which this extension keeps and patches.
"""

from __future__ import annotations

import functools
import json
import logging
import math
import os
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Literal

import torch
import torch.nn.functional as F
from safetensors import safe_open
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from deltasync.format._bits import DTYPES as _DTYPES
from deltasync.format._bits import int_view as int_bits
from deltasync.format.checksum import MASK64, add, checksum_elements

from .routing import (
    ParamSpec,
    Route,
    RoutingError,
    RoutingTable,
    Shard,
    build_routing_table,
    packed_resolver,
)

log = logging.getLogger(__name__)

LIVE_ENV = "DELTASYNC_CPU_LIVE_WEIGHTS"
Mode = Literal["auto", "live", "reload"]
Patch = Mapping[str, tuple[torch.Tensor | None, torch.Tensor]]
_CHUNK = 1 << 20
_SIGNED = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
# messages vLLM logs on every partial reload_weights call, for each layer it was not asked to reload
_RELOAD_LOGGERS = (
    "vllm.model_executor.model_loader.reload.inplace",
    "vllm.model_executor.model_loader.reload.layerwise",
)


class PatchError(ValueError):
    """A patch does not fit the engine (unknown tensor, bad positions or dtype); nothing was changed."""


# --- live CPU weights -------------------------------------------------------------------------------


def live_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """The CPU GEMM of live mode: a plain matmul on the parameter itself, so in-place writes take effect."""
    return F.linear(x, weight, bias)


def enable_live_cpu_weights() -> None:
    """Keep CPU linear weights as live parameters in engines created after this call.

    Sets the environment variable ``DELTASYNC_CPU_LIVE_WEIGHTS=1``, which spawned engine processes inherit
    (the default multiprocess mode), and hooks vLLM's CPU GEMM dispatch in this process (in-process mode).
    The worker extension installs the same hook when vLLM imports it, which happens before the model loads.
    """
    os.environ[LIVE_ENV] = "1"
    install_dispatch_hook()


def install_dispatch_hook() -> None:
    """Wrap ``dispatch_cpu_unquantized_gemm`` so it keeps weights live while ``DELTASYNC_CPU_LIVE_WEIGHTS=1``.

    The decision is taken when each layer is dispatched (at model load), so the hook is inert otherwise.
    vLLM's linear and embedding methods import the function at call time, so patching the module works.
    """
    from vllm.model_executor.layers import utils as layer_utils

    original = layer_utils.dispatch_cpu_unquantized_gemm
    if getattr(original, "_deltasync_hook", False):
        return

    @functools.wraps(original)
    def dispatch(layer: torch.nn.Module, remove_weight: bool) -> None:
        if os.environ.get(LIVE_ENV) == "1" and not layer.weight.is_meta and layer.weight.ndim == 2:
            layer.cpu_linear = live_linear
            return
        original(layer, remove_weight)

    dispatch._deltasync_hook = True  # type: ignore[attr-defined]
    layer_utils.dispatch_cpu_unquantized_gemm = dispatch


# --- patch payloads ---------------------------------------------------------------------------------


def encode_patch(patch: Patch) -> bytes:
    """Serialize {name: (positions or None, xor)} as safetensors bytes, for ``deltasync_apply``."""
    tensors: dict[str, torch.Tensor] = {}
    for name, (positions, xor) in patch.items():  # copies: safetensors refuses tensors sharing memory
        tensors[f"xor:{name}"] = xor.detach().reshape(-1).cpu().clone()
        if positions is not None:
            tensors[f"positions:{name}"] = positions.detach().reshape(-1).to(torch.int64).cpu().clone()
    return st_save(tensors, metadata={"format": "deltasync-xor-patch/1"})


def decode_patch(payload: bytes | str | os.PathLike[str]) -> dict[str, tuple[torch.Tensor | None, torch.Tensor]]:
    """Inverse of :func:`encode_patch`; ``payload`` is the bytes or a path to a file holding them, or the
    path of a deltasync delta object (decoded and validated by deltasync's own codecs)."""
    if not isinstance(payload, bytes) and _is_step_object(payload):
        from deltasync.errors import DeltaSyncError
        from deltasync.format.objects import StepObject

        try:
            with StepObject(payload, where=str(payload)) as obj:
                if obj.header.kind != "delta":
                    raise PatchError(f"{payload}: an anchor is loaded with deltasync_load, not applied as a patch")
                return {
                    name: (None if pos is None else torch.from_numpy(pos), torch.from_numpy(xor.view(f"i{xor.itemsize}")))
                    for name, pos, xor in obj.patches()
                }
        except DeltaSyncError as e:
            raise PatchError(str(e)) from None
    raw = payload if isinstance(payload, bytes) else Path(payload).read_bytes()
    try:
        tensors = st_load(raw)
    except Exception as e:  # safetensors raises its own error types
        raise PatchError(f"patch payload is not a safetensors blob: {e}") from None
    out: dict[str, tuple[torch.Tensor | None, torch.Tensor]] = {}
    for key, t in tensors.items():
        kind, sep, name = key.partition(":")
        if not sep or kind not in ("xor", "positions"):
            raise PatchError(f"patch payload: unexpected entry {key!r}")
        if kind == "xor":
            out[name] = (tensors.get(f"positions:{name}"), t)
        elif f"xor:{name}" not in tensors:
            raise PatchError(f"patch payload: positions for {name!r} without xor")
    return out


def _is_step_object(path: str | os.PathLike[str]) -> bool:
    try:
        with safe_open(str(path), framework="pt") as f:
            return "deltasync" in (f.metadata() or {})
    except Exception:  # not a safetensors file: the caller's decoder reports it
        return False


# --- driver side -----------------------------------------------------------------------------------

_ERRORS: dict[str, type[Exception]] = {"PatchError": PatchError, "RoutingError": RoutingError}


def rpc(llm: Any, method: str, *args: Any, timeout: float | None = None) -> list[Any]:
    """``llm.collective_rpc(method, args=args)`` for the deltasync methods: one result per rank.

    Worker methods reply ``{"ok": False, "error": type name, "message": ...}`` instead of raising (see
    :func:`_replies`); this raises the first failed rank's error with its own type (PatchError, RoutingError,
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


def apply_patch(llm: Any, payload: bytes | str, *, timeout: float | None = None) -> list[dict[str, Any]]:
    """Apply a patch on every rank, all or nothing across ranks, then drop the prefix cache.

    If any rank fails, every rank rolls back (those that failed have already restored themselves), so all
    hold the previous weights again; the error is raised. Without ``reset_prefix_cache`` prompts longer than
    one KV block would reuse KV computed with the old weights.
    """
    try:
        return rpc(llm, "deltasync_apply", payload, timeout=timeout)
    except Exception:
        rpc(llm, "deltasync_rollback", timeout=timeout)
        raise
    finally:
        llm.reset_prefix_cache()


def engine_checksums(llm: Any, names: list[str] | None = None) -> dict[str, int]:
    """Checksum of every checkpoint tensor as the engine holds it: the ranks' owned parts added up."""
    parts = rpc(llm, "deltasync_checksums", names)
    return {name: add(*(p[name] for p in parts)) for name in parts[0]}


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
            expected = isinstance(e, (PatchError, RoutingError))
            log.log(
                logging.WARNING if expected else logging.ERROR,
                "%s failed: %s",
                method.__name__,
                e,
                exc_info=not expected,
            )
            return {"ok": False, "error": type(e).__name__, "message": str(e)}

    return call


# --- the extension ----------------------------------------------------------------------------------


@dataclass
class _Target:
    """Where one checkpoint tensor's bits live on this rank: a parameter, or the host copy (reload mode)."""

    route: Route
    bits: torch.Tensor  # flat integer view of the parameter or of the host copy
    host: bool  # bits is the full checkpoint tensor (indexed by checkpoint flat index)
    modules: tuple[str, ...]  # modules to re-load (host) or whose kernel to rebuild after a write


@dataclass
class _State:
    table: RoutingTable
    mode: str
    targets: dict[str, _Target]
    host: dict[str, torch.Tensor] = field(default_factory=dict)  # checkpoint tensors of reloaded modules
    feeds: dict[str, tuple[str, ...]] = field(default_factory=dict)  # reloaded module -> checkpoint names
    undo: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = field(default_factory=list)
    undo_modules: set[str] = field(default_factory=set)
    # this rank's part of each tensor's checksum, kept current by every apply (incremental verification);
    # filled from the bits themselves on first use
    sums: dict[str, int] = field(default_factory=dict)
    undo_sums: dict[str, int] = field(default_factory=dict)


class DeltaWorkerExtension:
    """Methods mixed into every vLLM worker; call them through ``collective_rpc``."""

    _deltasync: _State | None = None

    @_replies
    def deltasync_init(
        self,
        hf_shapes_json: str | None = None,
        mode: Mode = "auto",
        weights_path: str | None = None,
        ignore: list[str] | None = None,
    ) -> dict[str, Any]:
        """Build the routing table (once) from the checkpoint's ``{name: shape}`` JSON.

        ``hf_shapes_json`` None reads names and shapes from the engine's own checkpoint. ``mode``: "live"
        needs live weights everywhere (GPU, or CPU with :func:`enable_live_cpu_weights`); "reload" also
        works on the stock CPU path, keeping host copies (read from ``weights_path``, default the model's
        checkpoint) of tensors that feed repacked layers; "auto" picks "live" when possible. Call it right
        after the engine loaded that checkpoint: host copies must hold what the engine holds. Returns a
        summary (mode, rank, how many tensors each path serves).
        """
        if mode not in ("auto", "live", "reload"):
            raise ValueError(f"mode must be 'auto', 'live' or 'reload', not {mode!r}")
        t0 = time.perf_counter()
        model = self.get_model()  # type: ignore[attr-defined]
        checkpoint = weights_path or self.vllm_config.model_config.model  # type: ignore[attr-defined]
        if hf_shapes_json in ("", "null"):  # HTTP /collective_rpc passes strings only
            hf_shapes_json = None
        shapes, dtypes = _parse_layout(hf_shapes_json) if hf_shapes_json is not None else _checkpoint_layout(checkpoint)
        table = build_table(model, shapes, ignore=ignore)

        owners = _param_owners(model)
        kinds = {m: _module_kind(model.get_submodule(m)) for ms in owners.values() for m, _ in ms}
        stale = sorted(m for m, k in kinds.items() if k != "live")
        if mode == "live" and stale:
            raise RoutingError(
                f"mode='live' needs CPU linear weights kept live, but {len(stale)} layers keep a repacked copy "
                f"(e.g. {stale[:3]}): call rollout_loader.worker.enable_live_cpu_weights() or set "
                f"{LIVE_ENV}=1 before creating the LLM, or use mode='reload'"
            )
        mode = "reload" if stale else "live"

        params = dict(model.named_parameters())
        routes_of = table.by_param()
        feeds = {  # re-loaded module -> every checkpoint tensor feeding it (all of q, k, v, and the bias)
            m: tuple(r.hf_name for p, _ in _own_params(model.get_submodule(m), m) for r in routes_of.get(p, []))
            for m, k in kinds.items()
            if k == "reload"
        }
        host_names = sorted({n for names in feeds.values() for n in names})
        host = _read_checkpoint(checkpoint, host_names, shapes) if host_names else {}

        targets: dict[str, _Target] = {}
        for hf_name, route in table.routes.items():
            mods = tuple(m for m, _ in owners[route.param_name])
            reloaded = tuple(m for m in mods if m in feeds)
            if reloaded:
                targets[hf_name] = _Target(route=route, bits=int_bits(host[hf_name]), host=True, modules=reloaded)
            else:
                param = params[route.param_name]
                if not param.data.is_contiguous():
                    raise RoutingError(f"engine parameter {route.param_name!r} is not contiguous")
                targets[hf_name] = _Target(
                    route=route,
                    bits=param.data.view(-1).view(_SIGNED[param.element_size()]),
                    host=False,
                    modules=tuple(m for m in mods if kinds[m] == "refresh"),
                )
        held = {n: host[n].dtype if t.host else params[t.route.param_name].dtype for n, t in targets.items()}
        wrong = [
            f"{n} (checkpoint {dtypes[n]}, engine {held[n]})" for n in targets if n in dtypes and dtypes[n] != held[n]
        ]
        if wrong:
            raise RoutingError(f"dtypes differ, XOR patches would corrupt these tensors: {wrong[:5]}")
        self._deltasync = _State(table=table, mode=mode, targets=targets, host=host, feeds=feeds)
        summary = {
            "mode": mode,
            "tp_rank": table.tp_rank,
            "tp_size": table.tp_size,
            "tensors": len(targets),
            "in_place": sum(not t.host for t in targets.values()),
            "host_copies": len(host),
            "host_bytes": sum(t.numel() * t.element_size() for t in host.values()),
            "kernel_rebuilds": len({m for t in targets.values() if not t.host for m in t.modules}),
            "reloaded_modules": len(feeds),
            "tied": dict(table.tied),
            "seconds": round(time.perf_counter() - t0, 4),
        }
        log.info("deltasync routing table built: %s", summary)
        return summary

    @_replies
    def deltasync_apply(self, payload: bytes | str) -> dict[str, Any]:
        """Apply a patch (``encode_patch`` bytes, or a path to them) in place; all or nothing on this rank.

        Everything is validated before the first write; if a write or a reload still fails, the old bits are
        put back. The old bits of a successful apply stay recorded until the next apply, for
        :meth:`deltasync_rollback`; after a failed one there is nothing to roll back, so that rolling back every
        rank after a failure on some of them (what :func:`apply_patch` does) leaves all at the previous step.
        """
        state = self._state()
        t0 = time.perf_counter()
        # a failed apply leaves nothing to roll back on this rank
        state.undo, state.undo_modules, state.undo_sums = [], set(), {}
        patch = decode_patch(payload)
        _validate(state, patch)
        plan = [(name, state.targets[name], *_localize(state.targets[name], pos, xor)) for name, (pos, xor) in patch.items()]
        sums = {name: self._sum(state, name) for name, *_ in plan}
        undo: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []
        modules: set[str] = set()
        try:
            with torch.inference_mode():
                for name, target, idx, x, hf_idx in plan:
                    old, delta = _xor_into(target.bits, idx, x, hf_idx)
                    undo.append((target.bits, idx, old))
                    modules.update(target.modules)
                    if target.route.owner:  # the checksum follows the bits read back after the write
                        sums[name] = (sums[name] + delta) & MASK64
            self._sync_kernels(state, modules)
        except BaseException:
            try:
                self._restore(state, undo, modules)
            except Exception:
                log.exception("deltasync: restoring the old weights after a failed apply failed too")
            raise
        state.undo, state.undo_modules = undo, modules
        state.undo_sums = {name: state.sums[name] for name in sums}
        state.sums.update(sums)
        elements = sum(int(idx.numel()) for _, _, idx, _, _ in plan)
        return {
            "checksums": sums,  # this rank's parts after the apply, for verification by the driver
            "tensors": len(plan),
            "elements": elements,
            "modules_synced": len(modules),
            "seconds": round(time.perf_counter() - t0, 4),
        }

    @_replies
    def deltasync_load(self, path: str, mode: Mode = "auto") -> dict[str, Any]:
        """Load a full checkpoint (a deltasync anchor) through vLLM's own ``reload_weights``, then rebuild the
        routing table and host copies from it, so that the following deltas apply to exactly these bits."""
        t0 = time.perf_counter()
        with safe_open(path, framework="pt") as f, torch.inference_mode():
            self.reload_weights(  # type: ignore[attr-defined]
                weights_iterator=((name, f.get_tensor(name)) for name in f.keys()), is_checkpoint_format=True
            )
        reload_s = time.perf_counter() - t0
        self.__dict__.pop("_deltasync", None)  # parameters may have been replaced: routes are rebuilt
        summary = type(self).deltasync_init.__wrapped__(self, None, mode, path)  # type: ignore[attr-defined]
        return {**summary, "reload_s": round(reload_s, 4), "seconds": round(time.perf_counter() - t0, 4)}

    @_replies
    def deltasync_rollback(self) -> bool:
        """Put back the bits the last apply changed; False when there is nothing to undo."""
        state = self._state()
        if not state.undo:
            return False
        self._restore(state, state.undo, state.undo_modules)
        state.sums.update(state.undo_sums)
        state.undo, state.undo_modules, state.undo_sums = [], set(), {}
        return True

    @_replies
    def deltasync_checksums(self, names: list[str] | str | None = None) -> dict[str, int]:
        """``mix64-sum`` checksum of each checkpoint tensor over the elements this rank owns.

        ``names`` may be a JSON list (HTTP ``/collective_rpc`` passes strings only); None or "" for all.

        Computed from exactly the engine elements routed from that name (q's rows of ``qkv_proj``, with q's
        own flat indices), or from the host copy for layers served by reload. Each element is owned by one
        rank, so summing the ranks' values mod 2**64 gives the checkpoint tensor's checksum.
        """
        state = self._state()
        if isinstance(names, str):
            names = json.loads(names) if names else None
        out: dict[str, int] = {}
        for name in names if names is not None else list(state.targets):
            target = state.targets.get(name)
            if target is None:
                raise PatchError(f"{name!r} is not a checkpoint tensor of this model")
            route = target.route
            if not route.owner:
                out[name] = 0
                continue
            total = 0
            for box in _chunks(route):
                hf_idx = box.hf_indices()
                bits = target.bits[hf_idx] if target.host else target.bits[box.param_indices()]
                total += checksum_elements(bits, hf_idx)
            out[name] = total & MASK64
        state.sums.update(out)  # exact for the bits as they are now: the base of incremental verification
        return out

    # --- internals ---

    def _sum(self, state: _State, name: str) -> int:
        """This rank's running checksum part for ``name`` (computed from the bits the first time)."""
        if name not in state.sums:
            state.sums[name] = type(self).deltasync_checksums.__wrapped__(self, [name])[name]  # type: ignore[attr-defined]
        return state.sums[name]

    def _state(self) -> _State:
        if self._deltasync is None:
            raise RuntimeError("call collective_rpc('deltasync_init', ...) first")
        return self._deltasync

    def _restore(
        self, state: _State, undo: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]], modules: set[str]
    ) -> None:
        with torch.inference_mode():
            for bits, idx, old in reversed(undo):
                bits[idx] = old
        self._sync_kernels(state, modules)

    def _sync_kernels(self, state: _State, modules: set[str]) -> None:
        """Make the kernels of ``modules`` see the new bits: reload from host copies, or rebuild."""
        if not modules:
            return
        model = self.get_model()  # type: ignore[attr-defined]
        reload = sorted(m for m in modules if m in state.feeds)
        if reload:
            names = sorted({n for m in reload for n in state.feeds[m]})
            weights = [(n, state.host[n]) for n in names]
            with _quiet(_RELOAD_LOGGERS):
                self.reload_weights(weights_iterator=iter(weights), is_checkpoint_format=True)  # type: ignore[attr-defined]
        with torch.inference_mode():
            for m in sorted(modules - set(reload)):
                module = model.get_submodule(m)
                module.quant_method.process_weights_after_loading(module)


def _validate(state: _State, patch: Patch) -> None:
    """Check a whole patch before any write, so that a bad one changes nothing."""
    problems: list[str] = []
    for name, (pos, xor) in patch.items():
        target = state.targets.get(name)
        if target is None:
            problems.append(f"{name!r}: not a checkpoint tensor of this model")
            continue
        n = target.route.hf_numel
        width = target.bits.element_size()
        if xor.is_floating_point() or xor.is_complex() or xor.dtype == torch.bool or xor.element_size() != width:
            problems.append(
                f"{name!r}: xor is {xor.dtype}, the engine holds {width}-byte elements (use int{8 * width})"
            )
            continue
        if pos is None:
            if xor.numel() != n:
                problems.append(f"{name!r}: a dense xor needs {n} elements, got {xor.numel()}")
            continue
        if pos.dtype != torch.int64 or pos.numel() != xor.numel():
            problems.append(
                f"{name!r}: positions must be int64 and as many as xor ({pos.dtype}, {pos.numel()} vs {xor.numel()})"
            )
            continue
        if pos.numel() and (int(pos[0]) < 0 or int(pos[-1]) >= n):
            problems.append(
                f"{name!r}: positions run from {int(pos[0])} to {int(pos[-1])}, the tensor has {n} elements"
            )
            continue
        if pos.numel() > 1 and not bool((pos[1:] > pos[:-1]).all()):
            problems.append(f"{name!r}: positions are not strictly ascending")
    if problems:
        raise PatchError(f"patch rejected, weights untouched ({len(problems)} problem(s)):\n  " + "\n  ".join(problems))


def _xor_into(bits: torch.Tensor, idx: torch.Tensor, x: torch.Tensor, hf_idx: torch.Tensor) -> tuple[torch.Tensor, int]:
    """``bits[idx] ^= x``: (the old bits, the checksum change over those elements at checkpoint ``hf_idx``)."""
    if bits.device.type == "cpu" and bits.is_contiguous():
        from deltasync.format._bits import UNSIGNED_NP
        from deltasync.format._kernels import xor_at_indexed

        unsigned = UNSIGNED_NP[bits.element_size()]
        old = torch.empty_like(x)
        delta = xor_at_indexed(
            bits.numpy().view(unsigned),
            idx.contiguous().numpy(),
            x.contiguous().numpy().view(unsigned),
            hf_idx.to(torch.int64).contiguous().numpy(),
            old.numpy().view(unsigned),
        )
        return old, int(delta)
    old = bits[idx]
    bits[idx] = old ^ x
    new = bits[idx]  # read back what landed
    return old, (checksum_elements(new, hf_idx) - checksum_elements(old, hf_idx)) & MASK64


def _localize(
    target: _Target, pos: torch.Tensor | None, xor: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(flat indices into the target's bits, xor values there, their checkpoint flat indices) for this rank."""
    xor = xor.reshape(-1).view(_SIGNED[xor.element_size()])
    if target.host:  # the host copy is the whole checkpoint tensor
        idx = pos if pos is not None else torch.arange(xor.numel(), dtype=torch.int64)
        return idx, xor, idx
    route = target.route
    if pos is None:
        if route.whole and route.hf_shape == route.param_shape:
            idx = torch.arange(xor.numel(), dtype=torch.int64)
            return idx, xor, idx
        parts = [(box.param_indices(), box.hf_indices()) for box in _chunks(route)]
        hf = torch.cat([h for _, h in parts])
        return torch.cat([p for p, _ in parts]), xor[hf], hf
    keep, idx = route.localize(pos)
    if keep is None:
        return idx, xor, pos.reshape(-1)
    return idx, xor[keep], pos.reshape(-1)[keep]


def build_table(
    model: torch.nn.Module, hf_shapes: Mapping[str, list[int]], *, ignore: list[str] | None = None
) -> RoutingTable:
    """The routing table of a loaded vLLM model for checkpoint tensors ``hf_shapes``."""
    from vllm.distributed import (
        get_tensor_model_parallel_rank,
        get_tensor_model_parallel_world_size,
    )

    rank, size = get_tensor_model_parallel_rank(), get_tensor_model_parallel_world_size()
    specs = [_param_spec(model, name, param, size) for name, param in model.named_parameters()]
    tied = _tied_aliases(model)
    return build_routing_table(
        hf_shapes,
        specs,
        resolve=_resolver(model),
        tp_rank=rank,
        tp_size=size,
        tied=tied,
        ignore=ignore or (),
    )


def _resolver(model: torch.nn.Module) -> Callable[[str], tuple[str, int | None] | None]:
    """Checkpoint name -> (parameter, shard position), from the model's packed_modules_mapping and mapper.

    The model's ``hf_to_vllm_mapper`` renames (prefixes, substrings) are applied first, without its stacked
    entries (``.q_proj`` -> ``.qkv_proj``, "q"): the packed mapping gives the shard position directly.
    Stacked entries of fused modules the packed mapping does not name are used as a fallback.
    """
    packed = {k: list(v) for k, v in (getattr(model, "packed_modules_mapping", None) or {}).items()}
    mapper = getattr(model, "hf_to_vllm_mapper", None)
    rename = None
    if mapper is not None:
        extra: dict[str, dict[int, str]] = {}
        for old, (new, shard_id) in mapper.orig_to_new_stacked.items():
            pos = {"q": 0, "k": 1, "v": 2}.get(shard_id, shard_id)
            if new.strip(".") not in packed and isinstance(pos, int):
                extra.setdefault(new.strip("."), {})[pos] = old.strip(".")
        packed.update({fused: [parts[i] for i in sorted(parts)] for fused, parts in extra.items()})
        rename = replace(mapper, orig_to_new_stacked={}).map_name
    return packed_resolver(packed, rename)


def _param_spec(model: torch.nn.Module, name: str, param: torch.nn.Parameter, tp_size: int) -> ParamSpec:
    """How this rank holds parameter ``name``: from the owning layer's own sharding attributes."""
    from vllm.model_executor.layers.linear import (
        ColumnParallelLinear,
        LinearBase,
        MergedColumnParallelLinear,
        QKVParallelLinear,
        RowParallelLinear,
    )
    from vllm.model_executor.layers.vocab_parallel_embedding import (
        VocabParallelEmbedding,
    )

    mod_name, _, leaf = name.rpartition(".")
    module = model.get_submodule(mod_name)
    shape = tuple(param.shape)
    split = getattr(module, "tp_size", 1) > 1
    if isinstance(module, LinearBase) and leaf == "weight":
        shape = (sum(module.output_partition_sizes), module.input_size_per_partition)  # also when repacked away
    if split and getattr(module, "tp_size", tp_size) != tp_size:
        raise RoutingError(f"{name!r}: layer split {module.tp_size} ways, tensor parallelism is {tp_size}")
    if isinstance(module, QKVParallelLinear) and leaf in ("weight", "bias"):
        kv = dict(replicas=module.num_kv_head_replicas)
        shards = (
            Shard(size=module.total_num_heads * module.head_size),
            Shard(size=module.total_num_kv_heads * module.head_size, **kv),
            Shard(size=module.total_num_kv_heads * module.v_head_size, **kv),
        )
        return ParamSpec(name=name, shape=shape, split_dim=0 if split else None, shards=shards)
    if isinstance(module, MergedColumnParallelLinear) and leaf in ("weight", "bias"):
        shards = tuple(Shard(size=s) for s in module.output_sizes)
        return ParamSpec(name=name, shape=shape, split_dim=0 if split else None, shards=shards)
    if isinstance(module, ColumnParallelLinear) and leaf in ("weight", "bias"):
        return ParamSpec(name=name, shape=shape, split_dim=0 if split else None)
    if isinstance(module, RowParallelLinear) and leaf == "weight":
        return ParamSpec(name=name, shape=shape, split_dim=1 if split else None)
    if isinstance(module, VocabParallelEmbedding) and leaf == "weight":
        if module.num_added_embeddings:
            raise RoutingError(f"{name!r}: embeddings with added (LoRA) vocabulary are not supported")
        shard = Shard(size=module.org_vocab_size, padded_size=module.num_embeddings_padded)
        return ParamSpec(name=name, shape=shape, split_dim=0 if split else None, shards=(shard,))
    return ParamSpec(name=name, shape=shape)  # norms, replicated layers, row-parallel biases


def _tied_aliases(model: torch.nn.Module) -> dict[str, str]:
    """{alias parameter name: the name ``named_parameters()`` reports} for parameters shared by modules."""
    first: dict[int, str] = {}
    aliases: dict[str, str] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        if id(param) in first and first[id(param)] != name:
            aliases[name] = first[id(param)]
        first.setdefault(id(param), name)
    return aliases


def _param_owners(model: torch.nn.Module) -> dict[str, list[tuple[str, str]]]:
    """{parameter name: [(module name, attribute)] of every module holding it} (tied ones have several)."""
    canonical = {id(p): n for n, p in model.named_parameters()}
    owners: dict[str, list[tuple[str, str]]] = {}
    for mod_name, module in model.named_modules(remove_duplicate=False):
        for attr, p in module._parameters.items():
            if p is not None and id(p) in canonical:
                entry = (mod_name, attr)
                if entry not in owners.setdefault(canonical[id(p)], []):
                    owners[canonical[id(p)]].append(entry)
    return owners


def _own_params(module: torch.nn.Module, mod_name: str) -> list[tuple[str, torch.nn.Parameter]]:
    return [(f"{mod_name}.{n}" if mod_name else n, p) for n, p in module.named_parameters(recurse=False)]


def _module_kind(module: torch.nn.Module) -> str:
    """How writes to this module's parameters reach its kernel.

    "live": the kernel reads the parameter (GPU, non-linear layers, live mode); "refresh": the CPU backend
    keeps its own copy next to a still-present weight (rebuild it after a write); "reload": the weight was
    repacked away (re-load it through vLLM from the host copy).
    """
    kernel = getattr(module, "cpu_linear", None)
    if kernel is None or kernel is live_linear or kernel is F.linear:
        return "live"
    weight = getattr(module, "weight", None)
    if isinstance(weight, torch.Tensor) and weight.numel() == 0:
        return "reload"
    return "refresh"


def _chunks(route: Route, max_elements: int = _CHUNK) -> Iterator[Route]:
    """Split a route's box along dim 0 so index tensors stay bounded."""
    if not route.extent or route.numel <= max_elements:
        yield route
        return
    row = math.prod(route.extent[1:])
    step = max(1, max_elements // max(row, 1))
    for off in range(0, route.extent[0], step):
        n = min(step, route.extent[0] - off)
        yield replace(
            route,
            hf_start=(route.hf_start[0] + off, *route.hf_start[1:]),
            param_start=(route.param_start[0] + off, *route.param_start[1:]),
            extent=(n, *route.extent[1:]),
        )


def _safetensors_files(path: str) -> list[Path]:
    p = Path(path)
    files = sorted(p.glob("*.safetensors")) if p.is_dir() else [p]
    if not files or not all(f.is_file() for f in files):
        raise FileNotFoundError(f"no safetensors checkpoint at {path!r} (reload mode reads its host copies there)")
    return files


def _checkpoint_layout(path: str) -> tuple[dict[str, list[int]], dict[str, torch.dtype]]:
    shapes: dict[str, list[int]] = {}
    dtypes: dict[str, torch.dtype] = {}
    for f in _safetensors_files(path):
        with safe_open(str(f), framework="pt") as st:
            for k in st.keys():  # noqa: SIM118 (safe_open is not a dict)
                sl = st.get_slice(k)
                shapes[k] = list(sl.get_shape())
                dtypes[k] = _DTYPES[sl.get_dtype()]
    return shapes, dtypes


def _parse_layout(text: str) -> tuple[dict[str, list[int]], dict[str, torch.dtype]]:
    """``{name: shape}`` or ``{name: {"shape": shape, "dtype": "BF16"}}`` (safetensors dtype names)."""
    shapes: dict[str, list[int]] = {}
    dtypes: dict[str, torch.dtype] = {}
    for name, v in json.loads(text).items():
        if isinstance(v, dict):
            shapes[name] = list(v["shape"])
            if "dtype" in v:
                if v["dtype"] not in _DTYPES:
                    raise RoutingError(f"{name!r}: unknown dtype {v['dtype']!r} (known: {sorted(_DTYPES)})")
                dtypes[name] = _DTYPES[v["dtype"]]
        else:
            shapes[name] = list(v)
    return shapes, dtypes


def _read_checkpoint(path: str, names: list[str], shapes: Mapping[str, list[int]]) -> dict[str, torch.Tensor]:
    """Host copies of checkpoint tensors ``names`` (reload mode: the old values of repacked layers)."""
    out: dict[str, torch.Tensor] = {}
    for f in _safetensors_files(path):
        with safe_open(str(f), framework="pt") as st:
            for k in set(names) & set(st.keys()):
                out[k] = st.get_tensor(k).contiguous()
    missing = [n for n in names if n not in out]
    if missing:
        raise RoutingError(
            f"reload mode needs host copies of {missing[:5]} (and {max(0, len(missing) - 5)} more), not in {path!r}"
        )
    for n in names:
        if list(out[n].shape) != list(shapes[n]):
            raise RoutingError(f"{n!r}: checkpoint at {path!r} has shape {list(out[n].shape)}, expected {shapes[n]}")
    return out


@contextmanager
def _quiet(names: tuple[str, ...]) -> Iterator[None]:
    loggers = [logging.getLogger(n) for n in names]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.ERROR)
    try:
        yield
    finally:
        for lg, lvl in zip(loggers, levels, strict=True):
            lg.setLevel(lvl)


install_dispatch_hook()
