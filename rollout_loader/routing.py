"""Static routing from trainer (Hugging Face checkpoint) tensors to an inference engine's parameters.

Routes are *learned*, not written per model: the engine's own loading code runs once over meta tensors (no
data) while :class:`CopyRecorder` records every ``copy_`` into a parameter: which checkpoint tensor it read,
and which strided view of it landed in which strided view of the parameter. Fused projections (q/k/v into
``qkv_proj``), tensor-parallel slices, mixture-of-experts stacks (``experts.{e}.gate_proj`` into
``w13_weight[e_local, :I]``), padded vocabularies: whatever the loader does with views, the record says.
:func:`build_routing_table` turns the record into one :class:`Route` per checkpoint tensor, a box of the
checkpoint tensor and the box of the parameter it lands in, so every later patch is a pure index
computation.

Everything that cannot be placed exactly fails here, at build time, not halfway through a patch: a tensor the
loader reads through anything but a view, a parameter written by anything but a copy of a checkpoint tensor
(or a fill of padding), a parameter or part of one no checkpoint element feeds.
"""

from __future__ import annotations

import functools
import itertools
import math
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from types import MappingProxyType
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from deltasync.errors import TensorMismatchError

Shape = tuple[int, ...]


class RoutingError(TensorMismatchError):
    """A checkpoint tensor cannot be placed in the engine, or an engine parameter is not fed by any: the
    stream's tensors do not fit this engine's model (a ``TensorMismatchError``, so also a ``ValueError``)."""


@dataclass(frozen=True, kw_only=True)
class View:
    """A strided view into a contiguous tensor of shape ``base``: element ``i`` of the view is flat element
    ``offset + sum(i[d] * stride[d])`` of the base (what ``storage_offset()``/``stride()`` say)."""

    base: Shape
    offset: int
    shape: Shape
    stride: Shape

    def box(self) -> tuple[Shape, Shape] | None:
        """(start, extent) of the view as a box of the base, or None when it is no box (a transpose, a step,
        a broadcast): its dims of size > 1 must be base dims, in the base's order, with the base's strides."""
        strides, dim_of = _layout(self.base)
        start, rest = [], self.offset
        for s, size in zip(strides, self.base, strict=True):
            c, rest = divmod(rest, s) if s else (0, rest)
            if size and c >= size:
                return None
            start.append(c)
        extent = [1] * len(self.base)
        last = -1
        for size, st in zip(self.shape, self.stride, strict=True):
            if size == 1:
                continue
            d = dim_of.get(st, -1)  # dims of size > 1 of a contiguous base have distinct strides
            if d <= last or start[d] + size > self.base[d]:
                return None
            last = d
            extent[d] = size
        return tuple(start), tuple(extent)


@dataclass(frozen=True, kw_only=True)
class Copy:
    """One ``copy_`` the engine's loader made: view ``src`` of checkpoint tensor ``hf_name`` into view ``dst``
    of parameter ``param_name`` (both views have the same elements, in the same order)."""

    hf_name: str
    src: View
    param_name: str
    dst: View


