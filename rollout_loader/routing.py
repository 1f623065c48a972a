"""Static routing from trainer (Hugging Face checkpoint) tensors to an inference engine's parameters.

Built once at start-up from names and shapes only, so every later patch is a pure index computation. An
engine parameter may be fused (``qkv_proj`` holds q, k and v stacked along dim 0; ``gate_up_proj`` holds
gate and up) and, under tensor parallelism, each rank holds one slice of it. A :class:`Route` records, for
one checkpoint tensor on this rank, the box of the checkpoint tensor this rank holds and where that box
sits inside the local parameter; flat indices map through it with a handful of integer ops.

Everything that cannot be placed fails here, at build time, not halfway through a patch.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType

import torch

from deltasync import TensorMismatchError


class RoutingError(TensorMismatchError):
    """A checkpoint tensor cannot be placed in the engine, or an engine parameter is not fed by any: the
    stream's tensors do not fit this engine's model (a ``TensorMismatchError``, so also a ``ValueError``)."""


@dataclass(frozen=True, kw_only=True)
class Shard:
    """One checkpoint tensor's part of a parameter, along the parameter's split (or fused) dim.

    ``size`` is the checkpoint tensor's extent along that dim. Under tensor parallelism the extent
    ``padded_size`` (>= size; vocabularies are padded to a multiple) is cut into ``tp_size // replicas``
    equal blocks and rank r holds block ``r // replicas``: ``replicas > 1`` when several ranks hold the
    same block (k and v when there are fewer kv heads than ranks). Rows past ``size`` are padding that no
    checkpoint element feeds.
    """

    size: int
    padded_size: int | None = None
    replicas: int = 1


@dataclass(frozen=True, kw_only=True)
class ParamSpec:
    """An engine parameter as this rank holds it.

    ``split_dim``: the dim cut across tensor-parallel ranks (0 for column- and vocab-parallel layers,
    1 for row-parallel ones), None when every rank holds the whole parameter. ``shards``: for a fused
    parameter, its parts stacked along dim 0 in checkpoint order (q, k, v); for a plain one either empty
    (one shard of the checkpoint tensor's full extent) or one shard saying how dim 0 is padded.
    """

    name: str
    shape: tuple[int, ...]
    split_dim: int | None = None
    shards: tuple[Shard, ...] = ()


@dataclass(frozen=True, kw_only=True)
class Route:
    """Where this rank's part of checkpoint tensor ``hf_name`` lives in parameter ``param_name``.

    The part is a box: along dim d it spans ``hf_start[d] : hf_start[d] + extent[d]`` of the checkpoint
    tensor and ``param_start[d] : param_start[d] + extent[d]`` of the local parameter. ``owner`` is True on
    exactly one of the ranks holding the same box, so per-rank checksums of owned boxes add up to the
    checksum of the whole checkpoint tensor.
    """

    hf_name: str
    hf_shape: tuple[int, ...]
    param_name: str
    param_shape: tuple[int, ...]
    shard: int | None
    hf_start: tuple[int, ...]
    param_start: tuple[int, ...]
    extent: tuple[int, ...]
    owner: bool = True

    @property
    def numel(self) -> int:
        return math.prod(self.extent)

    @property
    def hf_numel(self) -> int:
        return math.prod(self.hf_shape)

    @property
    def whole(self) -> bool:
        """This rank holds every element of the checkpoint tensor."""
        return self.numel == self.hf_numel

    def hf_indices(self) -> torch.Tensor:
        """Flat indices (ascending) of the checkpoint-tensor elements this rank holds."""
        return _box_indices(self.hf_shape, self.hf_start, self.extent)

    def param_indices(self) -> torch.Tensor:
        """Flat local-parameter indices of the same elements, in the same order as :meth:`hf_indices`."""
        return _box_indices(self.param_shape, self.param_start, self.extent)

    def localize(self, positions: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor]:
        """For flat checkpoint ``positions``: (mask of those held on this rank, or None for all of them,
        their flat param indices)."""
        pos = positions.reshape(-1).to(torch.int64)
        trailing_whole = all(
            hs == 0 and ext == size and psize == size
            for size, psize, hs, ext in zip(self.hf_shape[1:], self.param_shape[1:], self.hf_start[1:], self.extent[1:])
        )
        if self.hf_shape and trailing_whole:
            # a block of whole rows (q/k/v in qkv_proj, gate/up, a column-parallel shard): one shift
            row = math.prod(self.hf_shape[1:])
            lo, hi = self.hf_start[0] * row, (self.hf_start[0] + self.extent[0]) * row
            shift = self.param_start[0] * row - lo
            if lo == 0 and hi == math.prod(self.hf_shape):
                return None, pos + shift if shift else pos
            keep = (pos >= lo) & (pos < hi)
            return keep, pos[keep] + shift
        keep = torch.ones_like(pos, dtype=torch.bool)
        out = torch.zeros_like(pos)
        hf_strides = _strides(self.hf_shape)
        p_strides = _strides(self.param_shape)
        for d, (size, hs, ps, ext) in enumerate(
            zip(self.hf_shape, self.hf_start, self.param_start, self.extent, strict=True)
        ):
            coord = (pos // hf_strides[d]) % size
            if hs != 0 or ext != size:
                keep &= (coord >= hs) & (coord < hs + ext)
            out += (coord - hs + ps) * p_strides[d]
        return keep, out[keep]


@dataclass(frozen=True, kw_only=True)
class RoutingTable:
    """Routes of every checkpoint tensor on one rank, and which engine parameters are shared (tied)."""

    routes: Mapping[str, Route]
    tied: Mapping[str, str] = field(default_factory=dict)
    tp_rank: int = 0
    tp_size: int = 1

    def __post_init__(self) -> None:
        object.__setattr__(self, "routes", MappingProxyType(dict(self.routes)))
        object.__setattr__(self, "tied", MappingProxyType(dict(self.tied)))

    def __getitem__(self, hf_name: str) -> Route:
        try:
            return self.routes[hf_name]
        except KeyError:
            raise RoutingError(f"{hf_name!r} is not a checkpoint tensor of this model") from None

    def by_param(self) -> dict[str, list[Route]]:
        """Routes grouped by the parameter they feed (all checkpoint tensors feeding a fused parameter)."""
        out: dict[str, list[Route]] = {}
        for r in self.routes.values():
            out.setdefault(r.param_name, []).append(r)
        return out


def packed_resolver(
    packed_modules_mapping: Mapping[str, Sequence[str]],
    rename: Callable[[str], str | None] | None = None,
) -> Callable[[str], tuple[str, int | None] | None]:
    """Resolve a checkpoint name to (parameter name, shard position) with a model's packed-module mapping.

    ``rename`` (e.g. a model's prefix renames) is applied first; it returns None for names the engine
    drops. ``model.layers.0.self_attn.k_proj.weight`` with ``{"qkv_proj": ["q_proj", "k_proj", "v_proj"]}``
    resolves to (``model.layers.0.self_attn.qkv_proj.weight``, 1). Names that are no packed part resolve to
    themselves with shard None; the caller checks that they exist.
    """
    part_of = {part: (fused, i) for fused, parts in packed_modules_mapping.items() for i, part in enumerate(parts)}

    def resolve(name: str) -> tuple[str, int | None] | None:
        new = rename(name) if rename is not None else name
        if new is None:
            return None
        module, _, leaf = new.rpartition(".")
        parent, _, last = module.rpartition(".")
        if last in part_of:
            fused, i = part_of[last]
            return f"{parent + '.' if parent else ''}{fused}.{leaf}", i
        return new, None

    return resolve


def build_routing_table(
    hf_shapes: Mapping[str, Sequence[int]],
    params: Iterable[ParamSpec],
    *,
    resolve: Callable[[str], tuple[str, int | None] | None],
    tp_rank: int = 0,
    tp_size: int = 1,
    tied: Mapping[str, str] | None = None,
    ignore: Iterable[str] = (),
) -> RoutingTable:
    """Place every checkpoint tensor in ``hf_shapes`` on this rank's parameters ``params``.

    ``resolve`` maps a checkpoint name to (parameter name, shard position or None), or None when the engine
    drops that tensor. ``tied`` maps an alias parameter name to the parameter it shares storage with
    (``lm_head.weight`` -> ``model.embed_tokens.weight``): an update to the latter reaches both, and a
    checkpoint tensor resolving to an alias is an error, since it would have to agree with the other.
    ``ignore``: checkpoint names to leave out on purpose.

    Raises RoutingError for a checkpoint tensor that resolves to nothing, to an unknown or tied parameter,
    or with a shape that does not fit; and for a parameter, or a shard of a fused parameter, that no
    checkpoint tensor feeds.
    """
    if not 0 <= tp_rank < tp_size:
        raise RoutingError(f"tensor-parallel rank {tp_rank} is outside world size {tp_size}")
    tied = dict(tied or {})
    specs = {p.name: p for p in params}
    skip = set(ignore)
    routes: dict[str, Route] = {}
    fed: dict[str, set[int | None]] = {}
    misfit: set[str] = set()  # parameters already reported through a tensor that does not fit
    problems: list[str] = []
    for hf_name, shape in hf_shapes.items():
        if hf_name in skip:
            continue
        target = resolve(hf_name)
        if target is None:
            problems.append(f"{hf_name!r}: the engine drops this tensor (pass it in ignore= if that is intended)")
            continue
        param_name, shard = target
        if param_name in tied:
            problems.append(
                f"{hf_name!r}: engine parameter {param_name!r} is tied to {tied[param_name]!r}; updates reach it "
                "through that tensor, so leave this one out of the checkpoint (or pass it in ignore=)"
            )
            continue
        spec = specs.get(param_name)
        if spec is None:
            problems.append(f"{hf_name!r}: no engine parameter {param_name!r}")
            continue
        try:
            routes[hf_name] = _route(hf_name, tuple(int(s) for s in shape), spec, shard, tp_rank, tp_size)
        except RoutingError as e:
            problems.append(str(e))
            misfit.add(param_name)
            continue
        if shard in fed.setdefault(param_name, set()):
            other = next(
                r.hf_name
                for r in routes.values()
                if r.param_name == param_name and r.shard == shard and r.hf_name != hf_name
            )
            problems.append(f"{hf_name!r} and {other!r} both feed {param_name!r} (shard {shard})")
        fed[param_name].add(shard)
    for name, spec in specs.items():
        wanted: set[int | None] = set(range(len(spec.shards))) if len(spec.shards) > 1 else {None}
        missing = wanted - fed.get(name, set())
        if name in misfit:
            continue
        if missing == wanted:
            problems.append(f"engine parameter {name!r} is fed by no checkpoint tensor")
        elif missing:
            problems.append(f"engine parameter {name!r}: shards {sorted(missing)} are fed by no checkpoint tensor")
    if problems:
        raise RoutingError(f"cannot route {len(problems)} tensor(s):\n  " + "\n  ".join(problems))
    return RoutingTable(routes=routes, tied=tied, tp_rank=tp_rank, tp_size=tp_size)


def _route(hf_name: str, hf_shape: tuple[int, ...], spec: ParamSpec, shard: int | None, rank: int, size: int) -> Route:
    where = f"{hf_name!r} -> {spec.name!r}"
    nd, split = len(spec.shape), spec.split_dim
    fused = len(spec.shards) > 1
    if len(hf_shape) != nd or (nd == 0 and split is not None):
        raise RoutingError(
            f"{where}: checkpoint shape {list(hf_shape)} and parameter shape {list(spec.shape)} differ in rank"
        )
    if split is not None and not 0 <= split < nd:
        raise RoutingError(f"{where}: split dim {split} of a {nd}-d parameter")
    if fused and shard is None:
        raise RoutingError(f"{where}: the parameter is fused from {len(spec.shards)} tensors; which one is this?")
    if shard is not None and not (fused and 0 <= shard < len(spec.shards)):
        raise RoutingError(
            f"{where}: resolved to shard {shard}, the parameter is fused from {len(spec.shards)} tensor(s)"
        )
    hf_start, param_start, extent = [0] * nd, [0] * nd, list(hf_shape)
    owner = split is not None or rank == 0  # a replicated parameter counts on rank 0 only
    if nd:
        # dim 0: shards stack along it, and tensor parallelism may cut each of them
        shards = spec.shards or (Shard(size=hf_shape[0]),)
        i = shard or 0
        if shards[i].size != hf_shape[0]:
            raise RoutingError(f"{where}: checkpoint dim 0 is {hf_shape[0]}, the parameter expects {shards[i].size}")
        locals_ = [_local_size(s, size, split == 0, where) for s in shards]
        if sum(locals_) != spec.shape[0]:
            if not fused and split != 0:
                raise RoutingError(
                    f"{where}: checkpoint shape {list(hf_shape)} does not fit parameter shape {list(spec.shape)}"
                )
            raise RoutingError(
                f"{where}: {sum(locals_)} rows expected on rank {rank} of {size}, the parameter has {spec.shape[0]}"
            )
        param_start[0] = sum(locals_[:i])
        if split == 0:
            s = shards[i]
            start = (rank // s.replicas) * locals_[i]
            hf_start[0] = min(start, s.size)
            extent[0] = max(0, min(locals_[i], s.size - start))  # rows past s.size are padding
            owner = rank % s.replicas == 0
    for d in range(1, nd):
        if d == split:
            local = _local_size(Shard(size=hf_shape[d]), size, True, where)
            hf_start[d], extent[d] = rank * local, local
        else:
            local = hf_shape[d]
        if local != spec.shape[d]:
            raise RoutingError(
                f"{where}: checkpoint shape {list(hf_shape)} does not fit parameter shape {list(spec.shape)} (dim {d})"
            )
    return Route(
        hf_name=hf_name,
        hf_shape=hf_shape,
        param_name=spec.name,
        param_shape=spec.shape,
        shard=shard,
        hf_start=tuple(hf_start),
        param_start=tuple(param_start),
        extent=tuple(extent),
        owner=owner,
    )


def _local_size(s: Shard, tp_size: int, split: bool, where: str) -> int:
    """Rows of shard ``s`` each rank holds."""
    if not split:
        return s.size
    padded = s.padded_size if s.padded_size is not None else s.size
    if padded < s.size or tp_size % s.replicas:
        raise RoutingError(f"{where}: bad shard {s} for tensor-parallel size {tp_size}")
    blocks = tp_size // s.replicas
    if padded % blocks:
        raise RoutingError(f"{where}: extent {padded} does not split into {blocks} equal blocks")
    return padded // blocks


def _strides(shape: Sequence[int]) -> list[int]:
    out, acc = [0] * len(shape), 1
    for d in range(len(shape) - 1, -1, -1):
        out[d] = acc
        acc *= shape[d]
    return out


def _box_indices(shape: Sequence[int], start: Sequence[int], extent: Sequence[int]) -> torch.Tensor:
    """Flat indices (row-major, ascending) of the box ``start : start + extent`` of a tensor of ``shape``."""
    idx = torch.zeros((), dtype=torch.int64)
    for stride, s, e in zip(_strides(shape), start, extent, strict=True):
        idx = idx.unsqueeze(-1) + (torch.arange(s, s + e, dtype=torch.int64) * stride)
    return idx.reshape(-1)
