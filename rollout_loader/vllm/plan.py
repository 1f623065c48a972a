"""Planning a worker's deltasync state: routes from vLLM's loader, and for each checkpoint tensor where it is written.

The plan is made once per engine (:func:`build_state`): the routing table (:mod:`.trace`), which parameters vLLM
holds in checkpoint layout (written in place) and which it transformed after loading (their modules shadowed by
host copies, :mod:`.shadow`), and the resulting :class:`~rollout_loader.vllm.layout.TensorHome` of every checkpoint
tensor. Everything after it (staging, writing, checksums, rollback) is :mod:`.state`.
"""

from __future__ import annotations

import logging
import math
import random
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import torch

from deltasync.errors import ConfigError
from rollout_loader.routing import Route, RoutingError, RoutingTable, assign_owners, chunks

from .fp8 import FP8, SCALE, Fp8Group, Fp8Plan, Fp8Quantizer, plan_of, scale_attr, scale_name
from .layout import SIGNED, Dtypes, Shapes, TensorHome, int_bits, param_owners, read_checkpoint
from .live_cpu import LIVE_ENV, module_kind
from .settings import Mode, Representation
from .shadow import derived_params, feeds_of, find_transformed
from .state import Reload, WorkerState
from .trace import all_gather_tp, reloaded_attrs, routing_table, trace_loader

log = logging.getLogger(__name__)


def build_state(
    model: torch.nn.Module, *, layout: tuple[Shapes, Dtypes], checkpoint: str, mode: Mode, reload: Reload,
    ignore: list[str] | None = None, representation: Representation = "checkpoint", max_host_bytes: int | None = None,
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

    ``representation="fp8"``: the stream carries the engine's FP8 representation (docs/FORMAT.md section 7) and
    the layers vLLM quantizes online to FP8 (:func:`~rollout_loader.vllm.fp8.plan_of`) are written in place, FP8
    bytes and scales, with no host copy. ``max_host_bytes``: the host copies' budget; above it init is refused
    (``ConfigError``) before anything is read.
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
    plan = plan_of(model, table, dtypes, shapes) if representation == "fp8" else None
    if plan is not None and not plan.groups:
        raise RoutingError("representation='fp8' needs an engine that quantizes layers to FP8 with vLLM's online FP8 "
                           "quantization (--quantization fp8, fp8_per_tensor, fp8_per_channel or fp8_per_block on a "
                           "bf16 checkpoint); this one quantizes none: follow it with the checkpoint's tensors "
                           "(representation='checkpoint')")
    fp8_params = {f"{g.module}.{a}" for g in plan.groups for a in ("weight", scale_attr(g.scheme))} if plan else set()
    transformed = {p: why for p, why in find_transformed(model, trace, table, checkpoint).items()
                   if p not in fp8_params}
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
                           if base is None and n.rpartition(".")[0] not in shadowed and n not in fp8_params)
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
    host_bytes = sum(math.prod(shapes[n]) * dtypes.get(n, torch.bfloat16).itemsize for n in host_names)
    _check_host_bytes(host_bytes, max_host_bytes, host_names, feeds, transformed,
                      fp8=_quantizes_fp8(model) and plan is None)
    host = read_checkpoint(checkpoint, host_names, shapes) if host_names else {}
    whole = _owned_whole(table)
    params = dict(model.named_parameters())
    homes: dict[str, TensorHome] = {}
    for hf_name, pieces in table.routes.items():
        if plan is not None and plan.group_of(hf_name) is not None:
            continue  # an FP8 weight: below
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
    aliases = dict(table.discarded)
    if plan is not None:
        fp8_homes, scale_aliases = _fp8_homes(model, trace, table, plan)
        homes.update(fp8_homes)
        aliases.update(scale_aliases)
        _check_fp8(plan, homes, scale_aliases, checkpoint, shapes)
    state = WorkerState(model=model, reload=reload, table=table, mode="reload" if feeds else "live",
                        homes=homes, host=host, feeds=feeds, aliases=aliases, representation=representation, plan=plan)
    summary = {
        "mode": state.mode, "representation": representation, "tp_rank": table.tp_rank, "tp_size": table.tp_size,
        "tensors": len(homes), "in_place": sum(not t.host for t in homes.values()), "host_copies": len(host),
        "host_bytes": sum(t.numel() * t.element_size() for t in host.values()),
        "fp8_layers": len(plan.groups) if plan is not None else 0,
        "kernel_rebuilds": len({m for t in homes.values() if not t.host for m in t.modules}),
        "reloaded_modules": len(feeds), "transformed": len(transformed), "untraced": sorted(table.untraced)[:8],
        "mirrored": sum(bool(t.mirror) for t in homes.values()), "discarded": dict(table.discarded),
        "tied": dict(table.tied),
        "trace_seconds": round(trace.seconds, 4), "seconds": round(time.perf_counter() - t0, 4),
    }
    log.info("deltasync routing table built: %s", summary)
    return state, summary


