"""Parameters whose bytes vLLM transforms after loading, and how they are rewritten exactly.

After loading, vLLM's post-load processing (``process_weights_after_loading``) may turn a checkpoint-format
parameter into something else: CPU linears repack their weight for oneDNN (the parameter becomes empty), CPU
MoE experts are prepacked for their kernel (same shape, elements permuted), FP8 quantizes and transposes, MoE
backends shuffle ``w13``/``w2``. An XOR of checkpoint bits written into such a parameter corrupts it.

:func:`find_transformed` tells them apart from what vLLM itself says, with no list of layer classes: the
traced checkpoint-format parameter (:mod:`.trace`) against the live one (shape, dtype), and, where those
agree, a sample of the live bits against the checkpoint's through the routes (a permutation shows). Their
modules are *shadowed*: the engine keeps host copies of the checkpoint tensors feeding them, patches those,
and re-loads them through vLLM (:func:`reload_as_loaded`), which re-runs the module's own post-load
processing and copies the result into the live tensors' storage (addresses kept, as CUDA graphs need).
Importing this module imports no vLLM; the functions that touch a model do.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterable, Mapping
from contextlib import ExitStack
from typing import TYPE_CHECKING, Any

import torch
from safetensors import safe_open

from rollout_loader.routing import Route, RoutingError, RoutingTable

from .layout import checkpoint_layout, read_checkpoint, safetensors_files
from .trace import Trace, reloaded_attrs

if TYPE_CHECKING:
    from vllm.config import VllmConfig

SAMPLE_ROUTES = 2  # routes of a parameter whose bits are compared with the checkpoint's
SAMPLE_ROWS = 4  # rows of each such route


def find_transformed(model: torch.nn.Module, trace: Trace, table: RoutingTable, checkpoint: str) -> dict[str, str]:
    """{parameter: why the live tensor is not the checkpoint layout} for this rank's parameters.

    Call it right after the engine loaded ``checkpoint``. Raises RoutingError when a parameter of a module
    without post-load processing (a norm, an embedding) differs from the checkpoint: then the engine does not
    hold its checkpoint, and no host copy read from it would be right.
    """
    live = dict(model.named_parameters(remove_duplicate=False))
    out: dict[str, str] = {}
    for name, (shape, dtype) in trace.params.items():
        p = live.get(name)
        if p is None:
            out[name] = "replaced after loading (no live parameter of that name)"
        elif tuple(p.shape) != shape or p.dtype != dtype:
            out[name] = f"held as {p.dtype} {list(p.shape)}, checkpoint format {dtype} {list(shape)}"
        elif not p.data.is_contiguous():
            out[name] = "held as a non-contiguous tensor"
    rng = random.Random(0)
    files = safetensors_files(checkpoint)
    with ExitStack() as stack:
        readers = [stack.enter_context(safe_open(str(f), framework="pt")) for f in files]
        where = {k: r for r in readers for k in r.keys()}  # noqa: SIM118 (safe_open is not a dict)
        for pname, routes in table.by_param().items():
            if pname in out:
                continue
            for route in rng.sample(routes, min(SAMPLE_ROUTES, len(routes))):
                if route.hf_name in where and not _matches(where[route.hf_name], route, live[pname], rng):
                    module = model.get_submodule(pname.rpartition(".")[0])
                    if getattr(module, "quant_method", None) is None:
                        raise RoutingError(
                            f"engine parameter {pname!r} holds other bits than {route.hf_name!r} in the engine's "
                            f"checkpoint {checkpoint!r} puts there (through the loader's traced copy"
                            f"{', converted to ' + str(route.casts[-1]) if route.casts else ''}), and its layer has "
                            "no post-load processing vLLM could redo: either the engine's weights changed since it "
                            "loaded that checkpoint (initialise deltasync before any other weight update), or the "
                            "model rewrites this parameter after loading outside its layers (deltasync cannot follow "
                            "that)")
                    out[pname] = "its bits are a permutation or transform of the checkpoint's (post-load processing)"
                    break
    return out


def derived_params(model: torch.nn.Module, trace: Trace) -> dict[str, str | None]:
    """{live parameter vLLM created after loading: the traced parameter whose storage it shares, or None}.

    MLA's absorbed ``W_UK_T``/``W_UV`` are views of ``kv_b_proj.weight`` in bf16 (a write reaches them); a
    derived parameter sharing no storage would be stale after a write, so the caller refuses it.
    """
    live = dict(model.named_parameters())
    storages = {}
    for name in trace.params:
        p = live.get(name)
        if p is not None and p.numel():
            s = p.untyped_storage()
            storages[name] = (s.data_ptr(), s.data_ptr() + s.nbytes())
    out: dict[str, str | None] = {}
    for name, p in live.items():
        if name in trace.params:
            continue
        ptr = p.data_ptr()
        out[name] = next((n for n, (lo, hi) in storages.items() if lo <= ptr < hi), None)
    return out


def moe_modules(model: torch.nn.Module) -> list[str]:
    """Modules whose post-load processing includes an MoE kernel's own step (what a full reload must redo)."""
    return [n for n, m in model.named_modules()
            if getattr(getattr(m, "quant_method", None), "moe_kernel", None) is not None]


