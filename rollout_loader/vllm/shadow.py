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
from collections.abc import Iterable, Mapping
from contextlib import ExitStack
from typing import TYPE_CHECKING, Any

import torch
from safetensors import safe_open

from rollout_loader.routing import Route, RoutingError, RoutingTable

from .layout import safetensors_files
from .trace import Trace

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
                            f"engine parameter {pname!r} differs from {route.hf_name!r} in the engine's checkpoint "
                            f"{checkpoint!r}, and its layer has no post-load processing: the engine does not hold "
                            "its checkpoint (initialise deltasync right after the engine loaded it)")
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
    """Re-load checkpoint tensors ``weights`` (every one feeding ``modules``) through vLLM's layerwise reload,
    each of ``modules`` processed as at first load.

    vLLM processes a layer once all of its checkpoint elements arrived and copies the result into the live
    tensors. Its weight-update path skips the MoE experts' own post-load step (``moe_kernel`` already built:
    the CPU prepack is not redone), which would leave the experts in checkpoint order while a fresh engine holds
    them prepacked; with the kernel unset for the reload, the first-load path runs, exactly as a fresh engine's.
    """
    from vllm.model_executor.model_loader.reload.inplace import reload_weights

    kernels: list[tuple[Any, Any]] = []
    for name in modules:
        method = getattr(model.get_submodule(name), "quant_method", None)
        if method is not None and getattr(method, "moe_kernel", None) is not None:
            kernels.append((method, method.moe_kernel))
            method.moe_kernel = None
    try:
        reload_weights(vllm_config, model, weights_iterator=iter(weights), weights_path=None, is_checkpoint_format=True)
    finally:
        for method, kernel in kernels:
            if method.moe_kernel is None:  # the reload failed before rebuilding it
                method.moe_kernel = kernel


def _matches(reader: object, route: Route, live: torch.Tensor, rng: random.Random) -> bool:
    """Whether sampled rows of the checkpoint tensor sit, bit for bit, where the route says in ``live``."""
    from .layout import int_bits

    sl = reader.get_slice(route.hf_name)  # type: ignore[attr-defined]
    bits = int_bits(live.data)
    if not route.hf_shape:
        rows: list[int | None] = [None]
    else:
        first, n = route.hf_start[0], route.extent[0]
        rows = [*rng.sample(range(first, first + n), min(SAMPLE_ROWS, n))] if n else []
    for row in rows:
        if row is None:  # a 0-d tensor
            data, hf_idx = reader.get_tensor(route.hf_name).reshape(-1), torch.zeros(1, dtype=torch.int64)  # type: ignore[attr-defined]
        else:
            part = Route(**{**route.__dict__, "hf_start": (row, *route.hf_start[1:]), "extent": (1, *route.extent[1:]),
                            "param_extent": ()})
            full = sl[row:row + 1].reshape(-1)
            hf_idx = part.hf_indices()
            data = full[hf_idx - row * (route.hf_numel // route.hf_shape[0])]
        _, pidx = route.localize(hf_idx)
        if not torch.equal(int_bits(data.contiguous()), bits[pidx]):
            return False
    return True


def modules_of(names: Iterable[str]) -> set[str]:
    """The modules holding parameters ``names``."""
    return {n.rpartition(".")[0] for n in names}


def feeds_of(table: RoutingTable, modules: Iterable[str]) -> Mapping[str, tuple[str, ...]]:
    """{module: every checkpoint tensor feeding one of its parameters} (what a reload of it must send)."""
    by_module: dict[str, list[str]] = {}
    for name, pieces in table.routes.items():
        for m in {r.param_name.rpartition(".")[0] for r in pieces}:
            by_module.setdefault(m, []).append(name)
    return {m: tuple(by_module.get(m, ())) for m in modules}
