"""Multi-part steps (docs/FORMAT.md section 5b): the parts of one step, read as one object.

A sharded trainer writes one part per rank; each part holds element ranges of tensors, with positions
and checksums of its ranges only. ``PartedObject`` checks the parts against their manifest and against
each other (same step, kind and base; ranges that tile every tensor exactly; the sum of their checksums
gives the state checksum the manifest commits to) and then offers what ``StepObject`` offers: a combined
header, whole tensors of an anchor, whole-tensor patches of a delta. So every consumer reads a multi-part
step as it reads a single object.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import replace

import numpy as np
import torch

from deltasync.errors import ChecksumMismatchError, FormatError
from deltasync.format.checksum import MASK64, format_checksum, state_checksum
from deltasync.format.codecs import DecodeScratch
from deltasync.format.documents import Manifest, Part, PositionCodec, StepHeader, TensorHeader, ValueCodec
from deltasync.format.objects import StepObject
from deltasync.format.patch import PackedPatch, Patch
from deltasync.threads import parallel_map

__all__ = ["PartedObject", "combine_headers"]


def combine_headers(
    manifest: Manifest,
    headers: Sequence[StepHeader],
    *,
    where: str,
    parts: Sequence[Part] | None = None,
    names: Collection[str] | None = None,
    check_checksums: bool = True,
) -> StepHeader:
    """The step header the parts' headers add up to (whole tensors, summed checksums and counts).

    ``parts`` are the manifest entries of ``headers`` (default: all of the manifest's, in order). With
    ``names``, only those tensors (each must be covered whole by the given parts) and the state checksum
    is not checked (it needs every tensor). Raises ``FormatError`` for parts that disagree with their
    manifest or each other, ``ChecksumMismatchError`` when the checksums do not give ``state_checksum``.
    """
    parts = manifest.objects if parts is None else parts
    if len(parts) != len(headers):
        raise ValueError("one header per part")
    pieces: dict[str, list[tuple[int, int, TensorHeader]]] = {}
    for part, h in zip(parts, headers, strict=True):
        at = f"{where} part {part.object}"
        if not h.is_part:
            raise FormatError(f"{at}: a part's header must have format_version 2, got {h.format_version}")
        if (h.step, h.kind, h.base_step, h.state_checksum) != (manifest.step, manifest.kind, manifest.base_step,
                                                               manifest.state_checksum):
            raise FormatError(
                f"{at}: header (step {h.step}, {h.kind} on {h.base_step}, state {h.state_checksum[:16]}…) disagrees "
                "with the "
                f"manifest (step {manifest.step}, {manifest.kind} on {manifest.base_step}, state "
                f"{manifest.state_checksum[:16]}…)"
            )
        listed = part.tensors or {}
        ranges = {n: t.range for n, t in h.tensors.items()}
        if ranges != {n: tuple(r) for n, r in listed.items()}:
            odd = sorted(set(ranges.items()) ^ {(n, tuple(r)) for n, r in listed.items()})[:3]
            raise FormatError(f"{at}: tensor ranges differ from the manifest's, e.g. {odd}")
        for name, t in h.tensors.items():
            assert t.range is not None
            pieces.setdefault(name, []).append((*t.range, t))
    wanted = set(pieces) if names is None else set(names)
    missing = wanted - set(pieces)
    if missing:
        raise FormatError(f"{where}: no part holds tensors {sorted(missing)[:5]}")
    tensors = {name: _combine(name, pieces[name], where) for name in pieces if name in wanted}
    aliases = {a: t for a, t in (manifest.aliases or {}).items() if names is None or a in wanted or t in wanted}
    try:
        header = StepHeader(kind=manifest.kind, step=manifest.step, base_step=manifest.base_step,
                            state_checksum=manifest.state_checksum, tensors=tensors, aliases=aliases)
    except ValueError as e:
        raise FormatError(f"{where}: the parts do not make a valid step: {e}") from None
    if check_checksums and names is None:
        got = state_checksum(header.checksums())
        if got != manifest.state_checksum:
            raise ChecksumMismatchError(
                f"{where}: the parts' checksums add up to state {got[:16]}…, the manifest commits to "
                f"{manifest.state_checksum[:16]}…"
            )
    return header


def _combine(name: str, pieces: list[tuple[int, int, TensorHeader]], where: str) -> TensorHeader:
    """One tensor's entry from its ranges: they must agree on dtype and shape and tile it exactly."""
    pieces.sort(key=lambda p: p[0])
    first = pieces[0][2]
    end = 0
    for start, stop, t in pieces:
        if (t.dtype, t.shape) != (first.dtype, first.shape):
            raise FormatError(f"{where}: parts disagree on tensor {name!r}: {t.dtype} {list(t.shape)} and "
                              f"{first.dtype} {list(first.shape)}")
        if start != end:
            raise FormatError(f"{where}: tensor {name!r}: elements {min(start, end)}..{max(start, end)} are "
                              f"{'held twice' if start < end else 'in no part'}")
        end = stop
    if end != first.numel:
        raise FormatError(f"{where}: tensor {name!r}: elements {end}..{first.numel} are in no part")
    changed = sum(t.changed for _, _, t in pieces)
    checksum = sum(int(t.checksum, 16) for _, _, t in pieces) & MASK64
    positions: tuple[PositionCodec, ...] | None = None
    values: tuple[ValueCodec, ...] | None = None
    if changed:  # the combined patch is listed sparse unless one part holds the whole tensor dense
        whole = len(pieces) == 1 and first.positions is not None
        positions = first.positions if whole else ("gap16",)
        values = first.values if whole else ("xor",)
    return TensorHeader(dtype=first.dtype, shape=first.shape, changed=changed, checksum=format_checksum(checksum),
                        positions=positions, values=values)


class PartedObject(StepObject):
    """The parts of one multi-part step, opened, checked and read as one ``StepObject``.

    ``objects`` are the opened parts, in the order of ``parts`` (their manifest entries); the view owns
    them (``close`` closes them all). With ``names`` it holds only those tensors (a consumer that fetched
    only the parts it needs).
    """

    def __init__(
        self,
        manifest: Manifest,
        objects: Sequence[StepObject],
        *,
        where: str,
        parts: Sequence[Part] | None = None,
        names: Collection[str] | None = None,
    ) -> None:
        self.where = where
        self.path = None
        self._objects = list(objects)
        try:
            self.header = combine_headers(manifest, [o.header for o in self._objects], where=where, parts=parts,
                                          names=names)
        except BaseException:
            self.close()
            raise
        self._where_held: dict[str, list[tuple[int, StepObject]]] = {}
        for o in self._objects:
            for n, t in o.header.tensors.items():
                if n in self.header.tensors:
                    self._where_held.setdefault(n, []).append((t.start, o))
        for held in self._where_held.values():
            held.sort(key=lambda p: p[0])

    def close(self) -> None:
        for o in self._objects:
            o.close()

    @property
    def nbytes(self) -> int:
        return sum(o.nbytes for o in self._objects)

    @property
    def parts(self) -> list[StepObject]:
        return list(self._objects)

    def keys(self) -> list[str]:
        return [k for o in self._objects for k in o.keys()]  # noqa: SIM118 - StepObject.keys() is a method, not a dict's

    def read_tensor(self, name: str) -> torch.Tensor:
        """An anchor's whole tensor, assembled from the parts' ranges."""
        h = self.header.tensors[name]
        out = torch.empty(h.shape, dtype=h.torch_dtype)
        flat = out.reshape(-1)
        for start, o in self._where_held[name]:
            piece = o.read_tensor(name)
            flat[start : start + piece.numel()] = piece
        return out

    tensor = read_tensor

    def packed(self, name: str, *, scratch: DecodeScratch | None = None) -> PackedPatch:
        """A delta's change to one whole tensor held by one part: that part's ``packed``. A tensor split across
        parts has no single ``gap16`` stream: ``FormatError`` (``change`` and ``patch`` take any)."""
        held = [(start, o) for start, o in self._where_held[name] if o.header.tensors[name].changed]
        h = self.header.tensors[name]
        if len(held) != 1 or held[0][1].header.tensors[name].count != h.numel:
            raise FormatError(f"{self.where}: tensor {name!r} changes in {len(held)} parts: it has no one packed "
                              "change (patch() merges them)")
        return replace(held[0][1].packed(name, scratch=scratch), shape=h.shape, checksum=int(h.checksum, 16))

    def change(self, name: str, *, scratch: DecodeScratch | None = None) -> Patch | PackedPatch:
        """``packed`` where one part holds the tensor's change, else ``patch`` (the parts' changes merged)."""
        held = [o for _, o in self._where_held[name] if o.header.tensors[name].changed]
        if len(held) == 1 and held[0].header.tensors[name].count == self.header.tensors[name].numel:
            return self.packed(name, scratch=scratch)
        return self.patch(name)

    def patch(self, name: str) -> Patch:
        """A delta's change to one whole tensor: the parts' changes, in global positions."""
        h = self.header.tensors[name]
        held = [(start, o) for start, o in self._where_held[name] if o.header.tensors[name].changed]
        pieces = [(start, o.patch(name)) for start, o in held]
        checksum = int(h.checksum, 16)
        if len(pieces) == 1 and pieces[0][1].numel == h.numel:
            return replace(pieces[0][1], shape=h.shape, checksum=checksum)
        positions, xors = [], []
        for start, p in pieces:
            if p.positions is None:
                nz = np.flatnonzero(p.xor)
                positions.append(nz.astype(np.int64) + start)
                xors.append(p.xor[nz])
            else:
                positions.append(p.positions + start)
                xors.append(p.xor)
        return Patch(name=name, dtype=h.dtype, shape=h.shape, positions=np.concatenate(positions),
                     xor=np.concatenate(xors), checksum=checksum)

    def patches(self) -> list[Patch]:
        names = [name for name, h in self.header.tensors.items() if h.changed]
        return parallel_map(self.patch, names, cost=lambda n: self.header.tensors[n].changed)