def reload_as_loaded(vllm_config: VllmConfig, model: torch.nn.Module, weights: Iterable[tuple[str, torch.Tensor]],
                     modules: Iterable[str]) -> None:
    """Re-load checkpoint tensors ``weights`` (every one feeding ``modules``) into ``modules`` as at first load, and
    copy the result into their live tensors (addresses kept, as CUDA graphs need).

    Each module is put back in checkpoint format from vLLM's own record (``restore_metadata``: shapes, dtypes,
    weight loaders) and materialized; the model's own ``load_weights`` runs over ``weights``; each module's own
    post-load processing runs (its quantization method's, an attention layer's), whether or not it has a
    quantization method; the results are copied into the live tensors. This is vLLM's layerwise reload without
    its buffering of ``weight_loader`` calls: a loader that copies into a parameter directly (gpt-oss's experts)
    reloads too. The MoE experts' own post-load step is redone (their kernel unset for the reload), exactly as
    a fresh engine's first load; on any failure the live tensors are put back untouched.
    """
    from vllm.model_executor.layers.attention import is_deferred_attention_layer
    from vllm.model_executor.layers.quantization.base_config import QuantizeMethodBase
    from vllm.model_executor.model_loader.reload.layerwise import (
        LAYERWISE_INFO,
        _copy_and_restore_kernel_tensors,
        _get_original_loader,
        _place_kernel_tensors,
    )
    from vllm.model_executor.model_loader.reload.meta import materialize_layer, restore_layer_on_meta
    from vllm.model_executor.model_loader.reload.utils import get_layer_params_buffers, get_layer_tensors

    layers = [model.get_submodule(name) for name in sorted(set(modules))]
    kernels: list[tuple[Any, Any]] = []
    restored: list[torch.nn.Module] = []
    try:
        for layer in layers:
            method = getattr(layer, "quant_method", None)
            if method is not None and getattr(method, "moe_kernel", None) is not None:
                kernels.append((method, method.moe_kernel))
                method.moe_kernel = None
            info = LAYERWISE_INFO[layer]
            info.kernel_tensors = get_layer_params_buffers(layer)
            info.kernel_non_persistent_buffers = set(layer._non_persistent_buffers_set)
            restored.append(layer)
            restore_layer_on_meta(layer, info)
            materialize_layer(layer, info)
            for t in get_layer_tensors(layer).values():
                if hasattr(t, "weight_loader"):
                    t.weight_loader = _get_original_loader(t)
        with torch.no_grad():
            model.load_weights(iter(weights))  # type: ignore[operator]
            for layer in layers:
                if hasattr(layer, "_already_called_process_weights_after_loading"):
                    delattr(layer, "_already_called_process_weights_after_loading")
                method = getattr(layer, "quant_method", None)
                if isinstance(method, QuantizeMethodBase):
                    method.process_weights_after_loading(layer)
                    if hasattr(layer, "update_param_tp_status"):
                        layer.update_param_tp_status()  # type: ignore[operator]  # vLLM's
                if is_deferred_attention_layer(layer):
                    layer.process_weights_after_loading(vllm_config.model_config.dtype)  # type: ignore[operator]
            for layer in layers:
                _copy_and_restore_kernel_tensors(layer, LAYERWISE_INFO[layer])
                restored.remove(layer)
    finally:
        for layer in restored:  # a failure: the live tensors, untouched, back in place
            _place_kernel_tensors(layer, LAYERWISE_INFO[layer])
        for layer in layers:
            LAYERWISE_INFO[layer].reset()
        for method, kernel in kernels:
            if method.moe_kernel is None:  # the reload failed before rebuilding it
                method.moe_kernel = kernel