def _quantizes_fp8(model: torch.nn.Module) -> bool:
    """Whether any layer of ``model`` holds FP8 weights (an FP8 engine)."""
    return any(p.dtype in (torch.float8_e4m3fn, torch.float8_e4m3fnuz) for p in model.parameters())


def _check_host_bytes(host_bytes: int, budget: int | None, names: list[str], feeds: dict[str, tuple[str, ...]],
                      transformed: dict[str, str], *, fp8: bool) -> None:
    """State the host copies' memory, and refuse it above ``budget`` (before any is read). ``fp8``: an FP8 engine
    fed the checkpoint's tensors (its FP8 representation would need none for its FP8 linear layers)."""
    gib = host_bytes / 2**30
    log.info("deltasync: host copies of %d checkpoint tensor(s) for %d module(s) vLLM transforms after loading or "
             "re-loads: %.3f GiB of host memory (budget: %s)", len(names), len(feeds), gib,
             "none" if budget is None else f"{budget / 2**30:.3f} GiB")
    if budget is None or host_bytes <= budget:
        return
    modules = sorted(feeds)
    why = next((w for p, w in transformed.items() if p.rpartition(".")[0] in feeds), "re-loaded through vLLM")
    remedy = ("This is an FP8 engine fed the checkpoint's tensors: vLLM re-quantizes every layer it transforms from "
              "host copies of them. Publish its FP8 representation instead (rollout_loader.vllm.Fp8Quantizer, "
              "docs/FORMAT.md section 7) and follow it with representation='fp8': FP8 bytes and scales written in "
              "place, no host copy" if fp8 else
              "These modules have no in-place path: keep CPU linear weights live "
              "(rollout_loader.vllm.enable_live_cpu_weights) where they are repacked, or raise max_host_bytes")
    raise ConfigError(
        f"deltasync engine setting max_host_bytes: this engine would keep host copies of {len(names)} checkpoint "
        f"tensor(s) ({host_bytes} bytes, {gib:.3f} GiB) for {len(modules)} module(s) whose parameters vLLM transforms "
        f"after loading (e.g. {modules[:3]}: {why}), above the budget of {budget} bytes ({budget / 2**30:.3f} GiB); "
        f"nothing was read and the engine serves its weights as before. {remedy}")


