"""Routes learned from vLLM itself: the model's own ``load_weights`` run once over meta tensors.

vLLM records every layer's parameters in checkpoint format (shapes, dtypes, ``weight_loader`` and sharding
attributes) right after it builds a model, for its layerwise reload (``record_metadata_for_reloading``). This
module puts those checkpoint-format parameters back on the meta device, runs the model's ``load_weights`` over
meta stand-ins of the checkpoint tensors while :class:`~rollout_loader.routing.CopyRecorder` records each copy,
and puts the live parameters back. No data moves and nothing is allocated per element, so this works for any
model vLLM loads (fused projections, MoE experts under TP and EP, MLA, padded vocabularies) without a line of
per-model code, and for the largest models (meta tensors only). Importing this module imports vLLM.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field

import torch

from rollout_loader.routing import (
    Copy,
    CopyRecorder,
    RoutingError,
    RoutingTable,
    View,
    assign_owners,
    build_routing_table,
)

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Trace:
    """What the engine's loader does with each checkpoint tensor on this rank.

    ``params``: {parameter: (shape, dtype)} in checkpoint format (before vLLM's post-load processing);
    ``copies``/``fills``/``problems``/``untraced``: as recorded (see :class:`~rollout_loader.routing.CopyRecorder`);
    ``refused``: {checkpoint tensor: the error vLLM's loader raised for it}; ``reloadable``: parameters vLLM
    keeps a checkpoint-format record of (its layerwise reload re-loads their modules, :func:`reloaded_attrs`).
    """

    params: Mapping[str, tuple[tuple[int, ...], torch.dtype]]
    copies: list[Copy]
    fills: list[tuple[str, View]]
    problems: Mapping[str, str]
    refused: Mapping[str, str]
    seconds: float
    untraced: Mapping[str, frozenset[str]] = field(default_factory=dict)
    reloadable: frozenset[str] = frozenset()


def trace_loader(model: torch.nn.Module, shapes: Mapping[str, list[int]], dtypes: Mapping[str, torch.dtype]) -> Trace:
    """Run ``model.load_weights`` over meta tensors of checkpoint ``shapes``/``dtypes`` and record the copies.

    The live parameters are put back afterwards, also on failure. A checkpoint tensor the loader refuses (an
    unknown name, a shape it asserts against) is recorded in ``Trace.refused`` and the trace runs again without
    it, so one error names every such tensor (up to :data:`MAX_REFUSED`). Raises RoutingError when vLLM kept no
    checkpoint-format record of the model.
    """
    from vllm.model_executor.model_loader.reload.layerwise import LAYERWISE_INFO

    t0 = time.perf_counter()
    layers = [m for m in model.modules() if m in LAYERWISE_INFO]
    if not layers:
        raise RoutingError("vLLM kept no checkpoint-format record of this model (record_metadata_for_reloading): "
                           "routes cannot be learned from its loader")
    busy = [type(m).__name__ for m in layers if LAYERWISE_INFO[m].can_load()]
    if busy:
        raise RoutingError(f"a weight reload is in progress ({busy[:3]}): routes are learned between reloads")
    sources = {n: torch.empty(s, dtype=dtypes.get(n, torch.bfloat16), device="meta") for n, s in shapes.items()}
    refused: dict[str, str] = {}
    while True:
        try:
            params, recorder = _trace_once(model, layers, sources)
            break
        except _LoaderError as e:
            if e.name is None or e.name in refused or len(refused) >= MAX_REFUSED:
                raise RoutingError(f"vLLM's loader failed while routes were traced (at {e.name!r}): {e.text}") from None
            refused[e.name] = e.text
            sources.pop(e.name)
    reloadable = frozenset(f"{m}.{a}" if m else a for m, attrs in reloaded_attrs(model).items() for a in attrs)
    return Trace(params=params, copies=recorder.copies, fills=recorder.fills, problems=recorder.problems,
                 refused=refused, seconds=time.perf_counter() - t0,
                 untraced={p: frozenset(n) for p, n in recorder.untraced.items()}, reloadable=reloadable)


def reloaded_attrs(model: torch.nn.Module) -> dict[str, frozenset[str]]:
    """{module: the attributes vLLM's layerwise reload loads into it} (its checkpoint-format parameters, less the
    tensors vLLM never loads through a layer: ``SKIP_LOAD_TENSORS``, as the router's shared
    ``e_score_correction_bias``). A module re-loaded from host copies needs the checkpoint tensors feeding these,
    and only these."""
    from vllm.model_executor.model_loader.reload.layerwise import LAYERWISE_INFO
    from vllm.model_executor.model_loader.reload.meta import SKIP_LOAD_TENSORS

    out: dict[str, frozenset[str]] = {}
    for name, module in model.named_modules():
        info = LAYERWISE_INFO.get(module)
        if info is not None:
            attrs = frozenset(a for a in info.restore_metadata[0] if a not in SKIP_LOAD_TENSORS)
            if attrs:
                out[name] = attrs
    return out


MAX_REFUSED = 16  # checkpoint tensors the loader may refuse before the trace gives up naming them all


class _LoaderError(Exception):
    def __init__(self, name: str | None, text: str) -> None:
        super().__init__(text)
        self.name, self.text = name, text


def _trace_once(model: torch.nn.Module, layers: list[torch.nn.Module], sources: Mapping[str, torch.Tensor]
                ) -> tuple[dict[str, tuple[tuple[int, ...], torch.dtype]], CopyRecorder]:
    from vllm.model_executor.model_loader.reload.layerwise import (
        LAYERWISE_INFO,
        _get_original_loader,
        _place_kernel_tensors,
    )
    from vllm.model_executor.model_loader.reload.meta import restore_layer_on_meta
    from vllm.model_executor.model_loader.reload.utils import get_layer_params_buffers

    restored = []
    wrapped: list[tuple[torch.Tensor, object]] = []
    current: list[str | None] = [None]
    try:
        for layer in layers:
            info = LAYERWISE_INFO[layer]
            info.kernel_tensors = get_layer_params_buffers(layer)
            info.kernel_non_persistent_buffers = set(layer._non_persistent_buffers_set)
            restored.append(layer)
            restore_layer_on_meta(layer, info)
        params = dict(model.named_parameters())
        for p in params.values():  # online quantization buffers loads until a layer is complete: trace the loader
            loader = getattr(p, "weight_loader", None)
            if loader is not None and getattr(loader, "__name__", "") == "online_process_loader":
                wrapped.append((p, loader))
                p.weight_loader = _get_original_loader(p)  # type: ignore[attr-defined]  # vLLM's own attribute
        recorder = CopyRecorder(params, sources)

        def feed() -> Iterator[tuple[str, torch.Tensor]]:
            for name, t in sources.items():
                current[0] = name
                yield name, t
            current[0] = None

        with torch.no_grad(), recorder:
            model.load_weights(feed())  # type: ignore[operator]
        return {n: (tuple(p.shape), p.dtype) for n, p in params.items()}, recorder
    except Exception as e:
        text = f"{type(e).__name__}: {e}"
        raise _LoaderError(current[0], text if len(text) <= 300 else text[:300] + "...") from e
    finally:
        for param, loader in wrapped:
            param.weight_loader = loader  # type: ignore[attr-defined]  # vLLM's own attribute
        for layer in restored:
            _place_kernel_tensors(layer, LAYERWISE_INFO[layer])
            LAYERWISE_INFO[layer].reset()


def routing_table(model: torch.nn.Module, trace: Trace, shapes: Mapping[str, list[int]], *,
                  ignore: Iterable[str] = ()) -> RoutingTable:
    """This rank's routing table from ``trace``, owners assigned across the tensor-parallel group.

    A checkpoint tensor this rank's loader skips is fine when another rank copies it (expert parallelism
    places each expert on one rank). Parameters that need no checkpoint tensor are the live ones sharing
    storage with a fed parameter (a tied head): :func:`tied_aliases`.
    """
    from vllm.distributed import get_tp_group

    group = get_tp_group()
    rank, size = group.rank_in_group, group.world_size
    copied = sorted({c.hf_name for c in trace.copies} | {n for names in trace.untraced.values() for n in names})
    everyone = all_gather_tp(copied)
    elsewhere = {n for r, names in enumerate(everyone) if r != rank for n in names}
    tied = tied_aliases(model)
    table = build_routing_table(
        shapes, trace.copies, {n: s for n, (s, _) in trace.params.items()}, fills=trace.fills,
        problems=trace.problems, untraced=trace.untraced, reloadable=trace.reloadable, refused=trace.refused,
        held_elsewhere=elsewhere, unfed_ok=tied, tied=tied, ignore=ignore, tp_rank=rank, tp_size=size,
    )
    return assign_owners(table, all_gather_tp(table.boxes()))


def all_gather_tp(obj: object) -> list:
    """``obj`` from every tensor-parallel rank of this engine, in rank order (one rank: no communication)."""
    from vllm.distributed import get_tp_group

    group = get_tp_group()
    if group.world_size == 1:
        return [obj]
    out: list = [None] * group.world_size
    torch.distributed.all_gather_object(out, obj, group=group.cpu_group)
    return out


def refuse_moving_experts(vllm_config: object) -> None:
    """Refuse expert load balancing (EPLB): it moves experts between ranks at run time, while routes follow the
    placement vLLM's loader used; a write through them would land in another expert's slot."""
    parallel = getattr(vllm_config, "parallel_config", None)
    if getattr(parallel, "enable_eplb", False):
        raise RoutingError("this engine runs with enable_eplb (expert load balancing moves experts at run time); "
                           "deltasync routes follow the placement at load and are refused: start vLLM without "
                           "--enable-eplb")


def tied_aliases(model: torch.nn.Module) -> dict[str, str]:
    """{alias parameter name: the name ``named_parameters()`` reports} for parameters shared by modules."""
    first: dict[int, str] = {}
    aliases: dict[str, str] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        if id(param) in first and first[id(param)] != name:
            aliases[name] = first[id(param)]
        first.setdefault(id(param), name)
    return aliases