def load_checkpoint(vllm_config: VllmConfig, model: torch.nn.Module, checkpoint: str) -> None:
    """Load ``checkpoint`` into an engine that never read it (vLLM's ``load_format="dummy"``: random weights, their
    post-load processing run over them), every module as at first load (:func:`reload_as_loaded` over every module
    vLLM keeps a record of). Afterwards the engine holds what a fresh engine loaded from ``checkpoint`` holds, so
    the routes' sampled bits tell which parameters vLLM transforms after loading (:func:`find_transformed`), as for
    any other engine. Reads the whole checkpoint into host memory, and re-loads every layer at once."""
    shapes, _ = checkpoint_layout(checkpoint)
    weights = read_checkpoint(checkpoint, sorted(shapes), shapes)
    reload_as_loaded(vllm_config, model, list(weights.items()), set(reloaded_attrs(model)))


def _matches(reader: object, route: Route, live: torch.Tensor, rng: random.Random) -> bool:
    """Whether sampled rows of the checkpoint tensor sit, bit for bit, where the route says in ``live``
    (converted to the parameter's dtype as the loader converts them, ``Route.casts``)."""
    from .layout import int_bits

    sl = reader.get_slice(route.hf_name)  # type: ignore[attr-defined]
    bits = int_bits(live.data)
    if len(route.hf_shape) == 0 or route.hf_shape[0] == 0:
        samples = [torch.arange(route.hf_numel, dtype=torch.int64)]
        rows: list[torch.Tensor | None] = [None]
    else:
        row_len = route.hf_numel // route.hf_shape[0]
        chosen = sorted({_sample(route, rng) // row_len for _ in range(SAMPLE_ROWS)}) if route.numel else []
        samples = [torch.arange(r * row_len, (r + 1) * row_len, dtype=torch.int64) for r in chosen]
        rows = [sl[r:r + 1].reshape(-1) for r in chosen]
    for pos, row in zip(samples, rows, strict=True):
        data = reader.get_tensor(route.hf_name).reshape(-1) if row is None else row  # type: ignore[attr-defined]
        keep, pidx = route.localize(pos)
        values = data if keep is None else data[keep]
        for dtype in route.casts:
            values = values.to(dtype)
        if not torch.equal(int_bits(values.contiguous()), bits[pidx]):
            return False
    return True


def _sample(route: Route, rng: random.Random) -> int:
    """A random flat index of the checkpoint elements ``route`` holds."""
    flat, acc = 0, 1
    for size, start, extent in reversed(list(zip(route.hgrid, route.hf_start, route.extent, strict=True))):
        flat += (start + rng.randrange(extent)) * acc
        acc *= size
    return flat


def modules_of(names: Iterable[str]) -> set[str]:
    """The modules holding parameters ``names``."""
    return {n.rpartition(".")[0] for n in names}


def feeds_of(table: RoutingTable, modules: Iterable[str],
             needing: Callable[[str], set[str]] | None = None) -> Mapping[str, tuple[str, ...]]:
    """{module: every checkpoint tensor its reload loads} (what a reload of it must send): the tensors routed
    into a parameter the module loads (``needing(param)``: the modules that load it; default the module holding
    it by its name) and those feeding its untraced parameters."""
    need = needing or (lambda p: {p.rpartition(".")[0]})
    mods = set(modules)
    by_module: dict[str, set[str]] = {m: set() for m in mods}
    for name, pieces in table.routes.items():
        for r in pieces:
            for m in need(r.param_name) & mods:
                by_module[m].add(name)
    for param, names in table.untraced.items():
        for m in need(param) & mods:
            by_module[m].update(names)
    return {m: tuple(sorted(names)) for m, names in by_module.items()}
