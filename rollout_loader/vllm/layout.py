"""What a loaded vLLM model holds and what its checkpoint holds: parameter specs, checkpoint layout, routes.

The pure routing (:mod:`rollout_loader.routing`) needs, for each engine parameter, how this rank holds it
(:class:`~rollout_loader.routing.ParamSpec`) and which checkpoint names feed it; this module reads both from
a live vLLM model (its layers' own sharding attributes, ``packed_modules_mapping``, ``hf_to_vllm_mapper``),
and reads checkpoint names, shapes and dtypes from safetensors files. vLLM is imported only inside the
functions that inspect a model.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from dataclasses import replace
from pathlib import Path

import torch
from safetensors import safe_open

from deltasync import DTYPES  # safetensors dtype names (as in docs/FORMAT.md) -> torch dtypes
from rollout_loader.routing import ParamSpec, RoutingError, RoutingTable, Shard, build_routing_table, packed_resolver

Shapes = dict[str, list[int]]
Dtypes = dict[str, torch.dtype]



def safetensors_files(path: str | Path) -> list[Path]:
    p = Path(path)
    files = sorted(p.glob("*.safetensors")) if p.is_dir() else [p]
    if not files or not all(f.is_file() for f in files):
        raise RoutingError(f"no safetensors checkpoint at {str(path)!r} (names, shapes and host copies are read there)")
    return files


def checkpoint_layout(path: str | Path) -> tuple[Shapes, Dtypes]:
    """Names, shapes and dtypes of a safetensors checkpoint (a file or a folder of them), read from headers."""
    shapes: Shapes = {}
    dtypes: Dtypes = {}
    for f in safetensors_files(path):
        with safe_open(str(f), framework="pt") as st:
            for k in st.keys():  # noqa: SIM118 (safe_open is not a dict)
                sl = st.get_slice(k)
                shapes[k] = list(sl.get_shape())
                dtypes[k] = DTYPES[sl.get_dtype()]
    return shapes, dtypes


def parse_layout(text: str) -> tuple[Shapes, Dtypes]:
    """``{name: shape}`` or ``{name: {"shape": shape, "dtype": "BF16"}}`` (safetensors dtype names)."""
    try:
        doc = json.loads(text)
    except ValueError as e:
        raise RoutingError(f"layout is not JSON ({e}): expected {{name: shape}}") from None
    if not isinstance(doc, dict):
        raise RoutingError(f"layout must be a JSON object {{name: shape}}, got {type(doc).__name__}")
    shapes: Shapes = {}
    dtypes: Dtypes = {}
    for name, v in doc.items():
        shape = v.get("shape") if isinstance(v, dict) else v
        if not (isinstance(shape, list) and all(isinstance(d, int) and d >= 0 for d in shape)):
            raise RoutingError(f"layout entry {name!r}: expected a shape (list of sizes), got {shape!r}")
        shapes[name] = shape
        if isinstance(v, dict) and "dtype" in v:
            if v["dtype"] not in DTYPES:
                raise RoutingError(f"{name!r}: unknown dtype {v['dtype']!r} (known: {sorted(DTYPES)})")
            dtypes[name] = DTYPES[v["dtype"]]
    return shapes, dtypes


def read_checkpoint(path: str | Path, names: list[str], shapes: Mapping[str, list[int]]) -> dict[str, torch.Tensor]:
    """Host copies of checkpoint tensors ``names`` (reload mode: the values of repacked layers)."""
    out: dict[str, torch.Tensor] = {}
    for f in safetensors_files(path):
        with safe_open(str(f), framework="pt") as st:
            for k in set(names) & set(st.keys()):
                out[k] = st.get_tensor(k).contiguous()
    missing = [n for n in names if n not in out]
    if missing:
        raise RoutingError(
            f"reload mode needs host copies of {missing[:5]} (and {max(0, len(missing) - 5)} more), not in {str(path)!r}"
        )
    for n in names:
        if list(out[n].shape) != list(shapes[n]):
            raise RoutingError(f"{n!r}: checkpoint at {str(path)!r} has shape {list(out[n].shape)}, expected {shapes[n]}")
    return out


def build_table(model: torch.nn.Module, hf_shapes: Mapping[str, list[int]], *, ignore: list[str] | None = None) -> RoutingTable:
    """The routing table of a loaded vLLM model for checkpoint tensors ``hf_shapes``, on this rank."""
    from vllm.distributed import get_tensor_model_parallel_rank, get_tensor_model_parallel_world_size

    rank, size = get_tensor_model_parallel_rank(), get_tensor_model_parallel_world_size()
    specs = [param_spec(model, name, param, size) for name, param in model.named_parameters()]
    return build_routing_table(
        hf_shapes, specs, resolve=resolver(model), tp_rank=rank, tp_size=size, tied=tied_aliases(model),
        ignore=ignore or (),
    )


def resolver(model: torch.nn.Module) -> Callable[[str], tuple[str, int | None] | None]:
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


def param_spec(model: torch.nn.Module, name: str, param: torch.nn.Parameter, tp_size: int) -> ParamSpec:
    """How this rank holds parameter ``name``: from the owning layer's own sharding attributes."""
    from vllm.model_executor.layers.linear import (
        ColumnParallelLinear,
        LinearBase,
        MergedColumnParallelLinear,
        QKVParallelLinear,
        RowParallelLinear,
    )
    from vllm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding

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


def tied_aliases(model: torch.nn.Module) -> dict[str, str]:
    """{alias parameter name: the name ``named_parameters()`` reports} for parameters shared by modules."""
    first: dict[int, str] = {}
    aliases: dict[str, str] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        if id(param) in first and first[id(param)] != name:
            aliases[name] = first[id(param)]
        first.setdefault(id(param), name)
    return aliases


def param_owners(model: torch.nn.Module) -> dict[str, list[tuple[str, str]]]:
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


def own_params(module: torch.nn.Module, mod_name: str) -> list[tuple[str, torch.nn.Parameter]]:
    return [(f"{mod_name}.{n}" if mod_name else n, p) for n, p in module.named_parameters(recurse=False)]
