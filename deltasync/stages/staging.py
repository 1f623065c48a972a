"""Staging: a delta decoded and validated against the state it will patch, before anything is written.

Decoding (zstd, unshuffle, gap decoding) and every check take time proportional to the object; writing a
staged step takes time proportional to the change. Staging ahead lets a consumer that must pause to write
(a vLLM engine between two generation steps) hold the pause only for the in-place XOR and the checksum
comparison (``deltasync.stages.apply.apply_staged``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from deltasync.errors import BaseStepMismatchError, TensorMismatchError
from deltasync.format._bits import dtype_name
from deltasync.format.documents import DtypeName, StepHeader
from deltasync.format.objects import StepObject
from deltasync.format.patch import Patch

__all__ = ["Layout", "StagedStep", "TensorSpec", "layout_of", "stage"]


@dataclass(frozen=True, kw_only=True)
class TensorSpec:
    """The dtype (safetensors name, e.g. ``"BF16"``) and shape of one tensor a consumer holds."""

    dtype: DtypeName
    shape: tuple[int, ...]


Layout = Mapping[str, Any]
"""``{name: anything with .dtype and .shape}``: tensors, ``TensorSpec``s or ``TensorHeader``s; dtypes as
``torch.dtype`` or safetensors names."""


def layout_of(tensors: Mapping[str, torch.Tensor]) -> dict[str, TensorSpec]:
    """The layout of a state dict (no data is copied)."""
    return {name: TensorSpec(dtype=dtype_name(t.dtype), shape=tuple(t.shape)) for name, t in tensors.items()}


@dataclass(frozen=True, kw_only=True, eq=False)
class StagedStep:
    """A delta's patches, decoded and checked against a layout and a base step: ready to write.

    ``patches`` hold every changed tensor (in the header's order); each patch's ``checksum`` is the
    tensor's checksum after the step. The memory held is ``nbytes``.
    """

    header: StepHeader
    where: str
    patches: tuple[Patch, ...]

    @property
    def step(self) -> int:
        return self.header.step

    @property
    def base_step(self) -> int | None:
        return self.header.base_step

    @property
    def nbytes(self) -> int:
        return sum(p.xor.nbytes + (p.positions.nbytes if p.positions is not None else 0) for p in self.patches)


def stage(obj: StepObject, layout: Layout, *, base_step: int | None, partial: bool = False) -> StagedStep:
    """Decode and validate ``obj`` (a delta) for a holder of ``layout`` at ``base_step``; writes nothing.

    Raises, before anything is written anywhere: ``BaseStepMismatchError`` if ``obj`` is an anchor or is not
    based on ``base_step`` (None skips that check, for a caller that checks the chain itself),
    ``TensorMismatchError`` if a name, dtype or shape differs, ``FormatError``/``CorruptObjectError`` if a
    payload does not decode or disagrees with its header (counts, position bounds). With ``partial`` the
    layout may hold only some of the step's tensors (a tensor-parallel rank, an engine that ignores some):
    every changed tensor must be in it, and every tensor in it must match; otherwise its names must be
    exactly the step's (aliases included).
    """
    h = obj.header
    if h.kind != "delta":
        raise BaseStepMismatchError(f"{obj.where}: an anchor replaces the whole state; only a delta is staged as "
                                    "patches")
    if base_step is not None and h.base_step != base_step:
        raise BaseStepMismatchError(
            f"{obj.where}: delta to step {h.step} is based on step {h.base_step}, but the target holds step "
            f"{base_step}", step=h.step, expected=h.base_step, found=base_step,
        )
    check_layout(h, layout, obj.where, partial=partial)
    return StagedStep(header=h, where=obj.where, patches=tuple(obj.patches()))


def check_layout(h: StepHeader, layout: Layout, where: str, *, partial: bool = False) -> None:
    """Raise ``TensorMismatchError`` unless ``layout`` holds the step's tensors, dtypes and shapes."""
    names = set(h.tensors) | set(h.aliases)
    held = set(layout)
    if partial:
        missing = sorted(n for n, t in h.tensors.items() if t.changed and n not in held)
        if missing:
            raise TensorMismatchError(f"{where}: changed tensors the target does not hold: {missing[:5]} "
                                      f"({len(missing)} in all)")
    elif names != held:
        raise TensorMismatchError(
            f"{where}: tensor names differ from the target's: unknown {sorted(names - held)[:5]}, "
            f"missing {sorted(held - names)[:5]}"
        )
    for name, th in h.tensors.items():
        t = layout.get(name)
        if t is None:
            continue
        dtype = t.dtype if isinstance(t.dtype, str) else dtype_name(t.dtype)
        if tuple(t.shape) != th.shape or dtype != th.dtype:
            raise TensorMismatchError(
                f"{where}: tensor {name!r} is {th.dtype} {list(th.shape)} in the step, {dtype} {list(t.shape)} in the "
                "target"
            )
