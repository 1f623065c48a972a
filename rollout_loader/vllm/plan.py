"""Planning a worker's deltasync state: routes from vLLM's loader, and for each checkpoint tensor where it is written.

The plan is made once per engine (:func:`build_state`): the routing table (:mod:`.trace`), which parameters vLLM
holds in checkpoint layout (written in place) and which it transformed after loading (their modules shadowed by
host copies, :mod:`.shadow`), and the resulting :class:`~rollout_loader.vllm.layout.TensorHome` of every checkpoint
tensor. Everything after it (staging, writing, checksums, rollback) is :mod:`.state`.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import torch

from rollout_loader.routing import RoutingError

from .layout import SIGNED, Dtypes, Shapes, TensorHome, int_bits, param_owners, read_checkpoint
from .live_cpu import LIVE_ENV, module_kind
from .settings import Mode
from .shadow import derived_params, feeds_of, find_transformed, modules_of
from .state import Reload, WorkerState
from .trace import routing_table, trace_loader

log = logging.getLogger(__name__)


def build_state(
    model: torch.nn.Module, *, layout: tuple[Shapes, Dtypes], checkpoint: str, mode: Mode, reload: Reload,
    ignore: list[str] | None = None,
) -> tuple[WorkerState, dict[str, Any]]:
    """Routes and homes for checkpoint tensors ``layout`` in ``model`` on this rank, and a summary.

    Routes come from vLLM's own loader (:mod:`.trace`). A parameter vLLM holds in checkpoint layout is written
    in place; the modules of parameters it transformed after loading (:mod:`.shadow`: repacked CPU linears,
    prepacked MoE experts, quantized weights) keep host copies of their checkpoint tensors (read from
    ``checkpoint``), patched and re-loaded through vLLM. ``mode``: "live" refuses CPU linears that keep a
    repacked copy (their weights must be live, :mod:`.live_cpu`); "reload" and "auto" shadow them. Call it right
    after the engine loaded ``checkpoint``: host copies must hold what the engine holds.
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
    shadowed = {m for m, k in kinds.items() if k == "reload"} | modules_of(transformed)
    # parameters vLLM creates after loading (fp8 scales, MLA's absorbed weights) stay right when they share storage
    # with a routed parameter, or when their module is re-processed after every write (shadowed)
    stale_derived = sorted(n for n, base in derived_params(model, trace).items()
                           if base is None and n.rpartition(".")[0] not in shadowed)
    if stale_derived:
        raise RoutingError(f"engine parameters {stale_derived[:5]} are derived by vLLM after loading and share no "
                           "storage with a checkpoint-format parameter: a write would leave them stale")
    feeds = dict(feeds_of(table, shadowed))  # module -> every checkpoint tensor feeding it (all of q, k, v, bias)
    host_names = sorted({n for names in feeds.values() for n in names})
    host = read_checkpoint(checkpoint, host_names, shapes) if host_names else {}
    params = dict(model.named_parameters())
    homes: dict[str, TensorHome] = {}
    held: dict[str, torch.dtype] = {}
    for hf_name, pieces in table.routes.items():
        if not pieces:  # another rank holds it
            width = dtypes.get(hf_name, torch.bfloat16).itemsize
            homes[hf_name] = TensorHome(routes=(), bits=torch.empty(0, dtype=SIGNED[width]), host=False, modules=(),
                                      hf_shape=tuple(shapes[hf_name]))
            continue
        pname = pieces[0].param_name
        mods = tuple(m for m, _ in owners.get(pname, [])) or (pname.rpartition(".")[0],)
        reloaded = tuple(m for m in mods if m in feeds)
        if reloaded:
            homes[hf_name] = TensorHome(routes=pieces, bits=int_bits(host[hf_name]), host=True, modules=reloaded)
            held[hf_name] = host[hf_name].dtype
            continue
        param = params[pname]
        refresh = tuple(m for m in mods if kinds.get(m) == "refresh")
        homes[hf_name] = TensorHome(routes=pieces, bits=int_bits(param.data), host=False, modules=refresh)
        held[hf_name] = param.dtype
    wrong = [f"{n} (checkpoint {dtypes[n]}, engine {held[n]})" for n in held if n in dtypes and dtypes[n] != held[n]]
    if wrong:
        raise RoutingError(f"dtypes differ, XOR patches would corrupt these tensors: {wrong[:5]}")
    state = WorkerState(model=model, reload=reload, table=table, mode="reload" if feeds else "live",
                        homes=homes, host=host, feeds=feeds)
    summary = {
        "mode": state.mode, "tp_rank": table.tp_rank, "tp_size": table.tp_size, "tensors": len(homes),
        "in_place": sum(not t.host for t in homes.values()), "host_copies": len(host),
        "host_bytes": sum(t.numel() * t.element_size() for t in host.values()),
        "kernel_rebuilds": len({m for t in homes.values() if not t.host for m in t.modules}),
        "reloaded_modules": len(feeds), "transformed": len(transformed), "tied": dict(table.tied),
        "trace_seconds": round(trace.seconds, 4), "seconds": round(time.perf_counter() - t0, 4),
    }
    log.info("deltasync routing table built: %s", summary)
    return state, summary
