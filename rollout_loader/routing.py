"""Static routing from trainer (Hugging Face checkpoint) tensors to an inference engine's parameters.

Routes are *learned*, not written per model: the engine's own loading code runs once over meta tensors (no
data) while :class:`CopyRecorder` records every ``copy_`` into a parameter: which checkpoint elements it read,
through which views and exact transformations (:mod:`rollout_loader.lineage`: a permute made contiguous, a
concatenation, a dtype widening), and where in the parameter they landed. Fused projections (q/k/v into
``qkv_proj``), tensor-parallel slices, mixture-of-experts stacks (``experts.{e}.gate_proj`` into
``w13_weight[e_local, :I]``), experts stored fused and transposed (gpt-oss), padded vocabularies: whatever the
loader does, the record says. :func:`build_routing_table` turns the record into one :class:`Route` per piece of
a checkpoint tensor, a box of the checkpoint tensor and the box of the parameter it lands in (with the order of
their dims), so every later patch is a pure index computation.

What has no exact element map is named, never guessed: a parameter the loader computes from checkpoint values
(arithmetic, a gather) is *untraced* (the caller re-loads its module through vLLM from host copies of the
checkpoint tensors that feed it: :mod:`rollout_loader.vllm.shadow`); a checkpoint tensor the loader writes into
a tied parameter is *discarded* (the model ties it: its checksum must equal the tensor it is tied to). What
cannot be followed at all fails here, at build time, with a :class:`RoutingError` naming each tensor.
"""

from __future__ import annotations

import functools
import itertools
import math
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from types import MappingProxyType
from typing import Any

import numpy as np
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from deltasync.errors import TensorMismatchError
from rollout_loader.lineage import (
    Copy,
    Dim,
    Lineage,
    add_parts,
    compose,
    contiguous_grid,
    copies_into,
    decompose,
    fill_region,
    refine,
    split_range,
)

Shape = tuple[int, ...]
Box = tuple[Shape, Shape]  # (start, extent)

__all__ = ["Copy", "CopyRecorder", "Route", "RoutingError", "RoutingTable", "View", "assign_owners",
           "build_routing_table", "chunks"]


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

    def grid_box(self, grid: list[Dim] | None = None) -> tuple[list[Dim], list[int], list[int]] | None:
        """(grid, start, extent) of the view as a box of ``grid`` (default: the base's, refined where the view's
        strides need it), or None when it is no box (a broadcast, an overlap)."""
        g: list[Dim] | None = contiguous_grid(self.base) if grid is None else grid
        for n, t in zip(self.shape, self.stride, strict=True):
            if n > 1 and g is not None:
                g = refine(g, t) if t > 0 else None
        if g is None:
            return None
        dec = decompose(g, self.offset, self.shape, self.stride)
        if dec is None:
            return None
        coords, pieces = dec
        extent = [1] * len(g)
        for ps in pieces:
            for i, e in ps:
                extent[i] = e
        return g, coords, extent