def _checkpoint_view(live: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor | None:
    """``live`` as a contiguous tensor in checkpoint layout ``shape`` sharing its storage (vLLM keeps FP8 weights
    transposed, ``qweight.t()``, for its GEMM), or None where the kernel holds another layout (a repack)."""
    if tuple(live.shape) == tuple(shape) and live.is_contiguous():
        return live
    if live.ndim == 2 and tuple(live.shape) == tuple(shape)[::-1] and live.t().is_contiguous():
        return live.t()
    return None


def _fp8_homes(model: torch.nn.Module, trace: Any, table: RoutingTable, plan: Fp8Plan
               ) -> tuple[dict[str, TensorHome], dict[str, str]]:
    """The homes of an FP8 stream's weights and scales (written in place) and the scales that are one tensor on the
    engine (a per-tensor group's members carry its one scale: {member's scale: the first member's})."""
    homes: dict[str, TensorHome] = {}
    aliases: dict[str, str] = {}
    scales: dict[str, tuple[Route, ...]] = {}
    scale_bits: dict[str, torch.Tensor] = {}
    for g in plan.groups:
        module = model.get_submodule(g.module)
        shape = trace.params[f"{g.module}.weight"][0]
        weight = getattr(module, "weight", None)
        assert isinstance(weight, torch.Tensor)  # plan_of found its routes
        view = _checkpoint_view(weight.data, shape)
        attr = scale_attr(g.scheme)
        scale = getattr(module, attr, None)
        if view is None or view.dtype != torch.float8_e4m3fn or not isinstance(scale, torch.Tensor):
            raise RoutingError(
                f"FP8 layer {g.module!r} holds its weight as {weight.dtype} {list(weight.shape)} "
                f"(checkpoint format {list(shape)}){'' if isinstance(scale, torch.Tensor) else ' with no ' + attr}: "
                "its kernel keeps FP8 weights in its own layout, which an FP8 stream cannot be written into in place; "
                "follow this engine with the checkpoint's tensors (representation='checkpoint')")
        want = _scale_shape(g, tuple(view.shape))
        if math.prod(scale.shape) != math.prod(want) or (g.scheme != "per_tensor" and tuple(scale.shape) != want):
            raise RoutingError(f"FP8 layer {g.module!r} holds {attr} {list(scale.shape)}, expected {list(want)} for "
                               f"its {g.scheme} scheme: vLLM's layout is not the one deltasync knows")
        bits = int_bits(view)
        for m in g.members:
            pieces = tuple(replace(r, casts=()) for r in table.routes[m])
            homes[m] = TensorHome(routes=pieces, bits=bits, host=False, modules=(), dtype=FP8)
            sname = scale_name(m, g.scheme)
            if g.scheme == "per_tensor" and m != g.members[0]:
                aliases[sname] = scale_name(g.members[0], g.scheme)
                continue
            routes = [_scale_route(r, g, sname, f"{g.module}.{attr}", tuple(scale.shape), plan.tensors[m][1])
                      for r in pieces]
            scales[sname] = tuple(routes[:1] if g.scheme == "per_tensor" else routes)
            scale_bits[sname] = int_bits(scale.data)
    owned = assign_owners(RoutingTable(routes=scales, tp_rank=table.tp_rank, tp_size=table.tp_size),
                          all_gather_tp(RoutingTable(routes=scales).boxes()))
    for sname, pieces in owned.routes.items():
        homes[sname] = TensorHome(routes=pieces, bits=scale_bits[sname], host=False, modules=(), dtype=SCALE)
    return homes, aliases


def _scale_shape(g: Fp8Group, local: tuple[int, ...]) -> tuple[int, ...]:
    """The engine layer's scale shape for its local weight ``local`` (rows, cols in checkpoint layout)."""
    if g.scheme == "per_tensor":
        return (1,)
    if g.scheme == "per_channel":
        return (local[0], 1)
    assert g.block is not None
    return (math.ceil(local[0] / g.block[0]), math.ceil(local[1] / g.block[1]))


def _scale_route(r: Route, g: Fp8Group, name: str, param: str, pshape: tuple[int, ...],
                 hf_shape: tuple[int, ...]) -> Route:
    """Where the scale of the weight elements ``r`` routes lies: the scale's box of the stream's scale tensor in
    the layer's scale parameter (a per-tensor scale: its one element; per channel: the rows; per block: the blocks,
    which must start on the route's block boundaries)."""
    if g.scheme == "per_tensor":
        return Route(hf_name=name, hf_shape=(), hf_grid=(1,), hf_start=(0,), extent=(1,), param_name=param,
                     param_shape=pshape, param_grid=(1,), param_start=(0,), param_extent=(1,))
    (h0, h1), (e0, e1), (p0, p1) = r.hf_start, r.extent, r.param_start
    if g.scheme == "per_channel":
        return Route(hf_name=name, hf_shape=(hf_shape[0], 1), hf_start=(h0, 0), extent=(e0, 1), param_name=param,
                     param_shape=pshape, param_start=(p0, 0), param_extent=(e0, 1))
    assert g.block is not None
    b0, b1 = g.block
    ends = [(h0 + e0, hf_shape[0]), (h1 + e1, hf_shape[1])]
    if h0 % b0 or h1 % b1 or p0 % b0 or p1 % b1 or any(end % b and end != full for (end, full), b in
                                                        zip(ends, (b0, b1), strict=True)):
        raise RoutingError(f"{r.hf_name!r}: this rank holds rows {h0}..{h0 + e0}, columns {h1}..{h1 + e1}, not on "
                           f"the {b0}x{b1} blocks of FP8 layer {g.module!r}: its scales cannot be written per rank")
    hshape = (math.ceil(hf_shape[0] / b0), math.ceil(hf_shape[1] / b1))
    extent = (math.ceil((h0 + e0) / b0) - h0 // b0, math.ceil((h1 + e1) / b1) - h1 // b1)
    return Route(hf_name=name, hf_shape=hshape, hf_start=(h0 // b0, h1 // b1), extent=extent, param_name=param,
                 param_shape=pshape, param_start=(p0 // b0, p1 // b1), param_extent=extent)


SAMPLE_FP8_GROUPS = 4  # FP8 layers whose bits are checked at init against the quantizer's of the engine's checkpoint


def _check_fp8(plan: Fp8Plan, homes: dict[str, TensorHome], aliases: dict[str, str], checkpoint: str,
               shapes: Shapes) -> None:
    """Quantize sampled groups of the engine's checkpoint with :class:`Fp8Quantizer` (vLLM's functions, in the
    engine's process) and check that every bit sits where the routes say: the FP8 layout is the checkpoint's and
    a trainer quantizing as the plan says gives this engine's bits. Call it right after the engine loaded
    ``checkpoint``."""
    rng = random.Random(0)
    groups = rng.sample(list(plan.groups), min(SAMPLE_FP8_GROUPS, len(plan.groups)))
    members = sorted({m for g in groups for m in g.members})
    loaded = read_checkpoint(checkpoint, members, shapes)
    quantizer = Fp8Quantizer(plan)
    for g in groups:
        for name, t in quantizer._group(g, [loaded[m] for m in g.members]):
            home = homes[aliases.get(name, name)]
            want = int_bits(t.contiguous()).to(home.bits.device)
            for route in home.routes:
                for box in chunks(route):
                    if not torch.equal(want[box.hf_indices()], home.bits[box.param_indices()]):
                        raise RoutingError(
                            f"FP8 layer {g.module!r}: the engine holds other bits for {name!r} than vLLM's "
                            f"{g.scheme} quantization of its checkpoint {checkpoint!r} gives through deltasync's "
                            "quantizer: either the engine's weights changed since it loaded that checkpoint "
                            "(initialise deltasync before any other weight update), or its FP8 kernel computes or "
                            "lays out its weights otherwise; follow it with the checkpoint's tensors "
                            "(representation='checkpoint')")


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
