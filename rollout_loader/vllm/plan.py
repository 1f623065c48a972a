"""Planning a worker's deltasync state: routes from vLLM's loader, and for each checkpoint tensor where it is written.

The plan is made once per engine (:func:`build_state`): the routing table (:mod:`.trace`), which parameters vLLM
holds in checkpoint layout (written in place) and which it transformed after loading (their modules shadowed by
host copies, :mod:`.shadow`), and the resulting :class:`~rollout_loader.vllm.layout.TensorHome` of every checkpoint
tensor. Everything after it (staging, writing, checksums, rollback) is :mod:`.state`.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

import torch

from rollout_loader.routing import RoutingError, RoutingTable

from .layout import SIGNED, Dtypes, Shapes, TensorHome, int_bits, param_owners, read_checkpoint
from .live_cpu import LIVE_ENV, module_kind
from .settings import Mode
from .shadow import derived_params, feeds_of, find_transformed
from .state import Reload, WorkerState
from .trace import all_gather_tp, reloaded_attrs, routing_table, trace_loader

log = logging.getLogger(__name__)


def build_state(
    model: torch.nn.Module, *, layout: tuple[Shapes, Dtypes], checkpoint: str, mode: Mode, reload: Reload,
    ignore: list[str] | None = None,
) -> tuple[WorkerState, dict[str, Any]]:
    """Routes and homes for checkpoint tensors ``layout`` in ``model`` on this rank, and a summary.

    Routes come from vLLM's own loader (:mod:`.trace`). A parameter vLLM holds in checkpoint layout is written
    in place; the modules of parameters it transformed after loading (:mod:`.shadow`: repacked CPU linears,
    prepacked MoE experts, quantized weights) or that the loader computes with no exact element map (untraced)
    keep host copies of the checkpoint tensors vLLM's reload of them loads (read from ``checkpoint``), patched and
    re-loaded through vLLM. A tensor the loader converts to another dtype on its way (Qwen3-Next's fp32
    ``A_log``) keeps a host copy in the checkpoint's dtype, converted into the parameter after each write as the
    loader does. A tensor the model ties to another (a tied head the checkpoint also stores) is discarded: checked
    against that tensor's checksum, never written. ``mode``: "live" refuses CPU linears that keep a repacked copy
    (their weights must be live, :mod:`.live_cpu`); "reload" and "auto" shadow them. Call it right after the
    engine loaded ``checkpoint``: host copies must hold what the engine holds.
    """
    if mode not in ("auto", "live", "reload"):
        raise RoutingError(f"mode must be 'auto', 'live' or 'reload', not {mode!r}")
    t0 = time.perf_counter()
    shapes, dtypes = layout
    trace = trace_loader(model, shapes, dtypes)
    table = routing_table(model, trace, shapes, ignore=ignore or ())
    owners = param_owners(model)
    kinds = {m: module_kind(model.get_submodule(m)) for ms in owners.values() for m, _ in ms}
    stale = sorted(m for m, k in kinds.items() if k != "live")
    if mode == "live" and stale:
        raise RoutingError(
            f"mode='live' needs CPU linear weights kept live, but {len(stale)} layers keep a repacked copy "
            f"(e.g. {stale[:3]}): call rollout_loader.vllm.enable_live_cpu_weights() or set {LIVE_ENV}=1 "
            f"before creating the engine, or use mode='reload'"
        )
    transformed = find_transformed(model, trace, table, checkpoint)
    attrs = reloaded_attrs(model)
    need = needing(owners, attrs)
    redo = {m for p in [*transformed, *table.untraced] for m in need(p)}
    shadowed = {m for m, k in kinds.items() if k == "reload"} | redo
    not_reloadable = sorted(m for m in redo if m not in attrs)
    if not_reloadable:
        raise RoutingError(f"modules {not_reloadable[:3]} hold parameters vLLM transforms after loading or the loader "
                           "computes with no exact element map, and vLLM keeps no checkpoint-format record of them to "
                           "re-load them from: deltasync cannot follow this model")
    # parameters vLLM creates after loading (fp8 scales, MLA's absorbed weights) stay right when they share storage
    # with a routed parameter, or when their module is re-processed after every write (shadowed)
    stale_derived = sorted(n for n, base in derived_params(model, trace).items()
                           if base is None and n.rpartition(".")[0] not in shadowed)
    if stale_derived:
        raise RoutingError(f"engine parameters {stale_derived[:5]} are derived by vLLM after loading and share no "
                           "storage with a checkpoint-format parameter: a write would leave them stale")
    # module -> every checkpoint tensor its reload loads (all of q, k, v, bias), through any name it holds them by
    feeds = dict(feeds_of(table, shadowed, need))
    by_name: dict[str, set[str]] = {}
    for m, names in feeds.items():
        for n in names:
            by_name.setdefault(n, set()).add(m)
    reloading = {n: tuple(sorted(by_name.get(n, ()))) for n in table.routes}
    # a tensor kept on the host (re-loaded, or converted on its way) is written into every parameter no reload
    # writes, as the loader wrote it (its dtype conversions): the mirror
    mirrors = {n: tuple(r for r in pieces if not need(r.param_name) & set(reloading[n]))
               for n, pieces in table.routes.items() if reloading[n] or any(r.casts for r in pieces)}
    host_names = sorted(n for n in table.routes if reloading[n] or n in mirrors)
    host = read_checkpoint(checkpoint, host_names, shapes) if host_names else {}
    whole = _owned_whole(table)
    params = dict(model.named_parameters())
    homes: dict[str, TensorHome] = {}
    for hf_name, pieces in table.routes.items():
        if hf_name in host:
            homes[hf_name] = TensorHome(routes=pieces, bits=int_bits(host[hf_name]), host=True,
                                        modules=reloading[hf_name], hf_shape=tuple(shapes[hf_name]),
                                        mirror=mirrors.get(hf_name, ()), owned_whole=hf_name in whole)
            continue
        if not pieces:  # another rank holds it
            width = dtypes.get(hf_name, torch.bfloat16).itemsize
            homes[hf_name] = TensorHome(routes=(), bits=torch.empty(0, dtype=SIGNED[width]), host=False, modules=(),
                                        hf_shape=tuple(shapes[hf_name]))
            continue
        pname = pieces[0].param_name
        param = params[pname]
        if param.dtype != dtypes.get(hf_name, param.dtype) or len({r.param_name for r in pieces}) > 1:
            raise RoutingError(f"{hf_name!r}: the checkpoint holds {dtypes[hf_name]} feeding "
                               f"{sorted({r.param_name for r in pieces})[:3]} ({param.dtype}) with no conversion "
                               "or re-load traced: no way to write it exactly")
        mods = tuple(m for m, _ in owners.get(pname, [])) or (pname.rpartition(".")[0],)
        refresh = tuple(m for m in mods if kinds.get(m) == "refresh")
        homes[hf_name] = TensorHome(routes=pieces, bits=int_bits(param.data), host=False, modules=refresh)
    state = WorkerState(model=model, reload=reload, table=table, mode="reload" if feeds else "live",
                        homes=homes, host=host, feeds=feeds, aliases=dict(table.discarded))
    summary = {
        "mode": state.mode, "tp_rank": table.tp_rank, "tp_size": table.tp_size, "tensors": len(homes),
        "in_place": sum(not t.host for t in homes.values()), "host_copies": len(host),
        "host_bytes": sum(t.numel() * t.element_size() for t in host.values()),
        "kernel_rebuilds": len({m for t in homes.values() if not t.host for m in t.modules}),
        "reloaded_modules": len(feeds), "transformed": len(transformed), "untraced": sorted(table.untraced)[:8],
        "mirrored": sum(bool(t.mirror) for t in homes.values()), "discarded": dict(table.discarded),
        "tied": dict(table.tied),
        "trace_seconds": round(trace.seconds, 4), "seconds": round(time.perf_counter() - t0, 4),
    }
    log.info("deltasync routing table built: %s", summary)
    return state, summary


def needing(owners: dict[str, list[tuple[str, str]]], attrs: dict[str, frozenset[str]]) -> Callable[[str], set[str]]:
    """For a parameter, the modules whose reload loads it (under whatever name each holds it: vLLM shares one
    parameter between layers, as DeepSeek-V3's router and its experts share ``e_score_correction_bias``)."""
    def modules(param: str) -> set[str]:
        module, _, attr = param.rpartition(".")
        held = owners.get(param) or [(module, attr)]
        return {m for m, a in held if a in attrs.get(m, ())} or {module}
    return modules


def _owned_whole(table: RoutingTable) -> set[str]:
    """Checkpoint tensors that only feed untraced parameters on every rank: rank 0 counts them whole (every rank
    holds a whole host copy of them)."""
    pieces = {n for n, p in table.routes.items() if p}
    everyone = all_gather_tp(sorted(pieces))
    anywhere = set().union(*map(set, everyone))
    fed = {n for names in table.untraced.values() for n in names}
    return fed - anywhere if table.tp_rank == 0 else set()