@dataclass(frozen=True, kw_only=True)
class Route:
    """Where this rank's part of checkpoint tensor ``hf_name`` lives in parameter ``param_name``.

    The part is a box of the checkpoint tensor (``hf_start``, ``extent``, counted in the dims of ``hf_grid``: the
    tensor's own shape, or a reshape of it where the loader's views needed finer dims) and lands in a box of the
    local parameter (``param_start``, ``param_extent``, in the dims of ``param_grid``): the hf box's dim ``d``
    runs along the parameter box's dim ``axes[d]`` (``axes`` empty: the dims of extent > 1 in the same order, as
    an expert's ``[I, H]`` box sits in ``w13_weight`` as ``[1, I, H]``; gpt-oss's ``[E, H, 2I]`` experts land
    transposed in ``[E, 2I, H]``). ``casts``: the dtypes the loader converted the elements to on their way (the
    parameter's last; empty: the bits land as they are). ``owner`` is True on exactly one of the ranks holding
    the same box, so per-rank checksums of owned boxes add up to the checksum of the whole checkpoint tensor.
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
    hf_grid: Shape = ()  # () means ``hf_shape``
    param_grid: Shape = ()  # () means ``param_shape``
    axes: tuple[int, ...] = ()
    casts: tuple[torch.dtype, ...] = ()

    def __post_init__(self) -> None:
        if not self.param_extent:
            object.__setattr__(self, "param_extent", tuple(self.extent))

    @property
    def hgrid(self) -> Shape:
        return self.hf_grid or self.hf_shape

    @property
    def pgrid(self) -> Shape:
        return self.param_grid or self.param_shape

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

    @property
    def identity(self) -> bool:
        """The whole checkpoint tensor is the whole parameter, element for element at the same flat index."""
        return (self.whole and self.hf_shape == self.param_shape and not self.axes and not self.hf_grid
                and not self.param_grid)

    def pairs(self) -> list[tuple[int, int]]:
        """(hf-grid dim, param-grid dim) of each dim of extent > 1 of the box."""
        if self.axes:
            return [(d, self.axes[d]) for d, e in enumerate(self.extent) if e > 1]
        hf = [d for d, e in enumerate(self.extent) if e > 1]
        pa = [d for d, e in enumerate(self.param_extent) if e > 1]
        return list(zip(hf, pa, strict=True))

    def hf_indices(self) -> torch.Tensor:
        """Flat indices (ascending) of the checkpoint-tensor elements this rank holds."""
        return _box_indices(self.hgrid, self.hf_start, self.extent)

    def param_indices(self) -> torch.Tensor:
        """Flat local-parameter indices of the same elements, in the same order as :meth:`hf_indices`."""
        pstr = _strides(self.pgrid)
        idx = torch.full((), sum(s * st for s, st in zip(self.param_start, pstr, strict=True)), dtype=torch.int64)
        along = dict(self.pairs())
        for d, e in enumerate(self.extent):
            step = pstr[along[d]] if d in along else 0
            idx = idx.unsqueeze(-1) + torch.arange(e, dtype=torch.int64) * step
        return idx.reshape(-1)

    def localize(self, positions: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor]:
        """For flat checkpoint ``positions``: (mask of those held on this rank, or None for all of them,
        their flat param indices)."""
        pos = positions.reshape(-1).to(torch.int64)
        hf_run = _run(self.hgrid, self.hf_start, self.extent)
        p_run = _run(self.pgrid, self.param_start, self.param_extent)
        if not self.axes and hf_run is not None and p_run is not None:
            # both boxes are one contiguous run (whole rows of q in qkv_proj, an expert in w13_weight): one shift
            lo, hi = hf_run, hf_run + self.numel
            shift = p_run - lo
            if lo == 0 and hi == self.hf_numel:
                return None, _shifted(pos, shift)
            keep = (pos >= lo) & (pos < hi)
            return keep, pos[keep] + shift
        pstr = _strides(self.pgrid)
        along = dict(self.pairs())
        keep = torch.ones_like(pos, dtype=torch.bool)
        out = torch.full_like(pos, sum(s * st for s, st in zip(self.param_start, pstr, strict=True)))
        for d, (size, st, hs, ext) in enumerate(zip(self.hgrid, _strides(self.hgrid), self.hf_start, self.extent,
                                                    strict=True)):
            coord = (pos // st) % size
            if hs != 0 or ext != size:
                keep &= (coord >= hs) & (coord < hs + ext)
            if d in along:
                out += (coord - hs) * pstr[along[d]]
        return keep, out[keep]

    def hf_box(self) -> tuple[tuple[Dim, ...], Shape, Shape]:
        """The held part of the checkpoint tensor as (grid dims, start, extent), dims of size 1 left out: what
        ranks compare to agree on owners."""
        return _canonical(self.hgrid, self.hf_start, self.extent)

    def param_box(self) -> tuple[tuple[Dim, ...], Shape, Shape]:
        return _canonical(self.pgrid, self.param_start, self.param_extent)


@dataclass(frozen=True, kw_only=True)
class RoutingTable:
    """Routes of every checkpoint tensor on one rank, and which engine parameters are shared (tied).

    ``routes``: {checkpoint tensor: its pieces on this rank}: one :class:`Route` for a tensor the loader copies
    whole or narrowed, several for one it splits (a fused ``qkv_proj`` checkpoint into q, k and v rows, a fused
    ``experts.gate_up_proj`` into every expert), all into one parameter, disjoint; none for a tensor only other
    ranks hold (an expert of another expert-parallel rank), or one that feeds only untraced parameters.
    ``untraced``: {parameter the loader computes with no exact element map: the checkpoint tensors feeding it}
    (its module is re-loaded through vLLM after a write). ``discarded``: {checkpoint tensor the engine's loader
    writes into a parameter the model ties to another one: the checkpoint tensor feeding that one} (its bits
    must equal that tensor's; the engine never holds them).
    """

    routes: Mapping[str, tuple[Route, ...]]
    tied: Mapping[str, str] = field(default_factory=dict)
    tp_rank: int = 0
    tp_size: int = 1
    untraced: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    discarded: Mapping[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        object.__setattr__(self, "routes", MappingProxyType({k: tuple(v) for k, v in self.routes.items()}))
        object.__setattr__(self, "tied", MappingProxyType(dict(self.tied)))
        object.__setattr__(self, "untraced", MappingProxyType({k: tuple(v) for k, v in self.untraced.items()}))
        object.__setattr__(self, "discarded", MappingProxyType(dict(self.discarded)))

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

    def boxes(self) -> dict[str, list[tuple[tuple[Dim, ...], Shape, Shape]]]:
        """{checkpoint tensor: (grid, start, extent) of each piece this rank holds} (what :func:`assign_owners`
        needs from every rank)."""
        return {n: [r.hf_box() for r in pieces] for n, pieces in self.routes.items()}


# {op: (mutates an input, name, returns views of its inputs)}, from the op's schema
_OPS: dict[Any, tuple[bool, str, bool]] = {}
# ops whose result holds the elements of one input as they are (a dtype conversion aside): exact lineage
COPY_OPS = frozenset({"clone", "_to_copy", "contiguous", "lift_fresh_copy", "copy"})


class CopyRecorder(TorchDispatchMode):
    """Records what a weight loader does to parameters while it runs over meta tensors (no data moves).

    ``params``/``sources``: {name: meta tensor} of the parameters (checkpoint format) and of the checkpoint
    tensors handed to the loader. Every tensor the loader derives from a checkpoint tensor carries its
    :class:`~rollout_loader.lineage.Lineage` (views share their base's; a clone, a dtype conversion, a
    ``torch.cat``/``stack`` or a copy into a temporary get their own, exact): each ``copy_`` into a parameter
    becomes :class:`~rollout_loader.lineage.Copy` records (``copies``); a ``fill_``/``zero_`` of a parameter
    view, or a copy of filled values, a fill (padding no checkpoint element feeds); a copy of values computed
    some other way (arithmetic) an untraced feed (``untraced``: {parameter: checkpoint tensors}); any other
    write into a parameter a problem naming it (``problems``). Writes into parameters are recorded, never
    executed; everything else runs (on meta tensors).
    """

    def __init__(self, params: Mapping[str, torch.Tensor], sources: Mapping[str, torch.Tensor]) -> None:
        super().__init__()
        self._params = {_storage(t): (n, tuple(t.shape)) for n, t in params.items()}
        self._sources = {_storage(t): (n, tuple(t.shape)) for n, t in sources.items()}
        self._lineage: dict[int, Lineage] = {}
        self._keep: list[torch.Tensor] = []  # derived tensors stay alive: their storage ids must not be reused
        self.copies: list[Copy] = []
        self.fills: list[tuple[str, View]] = []
        self.problems: dict[str, str] = {}
        self.untraced: dict[str, set[str]] = {}
        self.read: set[str] = set()  # checkpoint tensors whose elements reached a parameter (even 0 of them)

    def lineage(self, t: torch.Tensor, *, keep: bool = False) -> Lineage | None:
        """What ``t``'s storage holds, or None when it holds nothing from a checkpoint tensor. A checkpoint tensor's
        is made when asked for (kept only once the loader changes it: ``keep``), so a trace of a large model holds
        no per-tensor objects."""
        key = _storage(t)
        lin = self._lineage.get(key)
        if lin is None and key in self._sources:
            name, shape = self._sources[key]
            lin = Lineage.of_checkpoint(name, shape)
            if keep:
                self._lineage[key] = lin
        return lin

    def _tracked(self, t: torch.Tensor) -> bool:
        key = _storage(t)
        return key in self._lineage or key in self._sources

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        info = _OPS.get(func)
        if info is None:
            returns = func._schema.returns
            info = _OPS[func] = (func._schema.is_mutable, func.overloadpacket.__name__,
                                 bool(returns) and all(r.alias_info is not None for r in returns))
        mutable, op, view = info
        dst = args[0] if args and isinstance(args[0], torch.Tensor) else None
        if mutable and dst is not None:
            target = self._params.get(_storage(dst))
            if target is not None:
                try:
                    self._into_param(op, func, dst, target, args)
                except Exception as e:  # noqa: BLE001 - a case the recorder does not know: named, never guessed
                    self.problems.setdefault(target[0], f"deltasync could not trace the loader's {op} into it "
                                                        f"({type(e).__name__}: {e})")
                return dst  # never executed: a parameter left live (a bias) must keep its bits
            try:
                self._into_other(op, dst, args)
            except Exception:  # noqa: BLE001 - the tensor it writes holds nothing exact any more
                inputs = self._inputs(args, {})
                if inputs:
                    self._opaque(dst, inputs)
        out = func(*args, **kwargs)
        if not mutable and not view:  # a view shares its base's storage, so its lineage
            try:
                self._derive(op, args, kwargs, out)
            except Exception:  # noqa: BLE001 - its results hold nothing exact
                for o in (out if isinstance(out, (list, tuple)) else (out,)):
                    if isinstance(o, torch.Tensor):
                        self._opaque(o, self._inputs(args, kwargs))
        return out

    def _into_param(self, op: str, func: Any, dst: torch.Tensor, target: tuple[str, Shape], args: tuple) -> None:
        name, base = target
        view = _view(dst, base)
        if op in ("fill_", "zero_"):
            self.fills.append((name, view))
            return
        if op != "copy_":
            inputs = self._inputs(args[1:], {})
            if inputs:
                self.untraced.setdefault(name, set()).update(*(lin.names() for _, lin in inputs))
            self.problems.setdefault(name, f"written by {func} (an in-place computation, not a copy of checkpoint "
                                           "elements)")
            return
        src = args[1]
        key = _storage(src) if isinstance(src, torch.Tensor) else None
        if (key in self._sources and key not in self._lineage and dst.numel() and tuple(src.shape) == tuple(dst.shape)
                and all(st or n == 1 for n, st in zip(src.shape, src.stride(), strict=True))):
            # a view of a checkpoint tensor the loader left as it is (nearly every copy): its strides are the map
            hf_name, hf_shape = self._sources[key]
            self.read.add(hf_name)
            self.copies.append(Copy(
                hf_name=hf_name, hf_shape=hf_shape, param_name=name, param_shape=base,
                hf_offset=int(src.storage_offset()), param_offset=view.offset,
                atoms=tuple((n, a, b) for n, a, b in zip(src.shape, src.stride(), view.stride, strict=True) if n != 1),
                casts=(dst.dtype,) if src.dtype != dst.dtype else ()))
            return
        lin = self.lineage(src) if isinstance(src, torch.Tensor) else None
        if lin is None:
            self.problems.setdefault(name, "copied from a tensor that holds no checkpoint element (the loader made "
                                           "it from something else)")
            return
        if dst.numel() == 0:  # a rank past the vocabulary: reads the tensor, holds none of it
            for n in lin.names():
                self.read.add(n)
                self.copies.append(Copy(hf_name=n, hf_shape=(), param_name=name, param_shape=base, hf_offset=0,
                                        param_offset=0, atoms=((0, 1, 1),)))
            return
        if tuple(src.shape) != tuple(dst.shape):
            self.untraced.setdefault(name, set()).update(lin.names())
            self.problems.setdefault(name, f"the loader broadcasts {list(src.shape)} of {sorted(lin.names())} into "
                                           f"{list(dst.shape)} of it")
            return
        if any(n > 1 and st == 0 for n, st in zip(src.shape, src.stride(), strict=True)):
            self.untraced.setdefault(name, set()).update(lin.names())
            self.problems.setdefault(name, f"the loader broadcasts elements of {sorted(lin.names())[:3]} into it (one "
                                           "checkpoint element into several places)")
            return
        composed = compose(lin, int(src.storage_offset()), tuple(src.shape), tuple(src.stride()))
        placed = None
        if composed is not None and not composed[1]:
            placed = copies_into(name, base, view.offset, view.shape, view.stride, composed[0])
        if placed is None:
            names = lin.names()
            self.untraced.setdefault(name, set()).update(names)
            self.read.update(names)
            self.problems.setdefault(name, f"copied from values the loader computed from {sorted(names)[:3]} with "
                                           "no exact element map (arithmetic, a gather)")
            return
        copies, fills = placed
        cast = dst.dtype if src.dtype != dst.dtype else None
        for c in copies:
            self.read.add(c.hf_name)
            self.copies.append(c if cast is None else replace(c, casts=(*c.casts, cast)))
        for offset, shape, stride in fills:
            self.fills.append((name, View(base=base, offset=offset, shape=shape, stride=stride)))

    def _into_other(self, op: str, dst: torch.Tensor, args: tuple) -> None:
        """An in-place op on a tensor that is no parameter: a copy into a temporary gains parts; a fill marks the
        region constant; anything else on a tensor holding checkpoint elements makes it untraceable."""
        key = _storage(dst)
        lin = self.lineage(dst, keep=True)
        if op == "copy_" and isinstance(args[1], torch.Tensor):
            src_lin = self.lineage(args[1])
            if src_lin is None:
                if lin is not None:
                    lin.make_opaque()
                return
            if lin is None:
                lin = self._lineage[key] = Lineage.flat(_storage_numel(dst))
                self._keep.append(dst)
            composed = compose(src_lin, int(args[1].storage_offset()), tuple(args[1].shape), tuple(args[1].stride()))
            cast = dst.dtype if args[1].dtype != dst.dtype else None
            if (tuple(args[1].shape) != tuple(dst.shape) or composed is None or composed[1]
                    or not add_parts(lin, int(dst.storage_offset()), tuple(dst.shape), tuple(dst.stride()),
                                     composed[0], cast)):
                lin.make_opaque(src_lin.names())
            return
        if lin is None:
            return
        if op in ("fill_", "zero_"):
            if not fill_region(lin, int(dst.storage_offset()), tuple(dst.shape), tuple(dst.stride())):
                lin.make_opaque()
            return
        inputs = self._inputs(args[1:], {})
        lin.make_opaque(frozenset().union(*(x.names() for _, x in inputs)) if inputs else frozenset())

    def _inputs(self, args: Any, kwargs: Mapping[str, Any]) -> list[tuple[torch.Tensor, Lineage]]:
        out = []
        for a in [*args, *kwargs.values()]:
            for t in (a if isinstance(a, (list, tuple)) else (a,)):
                if isinstance(t, torch.Tensor) and self._tracked(t):
                    lin = self.lineage(t)
                    if lin is not None:
                        out.append((t, lin))
        return out

    def _derive(self, op: str, args: tuple, kwargs: Mapping[str, Any], out: Any) -> None:
        """Give each new tensor an op made from checkpoint elements its lineage (views share their base's)."""
        outs = [o for o in (out if isinstance(out, (list, tuple)) else (out,)) if isinstance(o, torch.Tensor)]
        fresh = [o for o in outs if not self._tracked(o)]
        if not fresh:
            return
        inputs = self._inputs(args, kwargs)
        if not inputs:
            return
        if len(fresh) != 1:
            for o in fresh:  # several new outputs (a split that copies): nothing exact known
                self._opaque(o, inputs)
            return
        o = fresh[0]
        pieces: list[tuple[torch.Tensor, Lineage, torch.Tensor]] = []  # (input, its lineage, the region of o it fills)
        first = args[0] if args else None
        if op in COPY_OPS and isinstance(first, torch.Tensor) and tuple(first.shape) == tuple(o.shape):
            src = args[1] if op == "copy" else first
            lin = self.lineage(src) if isinstance(src, torch.Tensor) else None
            if lin is not None and tuple(src.shape) == tuple(o.shape):
                pieces = [(src, lin, o)]
        elif op in ("cat", "concat", "concatenate", "stack") and isinstance(first, (list, tuple)):
            dim = args[1] if len(args) > 1 else kwargs.get("dim", 0)
            dim = dim % o.dim() if o.dim() else 0
            shift = 0
            for t in first:
                if op != "stack" and t.dim() == 1 and t.numel() == 0:
                    continue  # torch.cat skips empty 1-d tensors
                lin = self.lineage(t)
                size = 1 if op == "stack" else int(t.shape[dim])
                region = o.select(dim, shift) if op == "stack" else o.narrow(dim, shift, size)
                if lin is None:
                    pieces = []
                    break
                pieces.append((t, lin, region))
                shift += size
        if not pieces:
            self._opaque(o, inputs)
            return
        lin_out = Lineage.flat(_storage_numel(o))
        for t, lin, region in pieces:
            composed = compose(lin, int(t.storage_offset()), tuple(t.shape), tuple(t.stride()))
            cast = o.dtype if t.dtype != o.dtype else None
            if composed is None or composed[1] or not add_parts(lin_out, int(region.storage_offset()),
                                                                tuple(region.shape), tuple(region.stride()),
                                                                composed[0], cast):
                self._opaque(o, inputs)
                return
        self._lineage[_storage(o)] = lin_out
        self._keep.append(o)

    def _opaque(self, o: torch.Tensor, inputs: list[tuple[torch.Tensor, Lineage]]) -> None:
        self._lineage[_storage(o)] = Lineage(grid=[], opaque=frozenset().union(*(x.names() for _, x in inputs)))
        self._keep.append(o)


def build_routing_table(
    hf_shapes: Mapping[str, Sequence[int]],
    copies: Iterable[Copy],
    param_shapes: Mapping[str, Sequence[int]],
    *,
    fills: Iterable[tuple[str, View]] = (),
    problems: Mapping[str, str] | None = None,
    untraced: Mapping[str, Iterable[str]] | None = None,
    reloadable: Iterable[str] = (),
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
    route}, ``untraced``: {parameter: checkpoint tensors feeding it with no element map} (both from
    :class:`CopyRecorder`); ``reloadable``: parameters whose module can be re-loaded on its own (a problem there
    makes the parameter untraced, not an error); ``refused``: {checkpoint tensor: why the loader refused it};
    ``held_elsewhere``: checkpoint tensors other ranks hold (this rank may hold none of them: expert
    parallelism); ``unfed_ok``: parameters that need no checkpoint tensor (they share storage with a fed one:
    a tied head); ``tied``: {alias parameter: the parameter it shares}; a checkpoint tensor copied into an alias
    is discarded (the model ties it); ``ignore``: checkpoint names left out on purpose (by the caller, for a
    test or a benchmark). Owners are this rank's: see :func:`assign_owners` across ranks.

    Raises RoutingError naming every checkpoint tensor that lands nowhere, in two parameters, twice on the same
    elements, or not as a box, and every parameter with a problem that cannot be re-loaded, written twice, or
    with elements no checkpoint tensor or fill feeds.
    """
    skip, elsewhere, tied = set(ignore), set(held_elsewhere), dict(tied or {})
    reload_ok = set(reloadable)
    issues: list[str] = []
    late: dict[str, set[str]] = {p: set(n) for p, n in (untraced or {}).items()}
    for p, why in sorted((problems or {}).items()):
        if p in reload_ok:
            late.setdefault(p, set())
        else:
            names = sorted(late.get(p, ()))
            issues.append(f"engine parameter {p!r}: {why}; {_no_reload(p, names)}")
    for p in sorted(set(late) - set(problems or {}) - reload_ok):
        issues.append(f"engine parameter {p!r}: fed by {sorted(late[p])[:3]} with no exact element map; "
                      f"{_no_reload(p, sorted(late[p]))}")
    by_hf: dict[str, list[Copy]] = {}
    for c in copies:
        if c.hf_name not in skip:
            by_hf.setdefault(c.hf_name, []).append(c)
    routes: dict[str, tuple[Route, ...]] = {}
    discarded: dict[str, str] = {}
    misfit = set(late) | set(problems or {})  # parameters whose elements have no exact map (or a reported problem)
    for p in list(late):
        late[p] |= {c.hf_name for cs in by_hf.values() for c in cs if c.param_name == p}
    feeding_untraced = {n for names in late.values() for n in names}
    for hf_name, shape in hf_shapes.items():
        if hf_name in skip:
            continue
        got = by_hf.get(hf_name, [])
        if hf_name in (refused or {}):
            issues.append(f"{hf_name!r} {list(shape)}: vLLM's loader for this model raised on a meta stand-in of it "
                          f"({(refused or {})[hf_name]}): routes are learned by running the loader without data, "
                          "and this loader needs the tensor's values; deltasync cannot follow this model")
            continue
        pieces = [_route(c) for c in got if c.numel]
        if not pieces:
            if hf_name in elsewhere or hf_name in feeding_untraced:
                routes[hf_name] = ()
            elif hf_name in tied and tied[hf_name] in param_shapes:
                discarded[hf_name] = tied[hf_name]  # resolved to the checkpoint tensor below
            elif got:
                routes[hf_name] = ()  # this rank's loader copies none of its elements (a rank past the vocabulary)
            else:
                issues.append(f"{hf_name!r}: the engine drops this tensor (vLLM's loader for this model writes none "
                              "of its elements into a parameter: the model does not use it). Leave it out of the "
                              "engine's checkpoint and of the stream (publish a state dict without it)")
            continue
        params = sorted({c.param_name for c in got})
        bad = [p for p in pieces if isinstance(p, str)]
        if not bad and params[0] in tied and len(params) == 1:
            discarded[hf_name] = tied[params[0]]
            misfit.add(params[0])
            continue
        if not bad and len(params) > 1 and set(params) <= misfit:
            bad = []
        elif not bad and len(params) > 1:
            bad = [f"{hf_name!r}: copied into {len(params)} parameters ({params[:3]}); one checkpoint tensor feeds one "
                   "parameter here, and vLLM keeps these as separate copies (deltasync cannot follow this model)"]
        good = [p for p in pieces if not isinstance(p, str)]
        if len(good) > 1:
            good.sort(key=lambda r: r.hf_box()[1:])
        if not bad and len(good) > 1 and any(a.hf_box()[0] == b.hf_box()[0] and _overlap(a.hf_box()[1:], b.hf_box()[1:])
                                             for a, b in itertools.pairwise(good)):
            bad = [f"{hf_name!r}: the same elements are copied into {len(good)} places of {params[0]!r}; replicas of "
                   "one tensor (redundant experts) are not supported"]
        if bad:
            misfit.update(params)
            issues.extend(bad)
        else:
            routes[hf_name] = tuple(good)
    # a tensor the loader writes into a tied alias is discarded when the tensor feeding the shared parameter holds
    # the same elements in the same places (the engine holds one of the two; their bits must be equal)
    fed_by = {r.param_name: name for name, pieces in routes.items() for r in pieces}
    for hf_name, target in sorted(discarded.items()):
        src = fed_by.get(target)
        if src is None or list(hf_shapes[src]) != list(hf_shapes[hf_name]):
            issues.append(f"{hf_name!r}: the engine ties the parameter it feeds to {target!r}, and no checkpoint "
                          f"tensor of the same shape feeds that one ({src!r}): the engine's checkpoint and its "
                          "model disagree")
            discarded.pop(hf_name)
            continue
        mine = sorted((r.hf_box() for r in (_route(c) for c in by_hf.get(hf_name, ()) if c.numel)
                       if not isinstance(r, str)), key=lambda b: (b[1], b[2]))
        theirs = sorted((r.hf_box() for r in routes[src]), key=lambda b: (b[1], b[2]))
        if mine and mine != theirs:
            issues.append(f"{hf_name!r}: the engine ties the parameter it feeds to {target!r}, fed by {src!r} with "
                          "other elements: the two cannot be one tensor")
            discarded.pop(hf_name)
            continue
        discarded[hf_name] = src
    flat = [r for pieces in routes.values() for r in pieces]
    issues += _coverage(flat, param_shapes, fills, set(unfed_ok) | misfit)
    if issues:
        raise RoutingError(f"cannot route {len(issues)} tensor(s):\n  " + "\n  ".join(issues))
    return RoutingTable(routes=routes, tied=tied, tp_rank=tp_rank, tp_size=tp_size,
                        untraced={p: tuple(sorted(n)) for p, n in late.items()}, discarded=discarded)


def _no_reload(param: str, names: Sequence[str]) -> str:
    return ("vLLM keeps no checkpoint-format record of this parameter, so its module cannot be re-loaded alone "
            f"from host copies{' of ' + str(list(names[:3])) if names else ''}: deltasync cannot follow this model")


def assign_owners(table: RoutingTable,
                  boxes_by_rank: Sequence[Mapping[str, Sequence[tuple[Any, ...]]]]) -> RoutingTable:
    """``table`` with each route's owner set: the lowest rank holding the same box of the checkpoint tensor
    (replicated norms and routers, kv heads shared by ranks). ``boxes_by_rank``: every rank's
    :meth:`RoutingTable.boxes`, in rank order. Ranks' boxes must be equal or disjoint."""
    out: dict[str, tuple[Route, ...]] = {}
    for name, pieces in table.routes.items():
        owned = []
        for r in pieces:
            mine = r.hf_box()
            owner = True
            for rank, boxes in enumerate(boxes_by_rank[: table.tp_rank]):
                for other in boxes.get(name, ()):
                    other = _as_box(other, r.hf_shape)
                    same, meet = _compare(mine, other)
                    if same and r.numel:
                        owner = False
                    elif meet:
                        raise RoutingError(f"{name!r}: ranks {rank} and {table.tp_rank} hold overlapping, unequal "
                                           f"parts {other[1:]} and {mine[1:]}: no rank can own them")
            owned.append(replace(r, owner=owner))
        out[name] = tuple(owned)
    return RoutingTable(routes=out, tied=table.tied, tp_rank=table.tp_rank, tp_size=table.tp_size,
                        untraced=table.untraced, discarded=table.discarded)


def _as_box(box: tuple[Any, ...], shape: Shape) -> tuple[tuple[Dim, ...], Shape, Shape]:
    """A box as :meth:`Route.hf_box` gives it; a bare (start, extent) in ``shape``'s dims is converted."""
    if len(box) == 3:
        return tuple(tuple(d) for d in box[0]), tuple(box[1]), tuple(box[2])
    return _canonical(shape, tuple(box[0]), tuple(box[1]))


def _compare(a: tuple[tuple[Dim, ...], Shape, Shape], b: tuple[tuple[Dim, ...], Shape, Shape]) -> tuple[bool, bool]:
    """(equal, overlapping) of two boxes, brought into one grid; unknown (no common grid): (False, True)."""
    common = _common_grid([a[0], b[0]])
    if common is None:
        return False, True
    a2, b2 = _regrid(a, common), _regrid(b, common)
    if a2 is None or b2 is None:
        return False, True
    return a2 == b2, _overlap(a2, b2)


def _route(c: Copy) -> Route | str:
    """The route of one recorded copy, or why it has none."""
    where = f"{c.hf_name!r} -> {c.param_name!r}"
    atoms = _merged([a for a in c.atoms if a[0] != 1])
    if any(a == 0 or b == 0 for _, a, b in atoms):
        return f"{where}: the loader copies one checkpoint element into several places (a broadcast): no exact route"
    key = (c.hf_shape, c.param_shape, tuple(atoms))
    plan = _PLANS.get(key)  # copies of one structure (every expert of a layer) share grids and the atoms' split
    if plan is not None:
        hg, pg, split = plan
        dh = decompose(hg, c.hf_offset, [n for n, _, _ in split], [a for _, a, _ in split])
        dp = decompose(pg, c.param_offset, [n for n, _, _ in split], [b for _, _, b in split])
        if dh is not None and dp is not None and all(len(x) == 1 for x in (*dh[1], *dp[1])):
            return _route_from(c, hg, pg, dh, dp)
    found = _plan(c, where, atoms)
    if isinstance(found, str):
        return found
    hg, pg, split, dh, dp = found
    if len(_PLANS) > 4096:
        _PLANS.clear()
    _PLANS[key] = (hg, pg, split)
    return _route_from(c, hg, pg, dh, dp)


_PLANS: dict[tuple[Any, ...], tuple[list[Dim], list[Dim], list[tuple[int, int, int]]]] = {}


def _plan(c: Copy, where: str, atoms: list[tuple[int, int, int]]) -> Any:
    """Grids of both tensors fine enough that each index of the copy runs along one dim of each, and the copy's
    indices split to match: (hf grid, param grid, indices, hf pieces, param pieces), or why there are none."""
    hg, pg = contiguous_grid(c.hf_shape), contiguous_grid(c.param_shape)
    for _ in range(16):
        for _, a, b in atoms:
            hg2, pg2 = refine(hg, a), refine(pg, b)
            if hg2 is None or pg2 is None:
                side = "checkpoint tensor" if hg2 is None else "parameter"
                return f"{where}: the loader's copy is no box of the {side}"
            hg, pg = hg2, pg2
        dh = decompose(hg, c.hf_offset, [n for n, _, _ in atoms], [a for _, a, _ in atoms])
        dp = decompose(pg, c.param_offset, [n for n, _, _ in atoms], [b for _, _, b in atoms])
        if dh is None or dp is None:
            return (f"{where}: the loader's copy is no box of the {'checkpoint tensor' if dh is None else 'parameter'} "
                    "(it overlaps itself or wraps around a dim)")
        split, changed = [], False
        for (n, a, b), hp, pp in zip(atoms, dh[1], dp[1], strict=True):
            hs, ps = [e for _, e in hp], [e for _, e in pp]
            if hs == ps and len(hs) == 1:
                split.append((n, a, b))
                continue
            changed, prev = True, 1
            for cut in sorted(set(itertools.accumulate(hs, lambda x, y: x * y))
                              | set(itertools.accumulate(ps, lambda x, y: x * y))):
                if cut % prev:
                    return f"{where}: the checkpoint box and the parameter box do not line up"
                split.append((cut // prev, a * prev, b * prev))
                prev = cut
        atoms = split
        if not changed:
            return hg, pg, atoms, dh, dp
    return f"{where}: the checkpoint box and the parameter box do not line up"


def _route_from(c: Copy, hg: list[Dim], pg: list[Dim], dh: Any, dp: Any) -> Route:
    hext, pext, pairs = [1] * len(hg), [1] * len(pg), []
    for ((i, e),), ((j, _),) in zip(dh[1], dp[1], strict=True):
        hext[i], pext[j] = e, e
        pairs.append((i, j))
    hf_start, extent, hf_grid, hmap = _in_shape(c.hf_shape, hg, dh[0], hext)
    param_start, param_extent, param_grid, pmap = _in_shape(c.param_shape, pg, dp[0], pext)
    axes = [-1] * len(extent)
    for i, j in pairs:
        axes[hmap[i]] = pmap[j]
    big = [axes[d] for d, e in enumerate(extent) if e > 1]
    return Route(hf_name=c.hf_name, hf_shape=c.hf_shape, param_name=c.param_name, param_shape=c.param_shape,
                 hf_start=hf_start, param_start=param_start, extent=extent, param_extent=param_extent,
                 hf_grid=hf_grid, param_grid=param_grid, axes=() if big == sorted(big) else tuple(axes),
                 casts=tuple(c.casts))


def _merged(atoms: list[tuple[int, int, int]]) -> list[tuple[int, int, int]]:
    """Adjacent indices contiguous on both sides as one (a row of a row-major box)."""
    atoms = sorted(atoms, key=lambda x: -x[1])
    out: list[tuple[int, int, int]] = []
    for n, a, b in reversed(atoms):  # least significant first
        if out and a == out[-1][1] * out[-1][0] and b == out[-1][2] * out[-1][0]:
            m, a0, b0 = out.pop()
            out.append((n * m, a0, b0))
        else:
            out.append((n, a, b))
    return out


def _in_shape(shape: Shape, grid: list[Dim], start: list[int], extent: list[int]
              ) -> tuple[Shape, Shape, Shape, dict[int, int]]:
    """A box of ``grid`` in the tensor's own dims when the grid is the shape's (dims of size 1 kept), else in the
    grid's: (start, extent, grid or () for the shape's, {grid dim: dim})."""
    own, dims = _dims_of(tuple(shape), tuple(grid))
    if own:
        s, e = [0] * len(shape), [1] * len(shape)
        for k, d in dims.items():
            s[d], e[d] = start[k], extent[k]
        return tuple(s), tuple(e), (), dims
    return tuple(start), tuple(extent), tuple(size for size, _ in grid), dims


@functools.lru_cache(maxsize=4096)
def _dims_of(shape: Shape, grid: tuple[Dim, ...]) -> tuple[bool, dict[int, int]]:
    """(whether ``grid`` is ``shape``'s own, {grid dim: the dim of the box it is counted in})."""
    if list(grid) == contiguous_grid(shape):
        return True, {k: d for k, d in enumerate(d for d, s in enumerate(shape) if s != 1)}
    return False, {k: k for k in range(len(grid))}


def _canonical(grid: Shape, start: Shape, extent: Shape) -> tuple[tuple[Dim, ...], Shape, Shape]:
    """A box of a tensor laid out as ``grid`` (row-major), its dims of size 1 left out."""
    keep = [d for d, s in enumerate(grid) if s != 1]
    strides = _strides(grid)
    return (tuple((grid[d], strides[d]) for d in keep), tuple(start[d] for d in keep), tuple(extent[d] for d in keep))


def _common_grid(grids: Sequence[tuple[Dim, ...]]) -> list[Dim] | None:
    """The coarsest grid refining every one of ``grids`` (all of one tensor), or None."""
    out: list[Dim] | None = list(grids[0])
    for g in grids[1:]:
        for _, st in g:
            out = refine(out, st) if out is not None else None
    for g in grids:
        for _, st in (out or []):
            if out is not None and refine(list(g), st) is None:
                return None
    return out


def _regrid(box: tuple[tuple[Dim, ...], Shape, Shape], fine: list[Dim]) -> Box | None:
    """``box`` (grid, start, extent) in the finer grid ``fine``, or None when it is no box of it."""
    grid, start, extent = list(box[0]), list(box[1]), list(box[2])
    for _, st in fine:
        i = next((k for k, (size, s) in enumerate(grid) if s < st < s * size), None)
        if i is None:
            continue
        size, s = grid[i]
        r = st // s
        split = split_range(start[i], extent[i], size, r)
        if split is None:
            return None
        grid[i:i + 1] = [(size // r, st), (r, s)]
        start[i:i + 1] = [split[0][0], split[1][0]]
        extent[i:i + 1] = [split[0][1], split[1][1]]
    return tuple(start), tuple(extent)


def _coverage(routes: Iterable[Route], param_shapes: Mapping[str, Sequence[int]],
              fills: Iterable[tuple[str, View]], exempt: set[str]) -> list[str]:
    """Every element of every parameter fed exactly once (by a route or a fill), or what is wrong."""
    by_param: dict[str, list[tuple[tuple[Dim, ...], Shape, Shape]]] = {}
    whole: set[str] = set()  # parameters one route fills exactly (most of them): nothing to check
    for r in routes:
        if r.param_name not in by_param and r.numel == math.prod(r.param_shape):
            whole.add(r.param_name)
        else:
            whole.discard(r.param_name)
        by_param.setdefault(r.param_name, []).append(r.param_box())
    filled: dict[str, list[tuple[tuple[Dim, ...], Shape, Shape]]] = {}
    for name, view in fills:
        gb = view.grid_box()
        if gb is not None:
            filled.setdefault(name, []).append(_canonical(tuple(s for s, _ in gb[0]), tuple(gb[1]), tuple(gb[2])))
    issues = []
    for name, shape in param_shapes.items():
        if name in exempt:
            continue
        boxes = by_param.get(name, [])
        if name in whole and len(boxes) == 1:
            continue
        numel = math.prod(shape)
        if not boxes and not filled.get(name):
            issues.append(f"engine parameter {name!r} is fed by no checkpoint tensor")
            continue
        grids = [b[0] for b in boxes] + [b[0] for b in filled.get(name, [])]
        common = _common_grid(grids) if len(set(grids)) > 1 else list(grids[0])
        fed = [_regrid(b, common) for b in boxes] if common is not None else [None]
        pads = [_regrid(b, common) for b in filled.get(name, [])] if common is not None else []
        if any(b is None for b in fed) or any(b is None for b in pads):
            issues.append(f"engine parameter {name!r}: its pieces are boxes of different, incompatible grids (the "
                          "loader reshapes it in ways that do not nest): no exact route")
            continue
        fed_boxes = sorted(b for b in fed if b is not None)
        for a, b in itertools.pairwise(fed_boxes):
            if _overlap(a, b):
                issues.append(f"engine parameter {name!r}: boxes {a} and {b} are written by two checkpoint tensors")
        n = sum(math.prod(e) for _, e in fed_boxes)
        if n > numel:
            issues.append(f"engine parameter {name!r}: {n} elements written into its {numel}")
        pad = _union_numel([b for b in pads if b is not None], fed_boxes)
        if not fed_boxes and pad < numel:
            issues.append(f"engine parameter {name!r} is fed by no checkpoint tensor")
        elif n + pad < numel:
            issues.append(f"engine parameter {name!r}: {numel - n - pad} of its {numel} elements "
                          "are fed by no checkpoint tensor")
    return issues


def _union_numel(fills: list[Box], fed: list[Box]) -> int:
    """Elements of the fill boxes that no fed box covers (padding rows next to routed ones)."""
    total = 0
    for box in set(fills):
        total += math.prod(box[1]) - sum(_intersection(box, f) for f in fed)
    return total


def _overlap(a: Box, b: Box) -> bool:
    return _intersection(a, b) > 0


def _intersection(a: Box, b: Box) -> int:
    n = 1
    for s1, e1, s2, e2 in zip(a[0], a[1], b[0], b[1], strict=True):
        n *= max(0, min(s1 + e1, s2 + e2) - max(s1, s2))
    return n


def _shifted(pos: torch.Tensor, shift: int) -> torch.Tensor:
    """``pos + shift`` (``pos`` itself for no shift). On CPU with NumPy on the calling thread: torch's add splits
    across its OpenMP threads, which the engine's staging pool threads (one per core) then contend for."""
    if not shift:
        return pos
    if pos.device.type != "cpu":
        return pos + shift
    return torch.from_numpy(np.add(pos.numpy(), shift))


def _run(shape: Sequence[int], start: Sequence[int], extent: Sequence[int]) -> int | None:
    """The flat start of a box that is one contiguous run of its tensor, else None."""
    big = [d for d, e in enumerate(extent) if e != 1]
    if big and any(extent[d] != shape[d] for d in range(big[0] + 1, len(shape))):
        return None
    return sum(s * st for s, st in zip(start, _strides(shape), strict=True))


def _storage(t: torch.Tensor) -> int:
    return t.untyped_storage()._cdata


def _storage_numel(t: torch.Tensor) -> int:
    return t.untyped_storage().nbytes() // t.element_size()


def _view(t: torch.Tensor, base: Shape) -> View:
    return View(base=base, offset=int(t.storage_offset()), shape=tuple(t.shape), stride=tuple(t.stride()))


@functools.lru_cache(maxsize=4096)
def _strides_cached(shape: Shape) -> tuple[int, ...]:
    out, acc = [0] * len(shape), 1
    for d in range(len(shape) - 1, -1, -1):
        out[d] = acc
        acc *= shape[d]
    return tuple(out)


def _strides(shape: Sequence[int]) -> list[int]:
    return list(_strides_cached(tuple(shape)))


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
    hd, pd = route.pairs()[0]
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