@dataclass(frozen=True, kw_only=True)
class Route:
    """Where this rank's part of checkpoint tensor ``hf_name`` lives in parameter ``param_name``.

    The part is a box of the checkpoint tensor (``hf_start``, ``extent``, in its dims) and lands, element for
    element in row-major order, in a box of the local parameter (``param_start``, ``param_extent``, in the
    parameter's dims: an expert's ``[I, H]`` box sits in ``w13_weight`` as ``[1, I, H]``). ``owner`` is True on
    exactly one of the ranks holding the same box, so per-rank checksums of owned boxes add up to the checksum
    of the whole checkpoint tensor.
    """

    hf_name: str
    hf_shape: Shape
    param_name: str
    param_shape: Shape
    hf_start: Shape
    param_start: Shape
    extent: Shape
    param_extent: Shape = ()  # () means the same as ``extent`` (both tensors have the same rank)
    owner: bool = True

    def __post_init__(self) -> None:
        if not self.param_extent:
            object.__setattr__(self, "param_extent", tuple(self.extent))

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
        return _box_indices(self.param_shape, self.param_start, self.param_extent)

    def localize(self, positions: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor]:
        """For flat checkpoint ``positions``: (mask of those held on this rank, or None for all of them,
        their flat param indices)."""
        pos = positions.reshape(-1).to(torch.int64)
        hf_run, p_run = _run(self.hf_shape, self.hf_start, self.extent), _run(self.param_shape, self.param_start,
                                                                             self.param_extent)
        if hf_run is not None and p_run is not None:
            # both boxes are one contiguous run (whole rows of q in qkv_proj, an expert in w13_weight): one shift
            lo, hi = hf_run, hf_run + self.numel
            shift = p_run - lo
            if lo == 0 and hi == self.hf_numel:
                return None, pos + shift if shift else pos
            keep = (pos >= lo) & (pos < hi)
            return keep, pos[keep] + shift
        keep = torch.ones_like(pos, dtype=torch.bool)
        local = torch.zeros_like(pos)
        for d, (size, st, hs, ext) in enumerate(zip(self.hf_shape, _strides(self.extent), self.hf_start, self.extent,
                                                    strict=True)):
            coord = (pos // _strides(self.hf_shape)[d]) % size
            if hs != 0 or ext != size:
                keep &= (coord >= hs) & (coord < hs + ext)
            local += (coord - hs) * st
        local = local[keep]
        out = torch.zeros_like(local)
        for size, st, ps, pst in zip(self.param_extent, _strides(self.param_extent), self.param_start,
                                     _strides(self.param_shape), strict=True):
            out += ((local // st) % size + ps) * pst
        return keep, out


@dataclass(frozen=True, kw_only=True)
class RoutingTable:
    """Routes of every checkpoint tensor on one rank, and which engine parameters are shared (tied).

    ``routes``: {checkpoint tensor: its pieces on this rank}: one :class:`Route` for a tensor the loader copies
    whole or narrowed, several for one it splits (a fused ``qkv_proj`` checkpoint into q, k and v rows, a fused
    ``experts.gate_up_proj`` into every expert), all into one parameter, disjoint; none for a tensor only other
    ranks hold (an expert of another expert-parallel rank).
    """

    routes: Mapping[str, tuple[Route, ...]]
    tied: Mapping[str, str] = field(default_factory=dict)
    tp_rank: int = 0
    tp_size: int = 1

    def __post_init__(self) -> None:
        object.__setattr__(self, "routes", MappingProxyType({k: tuple(v) for k, v in self.routes.items()}))
        object.__setattr__(self, "tied", MappingProxyType(dict(self.tied)))

    def __getitem__(self, hf_name: str) -> tuple[Route, ...]:
        try:
            return self.routes[hf_name]
        except KeyError:
            raise RoutingError(f"{hf_name!r} is not a checkpoint tensor of this model") from None

    def by_param(self) -> dict[str, list[Route]]:
        """Routes grouped by the parameter they feed (all checkpoint tensors feeding a fused parameter)."""
        out: dict[str, list[Route]] = {}
        for pieces in self.routes.values():
            for r in pieces:
                out.setdefault(r.param_name, []).append(r)
        return out

    def boxes(self) -> dict[str, list[tuple[Shape, Shape]]]:
        """{checkpoint tensor: (hf_start, extent) of each piece this rank holds} (what :func:`assign_owners` needs
        from every rank)."""
        return {n: [(r.hf_start, r.extent) for r in pieces] for n, pieces in self.routes.items()}


class CopyRecorder(TorchDispatchMode):
    """Records what a weight loader does to parameters while it runs over meta tensors (no data moves).

    ``params``/``sources``: {name: meta tensor} of the parameters (checkpoint format) and of the checkpoint
    tensors handed to the loader. Each ``copy_`` into a parameter becomes a :class:`Copy`; a ``fill_``/``zero_``
    of a parameter view a fill (padding no checkpoint element feeds); any other write into a parameter, or a
    copy from anything but a view of a checkpoint tensor, a problem naming the parameter (it gets no exact
    route). Views keep their storage, so the storage tells which tensor a view belongs to. Writes into
    parameters are recorded, never executed.
    """

    def __init__(self, params: Mapping[str, torch.Tensor], sources: Mapping[str, torch.Tensor]) -> None:
        super().__init__()
        self._params = {_storage(t): (n, tuple(t.shape)) for n, t in params.items()}
        self._sources = {_storage(t): (n, tuple(t.shape)) for n, t in sources.items()}
        self.copies: list[Copy] = []
        self.fills: list[tuple[str, View]] = []
        self.problems: dict[str, str] = {}

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        dst = args[0] if args and isinstance(args[0], torch.Tensor) else None
        target = self._params.get(_storage(dst)) if dst is not None and func._schema.is_mutable else None
        if target is not None and dst is not None:  # (target is None without dst)
            name, base = target
            view = _view(dst, base)
            op = func.overloadpacket.__name__
            if op == "copy_":
                src = args[1]
                source = self._sources.get(_storage(src)) if isinstance(src, torch.Tensor) else None
                if source is None:
                    self.problems.setdefault(name, "copied from something other than a view of a checkpoint tensor")
                elif src.numel() != dst.numel():
                    self.problems.setdefault(name, f"the loader copies {list(src.shape)} of {source[0]!r} into "
                                                   f"{list(dst.shape)} of it: the shapes do not fit")
                else:
                    self.copies.append(Copy(hf_name=source[0], src=_view(src, source[1]), param_name=name, dst=view))
            elif op in ("fill_", "zero_"):
                self.fills.append((name, view))
            else:
                self.problems.setdefault(name, f"written by {func} (only copies of checkpoint tensors are routable)")
            return dst  # never executed: a parameter left live (a bias) must keep its bits
        return func(*args, **kwargs)


def build_routing_table(
    hf_shapes: Mapping[str, Sequence[int]],
    copies: Iterable[Copy],
    param_shapes: Mapping[str, Sequence[int]],
    *,
    fills: Iterable[tuple[str, View]] = (),
    problems: Mapping[str, str] | None = None,
    refused: Mapping[str, str] | None = None,
    held_elsewhere: Iterable[str] = (),
    unfed_ok: Iterable[str] = (),
    tied: Mapping[str, str] | None = None,
    ignore: Iterable[str] = (),
    tp_rank: int = 0,
    tp_size: int = 1,
) -> RoutingTable:
    """Routes of checkpoint tensors ``hf_shapes`` into parameters ``param_shapes`` from recorded ``copies``.

    ``fills``: parameter views the loader filled (padding); ``problems``: {parameter: why it has no exact
    route} (from :class:`CopyRecorder`); ``refused``: {checkpoint tensor: why the loader refused it};
    ``held_elsewhere``: checkpoint tensors other ranks hold (this rank may hold none of them: expert
    parallelism); ``unfed_ok``: parameters that need no checkpoint tensor (they share storage with a fed one:
    a tied head); ``tied`` is kept in the table for callers; ``ignore``: checkpoint names left out on purpose.
    Owners are this rank's: see :func:`assign_owners` across ranks.

    Raises RoutingError naming every checkpoint tensor that lands nowhere, in two parameters, twice on the same
    elements, or not as a box, and every parameter with a problem, written twice, or with elements no
    checkpoint tensor or fill feeds.
    """
    skip, elsewhere, tied = set(ignore), set(held_elsewhere), dict(tied or {})
    issues = [f"engine parameter {p!r}: {why}" for p, why in sorted((problems or {}).items())]
    by_hf: dict[str, list[Copy]] = {}
    for c in copies:
        if c.hf_name not in skip:
            by_hf.setdefault(c.hf_name, []).append(c)
    routes: dict[str, tuple[Route, ...]] = {}
    misfit = set(problems or {})  # parameters already reported through the tensor feeding them
    for hf_name, shape in hf_shapes.items():
        if hf_name in skip:
            continue
        got = by_hf.get(hf_name, [])
        if hf_name in (refused or {}):
            issues.append(f"{hf_name!r} {list(shape)}: the engine's loader refuses it ({(refused or {})[hf_name]})")
            continue
        if not got:
            if hf_name in elsewhere:
                routes[hf_name] = ()
            else:
                issues.append(f"{hf_name!r}: the engine drops this tensor (pass it in ignore= if that is intended)")
            continue
        pieces = [_route(c, tuple(int(s) for s in shape)) for c in got]
        params = sorted({c.param_name for c in got})
        bad = [p for p in pieces if isinstance(p, str)]
        if not bad and params[0] in tied:
            bad = [f"{hf_name!r}: the engine ties {params[0]!r} to {tied[params[0]]!r}; updates reach it through "
                   "that tensor, so leave this one out of the checkpoint (or pass it in ignore=)"]
        if not bad and len(params) > 1:
            bad = [f"{hf_name!r}: copied into {len(params)} parameters ({params[:3]}); one tensor feeds one parameter"]
        good = sorted((p for p in pieces if not isinstance(p, str)), key=lambda r: (r.hf_start, r.extent))
        if not bad and any(_overlap((a.hf_start, a.extent), (b.hf_start, b.extent))
                           for a, b in itertools.pairwise(good)):
            bad = [f"{hf_name!r}: the same elements are copied into {len(good)} places of {params[0]!r}; replicas of "
                   "one tensor (redundant experts) are not supported"]
        if bad:
            misfit.update(params)
            issues.extend(bad)
        else:
            routes[hf_name] = tuple(good)
    flat = [r for pieces in routes.values() for r in pieces]
    issues += _coverage(flat, param_shapes, fills, set(unfed_ok) | misfit)
    if issues:
        raise RoutingError(f"cannot route {len(issues)} tensor(s):\n  " + "\n  ".join(issues))
    return RoutingTable(routes=routes, tied=tied, tp_rank=tp_rank, tp_size=tp_size)


def assign_owners(table: RoutingTable,
                  boxes_by_rank: Sequence[Mapping[str, Sequence[tuple[Shape, Shape]]]]) -> RoutingTable:
    """``table`` with each route's owner set: the lowest rank holding the same box of the checkpoint tensor
    (replicated norms and routers, kv heads shared by ranks). ``boxes_by_rank``: every rank's
    :meth:`RoutingTable.boxes`, in rank order. Ranks' boxes must be equal or disjoint."""
    out: dict[str, tuple[Route, ...]] = {}
    for name, pieces in table.routes.items():
        owned = []
        for r in pieces:
            mine = (tuple(r.hf_start), tuple(r.extent))
            owner = True
            for rank, boxes in enumerate(boxes_by_rank[: table.tp_rank]):
                for other in boxes.get(name, ()):
                    other = (tuple(other[0]), tuple(other[1]))
                    if other == mine and r.numel:
                        owner = False
                    elif _overlap(mine, other):
                        raise RoutingError(f"{name!r}: ranks {rank} and {table.tp_rank} hold overlapping, unequal "
                                           f"parts {other} and {mine}: no rank can own them")
            owned.append(Route(**{**r.__dict__, "owner": owner}))
        out[name] = tuple(owned)
    return RoutingTable(routes=out, tied=table.tied, tp_rank=table.tp_rank, tp_size=table.tp_size)


def _route(c: Copy, hf_shape: Shape) -> Route | str:
    where = f"{c.hf_name!r} -> {c.param_name!r}"
    if c.src.base != hf_shape:
        return f"{where}: the loader saw shape {list(c.src.base)}, the checkpoint has {list(hf_shape)}"
    src, dst = c.src.box(), c.dst.box()
    if src is None or dst is None:
        return (f"{where}: the loader copies a transposed, strided or broadcast view "
                f"({'checkpoint' if src is None else 'parameter'} "
                f"side, shape {list(c.src.shape)}): no exact route")
    if [e for e in src[1] if e != 1] != [e for e in dst[1] if e != 1]:
        return f"{where}: checkpoint box {list(src[1])} and parameter box {list(dst[1])} do not line up"
    return Route(hf_name=c.hf_name, hf_shape=hf_shape, param_name=c.param_name, param_shape=c.dst.base,
                 hf_start=src[0], param_start=dst[0], extent=src[1], param_extent=dst[1])


def _coverage(routes: Iterable[Route], param_shapes: Mapping[str, Sequence[int]],
              fills: Iterable[tuple[str, View]], exempt: set[str]) -> list[str]:
    """Every element of every parameter fed exactly once (by a route or a fill), or what is wrong."""
    boxes: dict[str, list[tuple[Shape, Shape]]] = {}
    for r in routes:
        boxes.setdefault(r.param_name, []).append((r.param_start, r.param_extent))
    filled: dict[str, list[tuple[Shape, Shape]]] = {}
    for name, view in fills:
        box = view.box()
        if box is not None:
            filled.setdefault(name, []).append(box)
    issues = []
    for name, shape in param_shapes.items():
        if name in exempt:
            continue
        fed = boxes.get(name, [])
        if not fed:
            issues.append(f"engine parameter {name!r} is fed by no checkpoint tensor")
            continue
        pieces = sorted(fed)
        for a, b in itertools.pairwise(pieces):
            if _overlap(a, b):
                issues.append(f"engine parameter {name!r}: boxes {a} and {b} are written by two checkpoint tensors")
        n = sum(math.prod(e) for _, e in fed)
        if n > math.prod(shape):
            issues.append(f"engine parameter {name!r}: {n} elements written into its {math.prod(shape)}")
        pad = _union_numel(filled.get(name, []), fed)
        if n + pad < math.prod(shape):
            issues.append(f"engine parameter {name!r}: {math.prod(shape) - n - pad} of its {math.prod(shape)} elements "
                          "are fed by no checkpoint tensor")
    return issues


def _union_numel(fills: list[tuple[Shape, Shape]], fed: list[tuple[Shape, Shape]]) -> int:
    """Elements of the fill boxes that no fed box covers (padding rows next to routed ones)."""
    total = 0
    for box in set(fills):
        total += math.prod(box[1]) - sum(_intersection(box, f) for f in fed)
    return total


def _overlap(a: tuple[Shape, Shape], b: tuple[Shape, Shape]) -> bool:
    return _intersection(a, b) > 0


def _intersection(a: tuple[Shape, Shape], b: tuple[Shape, Shape]) -> int:
    n = 1
    for s1, e1, s2, e2 in zip(a[0], a[1], b[0], b[1], strict=True):
        n *= max(0, min(s1 + e1, s2 + e2) - max(s1, s2))
    return n


def _run(shape: Sequence[int], start: Sequence[int], extent: Sequence[int]) -> int | None:
    """The flat start of a box that is one contiguous run of its tensor, else None."""
    big = [d for d, e in enumerate(extent) if e != 1]
    if big and any(extent[d] != shape[d] for d in range(big[0] + 1, len(shape))):
        return None
    return sum(s * st for s, st in zip(start, _strides(shape), strict=True))


@functools.lru_cache(maxsize=4096)
def _layout(base: Shape) -> tuple[list[int], dict[int, int]]:
    """A contiguous tensor's strides, and {stride: dim} for its dims of size > 1."""
    strides = _strides(base)
    return strides, {st: d for d, (st, n) in enumerate(zip(strides, base, strict=True)) if n > 1}


def _storage(t: torch.Tensor) -> int:
    return t.untyped_storage()._cdata


def _view(t: torch.Tensor, base: Shape) -> View:
    return View(base=base, offset=int(t.storage_offset()), shape=tuple(t.shape), stride=tuple(t.stride()))


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


def chunks(route: Route, max_elements: int = 1 << 20) -> Iterator[Route]:
    """Split a route's box along its first dim of extent > 1 (on both sides) so index tensors stay bounded."""
    if route.numel <= max_elements:
        yield route
        return
    hd = next(d for d, e in enumerate(route.extent) if e != 1)
    pd = next(d for d, e in enumerate(route.param_extent) if e != 1)
    row = route.numel // route.extent[hd]
    step = max(1, max_elements // max(row, 1))
    for off in range(0, route.extent[hd], step):
        n = min(step, route.extent[hd] - off)
        yield replace(
            route,
            hf_start=_bump(route.hf_start, hd, off),
            param_start=_bump(route.param_start, pd, off),
            extent=_bump(route.extent, hd, n - route.extent[hd]),
            param_extent=_bump(route.param_extent, pd, n - route.param_extent[pd]),
        )


def _bump(t: tuple[int, ...], d: int, by: int) -> tuple[int, ...]:
    return (*t[:d], t[d] + by, *t[d + 1:])
