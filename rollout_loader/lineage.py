"""Where each element of a tensor a weight loader computes came from, through exact, invertible transformations.

A loader rarely copies a checkpoint tensor into a parameter as it is: it narrows it (a tensor-parallel slice),
permutes and makes it contiguous (gpt-oss's experts), concatenates pieces (a temporary ``torch.cat``), widens its
dtype (Qwen3-Next's fp32 ``A_log``). Every one of these moves elements without changing them (the dtype
conversion changes their representation the same way for every element), so where each element lands is still
an exact index map. This module computes that map while the loader runs over meta tensors, with no data and
nothing allocated per element: every tensor the loader derives from a checkpoint tensor carries a
:class:`Lineage` (which checkpoint elements each region of its storage holds), views compose with it
(:func:`compose`), and a copy into a parameter becomes a list of :class:`Copy` records, each an affine map of a
mixed-radix index (``atoms``) to a checkpoint index and a parameter index. Anything else (arithmetic, a gather)
leaves only the names of the checkpoint tensors involved: an untraceable feed (the caller shadows that module).

The index algebra: a *grid* is a dense layout of a storage, its dims ``(size, stride)`` most significant first
(``stride[i] == stride[i+1] * size[i+1]``, the last stride 1). A strided view of the storage is decomposed into
*pieces* of grid dims (a view dim may span several grid dims: full lower ones and a partial top one); the grid is
refined (a dim split in two) where a view's stride falls inside a dim (a step, a reshape). Importing this module
imports torch only.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

Shape = tuple[int, ...]
Dim = tuple[int, int]  # (size, stride) of a grid dim
Atom = tuple[int, int, int]  # (size, checkpoint stride, parameter stride) of one index of a copy


@dataclass(frozen=True, kw_only=True)
class Copy:
    """One exact ``copy_`` into a parameter: for every index ``j`` of the mixed radix ``atoms`` (sizes ``n_k``),
    checkpoint element ``hf_offset + sum(j_k * a_k)`` of ``hf_name`` lands on parameter element
    ``param_offset + sum(j_k * b_k)`` (flat, row-major indices), converted through ``casts`` on its way (the dtypes
    the loader converted it to, the parameter's last; empty when the bits land as they are)."""

    hf_name: str
    hf_shape: Shape
    param_name: str
    param_shape: Shape
    hf_offset: int
    param_offset: int
    atoms: tuple[Atom, ...]
    casts: tuple[torch.dtype, ...] = ()

    @property
    def numel(self) -> int:
        return math.prod(n for n, _, _ in self.atoms)


@dataclass
class Part:
    """A box of a storage's grid whose elements came from one checkpoint tensor (``hf_name``; None: a constant
    the loader filled): the box's first element is checkpoint element ``hf_offset``, a step along grid dim ``i``
    moves ``hf_strides[i]`` checkpoint elements; ``casts``: the dtypes the elements were converted to on the way."""

    hf_name: str | None
    hf_shape: Shape
    start: list[int]
    extent: list[int]
    hf_offset: int
    hf_strides: list[int]
    casts: tuple[torch.dtype, ...] = ()


@dataclass
class Lineage:
    """What one storage holds: a dense grid and the parts of it that came from checkpoint tensors, or, once a
    loader computed something no index map describes, only the names of the checkpoint tensors involved
    (``opaque``)."""

    grid: list[Dim]
    parts: list[Part] = field(default_factory=list)
    opaque: frozenset[str] | None = None

    @classmethod
    def of_checkpoint(cls, name: str, shape: Shape) -> Lineage:
        grid = contiguous_grid(shape)
        return cls(grid=grid, parts=[Part(hf_name=name, hf_shape=tuple(shape), start=[0] * len(grid),
                                          extent=[s for s, _ in grid], hf_offset=0, hf_strides=[st for _, st in grid])])

    @classmethod
    def flat(cls, numel: int) -> Lineage:
        """An untracked storage of ``numel`` elements (a temporary the loader fills by copies)."""
        return cls(grid=contiguous_grid((numel,)))

    def names(self) -> frozenset[str]:
        if self.opaque is not None:
            return self.opaque
        return frozenset(p.hf_name for p in self.parts if p.hf_name is not None)

    def make_opaque(self, more: frozenset[str] = frozenset()) -> None:
        self.opaque = self.names() | more
        self.parts = []

    def refine(self, stride: int) -> bool:
        """Split the grid dim ``stride`` falls inside so that it is a dim's stride; False when it cannot be (it is
        no multiple of the dim's stride, or a part's box would not stay a box)."""
        at = _split_point(self.grid, stride)
        if at is None:
            return False
        if at[1] == 1:
            return True
        i, r = at
        size, st = self.grid[i]
        new_parts = []
        for p in self.parts:
            split = split_range(p.start[i], p.extent[i], size, r)
            if split is None:
                return False
            new_parts.append((p, *split, p.hf_strides[i]))
        self.grid[i:i + 1] = [(size // r, st * r), (r, st)]
        for p, upper, lower, h in new_parts:
            p.start[i:i + 1] = [upper[0], lower[0]]
            p.extent[i:i + 1] = [upper[1], lower[1]]
            p.hf_strides[i:i + 1] = [h * r, h]
        return True


@dataclass(frozen=True)
class Map:
    """A box of a view's index space (``start``/``extent`` per view dim) and where its elements came from: the box's
    first element is checkpoint element ``hf_offset``; view dim ``m`` decomposes into ``digits[m]`` (least
    significant first, ``(size, checkpoint stride)``). ``hf_name`` None: a constant the loader filled."""

    hf_name: str | None
    hf_shape: Shape
    start: tuple[int, ...]
    extent: tuple[int, ...]
    hf_offset: int
    digits: tuple[tuple[tuple[int, int], ...], ...]
    casts: tuple[torch.dtype, ...] = ()


def contiguous_grid(shape: Sequence[int]) -> list[Dim]:
    """The grid of a contiguous tensor of ``shape`` (dims of size 1 left out)."""
    return list(_contiguous_grid(tuple(int(s) for s in shape)))


@functools.lru_cache(maxsize=4096)
def _contiguous_grid(shape: Shape) -> tuple[Dim, ...]:
    out, acc = [], 1
    for size in reversed(shape):
        if size != 1:
            out.append((size, acc))
        acc *= size
    return tuple(out[::-1])


def split_range(start: int, extent: int, size: int, r: int) -> tuple[tuple[int, int], tuple[int, int]] | None:
    """A range ``[start, start + extent)`` of a dim of ``size`` split into (upper, lower) dims of ``size // r`` and
    ``r``: ((start, extent) of the upper, of the lower), or None when it is no box of the two."""
    if extent == size:
        return (0, size // r), (0, r)
    if start % r == 0 and extent % r == 0:
        return (start // r, extent // r), (0, r)
    if start // r == (start + extent - 1) // r:
        return (start // r, 1), (start % r, extent)
    return None


def _split_point(grid: list[Dim], stride: int) -> tuple[int, int] | None:
    """(dim, factor) to split so that ``stride`` is a dim's stride (factor 1: it already is), or None."""
    for i, (_, st) in enumerate(grid):
        if st == stride:
            return i, 1
    for i, (size, st) in enumerate(grid):
        if st < stride < st * size:
            r, rem = divmod(stride, st)
            if rem or size % r:
                return None
            return i, r
    return None


def refine(grid: list[Dim], stride: int) -> list[Dim] | None:
    """``grid`` with a dim of ``stride`` (a dim split in two where needed), or None when it cannot have one."""
    at = _split_point(grid, stride)
    if at is None:
        return None
    i, r = at
    if r == 1:
        return grid
    size, st = grid[i]
    return [*grid[:i], (size // r, st * r), (r, st), *grid[i + 1:]]


def locate(grid: Sequence[Dim], offset: int) -> list[int] | None:
    """Coordinates of flat element ``offset`` in ``grid`` (None when it lies outside)."""
    coords, rest = [], offset
    for size, st in grid:
        c, rest = divmod(rest, st)
        if not 0 <= c < size:
            return None
        coords.append(c)
    return coords if rest == 0 else None


Pieces = list[list[tuple[int, int]]]  # per view dim: (grid dim, extent), least significant first


def decompose(grid: list[Dim], offset: int, shape: Sequence[int], strides: Sequence[int]
              ) -> tuple[list[int], Pieces] | None:
    """A strided view of a storage with dense ``grid`` as pieces of grid dims: (coordinates of its first element,
    per view dim the grid dims it runs along), or None when it is no box of the grid (a broadcast, an overlap,
    a run that wraps). ``grid`` must already have every view stride as a dim's stride (:func:`refine`)."""
    coords = locate(grid, offset)
    if coords is None:
        return None
    index = {st: i for i, (_, st) in enumerate(grid)}
    used: set[int] = set()
    pieces: Pieces = []
    for n, t in zip(shape, strides, strict=True):
        if n == 0:
            return None
        if n == 1:
            pieces.append([])
            continue
        i = index.get(t)
        if i is None:
            return None
        left, mine = n, []
        while True:
            size = grid[i][0]
            if i in used:
                return None
            used.add(i)
            if coords[i] + left <= size:
                mine.append((i, left))
                break
            if coords[i] != 0 or left % size or i == 0:
                return None
            mine.append((i, size))
            left //= size
            i -= 1
        pieces.append(mine)
    return coords, pieces


def refine_lineage_for(lin: Lineage, shape: Sequence[int], strides: Sequence[int]) -> bool:
    """Refine ``lin``'s grid so that every stride of a view of it is a dim's stride."""
    return all(n <= 1 or (t > 0 and lin.refine(t)) for n, t in zip(shape, strides, strict=True))


def compose(lin: Lineage, offset: int, shape: Sequence[int], strides: Sequence[int]) -> tuple[list[Map], int] | None:
    """Where the elements of a view of a storage with lineage ``lin`` came from: one :class:`Map` per part the view
    meets, and how many of its elements no part covers. None when the view is no box of the storage's grid, or
    meets a part in something that is no box of the view (the caller treats it as untraceable)."""
    if lin.opaque is not None or not refine_lineage_for(lin, shape, strides):
        return None
    dec = decompose(lin.grid, offset, shape, strides)
    if dec is None:
        return None
    coords, pieces = dec
    where: dict[int, tuple[int, int, bool]] = {}  # grid dim -> (view dim, extent, top piece of that view dim)
    for m, ps in enumerate(pieces):
        for k, (i, e) in enumerate(ps):
            where[i] = (m, e, k == len(ps) - 1)
    maps: list[Map] = []
    covered = 0
    for part in lin.parts:
        lo_hi: list[tuple[int, int]] = []
        for i in range(len(lin.grid)):
            vlo = coords[i]
            vhi = vlo + (where[i][1] if i in where else 1)
            lo, hi = max(vlo, part.start[i]), min(vhi, part.start[i] + part.extent[i])
            if lo >= hi:
                break
            if i in where and not where[i][2] and (lo, hi) != (vlo, vhi):
                return None  # a lower piece met partly: not a box of the view
            lo_hi.append((lo, hi))
        else:
            start: list[int] = []
            extent: list[int] = []
            digits: list[tuple[tuple[int, int], ...]] = []
            for ps in pieces:
                if not ps:
                    start.append(0)
                    extent.append(1)
                    digits.append(())
                    continue
                lower = math.prod(e for _, e in ps[:-1])
                top = ps[-1][0]
                lo, hi = lo_hi[top]
                start.append((lo - coords[top]) * lower)
                extent.append((hi - lo) * lower)
                digits.append(tuple((e, part.hf_strides[i]) for i, e in ps[:-1]) + ((hi - lo, part.hf_strides[top]),))
            hf_offset = part.hf_offset + sum((lo - s) * h for (lo, _), s, h in
                                             zip(lo_hi, part.start, part.hf_strides, strict=True))
            maps.append(Map(hf_name=part.hf_name, hf_shape=part.hf_shape, start=tuple(start), extent=tuple(extent),
                            hf_offset=hf_offset, digits=tuple(digits), casts=part.casts))
            covered += math.prod(extent)
    return maps, math.prod(shape) - covered


def _split_digits(digits: Sequence[tuple[int, int]], pieces: Sequence[tuple[int, int]]
                  ) -> list[tuple[int, int, int]] | None:
    """Pair a view dim's checkpoint digits with its pieces of another grid (both least significant first):
    ``(size, checkpoint stride, grid dim)`` per piece, or None when they do not nest."""
    out, k = [], 0
    for size, h in digits:
        acc = 1
        while acc < size:
            if k == len(pieces):
                return None
            i, e = pieces[k]
            k += 1
            out.append((e, h * acc, i))
            acc *= e
        if acc != size:
            return None
    return out if k == len(pieces) else None


def place(grid: list[Dim], offset: int, shape: Sequence[int], strides: Sequence[int], m: Map
          ) -> tuple[list[Dim], list[tuple[int, int, int]], int] | None:
    """Map ``m`` of a source view copied into a destination view (``offset``/``shape``/``strides`` over a storage
    with dense ``grid``, the same shape as the source view): the refined grid, one ``(size, checkpoint stride,
    destination grid dim)`` per index of the copy, and the destination's flat offset of the box's first element.
    None when the destination box is no box of the grid (or the source digits do not nest with it)."""
    sub_off = offset + sum(s * t for s, t in zip(m.start, strides, strict=True))
    for (size_, t), digs in zip(zip(m.extent, strides, strict=True), m.digits, strict=True):
        if size_ <= 1:
            continue
        acc = 1
        for size, _ in digs:
            g = refine(grid, t * acc)
            if g is None:
                return None
            grid = g
            acc *= size
    dec = decompose(grid, sub_off, m.extent, strides)
    if dec is None:
        return None
    _, pieces = dec
    atoms: list[tuple[int, int, int]] = []
    for digs, ps in zip(m.digits, pieces, strict=True):
        split = _split_digits([d for d in digs if d[0] > 1], ps)
        if split is None:
            return None
        atoms.extend(split)
    return grid, atoms, sub_off


def copies_into(param: str, param_shape: Shape, offset: int, shape: Sequence[int], strides: Sequence[int],
                maps: Sequence[Map]) -> tuple[list[Copy], list[tuple[int, Shape, Shape]]] | None:
    """The :class:`Copy` records of a copy of ``maps`` into a view of parameter ``param`` (contiguous, of
    ``param_shape``), and the fills among them (as ``(offset, shape, strides)`` of the parameter's flat storage).
    None when the parameter view is no box of the parameter."""
    copies: list[Copy] = []
    fills: list[tuple[int, Shape, Shape]] = []
    for m in maps:
        if m.hf_name is None:
            sub_off = offset + sum(s * t for s, t in zip(m.start, strides, strict=True))
            fills.append((sub_off, tuple(m.extent), tuple(strides)))
            continue
        placed = place(contiguous_grid(param_shape), offset, shape, strides, m)
        if placed is None:
            return None
        grid, atoms, sub_off = placed
        copies.append(Copy(hf_name=m.hf_name, hf_shape=m.hf_shape, param_name=param, param_shape=param_shape,
                           hf_offset=m.hf_offset, param_offset=sub_off,
                           atoms=tuple((n, h, grid[i][1]) for n, h, i in atoms), casts=m.casts))
    return copies, fills


def add_parts(lin: Lineage, offset: int, shape: Sequence[int], strides: Sequence[int], maps: Sequence[Map],
              cast: torch.dtype | None) -> bool:
    """Record in ``lin`` that a view of its storage now holds ``maps`` (a copy, a clone, a piece of a cat);
    ``cast``: the dtype they were converted to on the way (None: none). False when no index map describes it."""
    for m in maps:
        sub_off = offset + sum(s * t for s, t in zip(m.start, strides, strict=True))
        for (size_, t), digs in zip(zip(m.extent, strides, strict=True), m.digits, strict=True):
            acc = 1
            for size, _ in digs if size_ > 1 else ():
                if not lin.refine(t * acc):
                    return False
                acc *= size
        dec = decompose(lin.grid, sub_off, m.extent, strides)
        if dec is None:
            return False
        coords, pieces = dec
        start, extent = list(coords), [1] * len(lin.grid)
        hf_strides = [0] * len(lin.grid)
        for digs, ps in zip(m.digits, pieces, strict=True):
            split = _split_digits([d for d in digs if d[0] > 1], ps)
            if split is None:
                return False
            for n, h, i in split:
                extent[i], hf_strides[i] = n, h
        new = Part(hf_name=m.hf_name, hf_shape=m.hf_shape, start=start, extent=extent, hf_offset=m.hf_offset,
                   hf_strides=hf_strides, casts=m.casts + ((cast,) if cast is not None and m.hf_name else ()))
        if any(_boxes_meet(p, new) for p in lin.parts):
            return False  # written twice: keep it simple, call it untraceable
        lin.parts.append(new)
    return True


def fill_region(lin: Lineage, offset: int, shape: Sequence[int], strides: Sequence[int]) -> bool:
    """Record that a view of the storage now holds a constant (``fill_``/``zero_``): parts it covers are gone.
    False when no box describes it (the caller makes the lineage opaque)."""
    if lin.opaque is not None:
        return True
    if math.prod(shape) == 0:
        return True
    if not refine_lineage_for(lin, shape, strides):
        return False
    dec = decompose(lin.grid, offset, shape, strides)
    if dec is None:
        return False
    coords, pieces = dec
    extent = [1] * len(lin.grid)
    for ps in pieces:
        for i, e in ps:
            extent[i] = e
    region = Part(hf_name=None, hf_shape=(), start=list(coords), extent=extent, hf_offset=0,
                  hf_strides=[0] * len(lin.grid))
    kept = []
    for p in lin.parts:
        if not _boxes_meet(p, region):
            kept.append(p)
        elif not all(rs <= ps and ps + pe <= rs + re
                     for ps, pe, rs, re in zip(p.start, p.extent, region.start, region.extent, strict=True)):
            return False  # a part partly overwritten: keep it simple, call it untraceable
    lin.parts = [*kept, region]
    return True


def _boxes_meet(a: Part, b: Part) -> bool:
    return all(max(s1, s2) < min(s1 + e1, s2 + e2) for s1, e1, s2, e2 in zip(a.start, a.extent, b.start, b.extent,
                                                                             strict=True))
