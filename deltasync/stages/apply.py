"""Apply stage: bring an in-memory state dict from one step to the next, verified, all or nothing.

Everything is validated and decoded before the first bit changes; checksums are checked after; on a
mismatch the same XOR patches are applied again (XOR undoes itself) so the state is exactly as before.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Literal

import numpy as np
import torch

from deltasync.errors import (
    BaseStepMismatchError,
    ChecksumMismatchError,
    TensorMismatchError,
)
from deltasync.format import _kernels
from deltasync.format._bits import int_view, np_bits
from deltasync.format.checksum import (
    MASK64,
    _torch_hash,
    _unsigned64,
    format_checksum,
    parse_checksum,
    tensor_checksum,
)
from deltasync.format.objects import StepHeader, StepObject

log = logging.getLogger(__name__)

Verify = Literal["incremental", "full"]
Patch = tuple[str, "np.ndarray | None", np.ndarray]


class Replica:
    """A consumer's copy of the weights at a known step, with the checksum of every tensor.

    ``tensors`` maps every trainer name (aliases included, sharing storage with their target) to a tensor.
    ``verify="incremental"`` proves each step from the previous one in time proportional to the change;
    ``"full"`` recomputes the checksum of every changed tensor from its bits.
    """

    def __init__(self, step: int, tensors: dict[str, torch.Tensor], checksums: dict[str, int]) -> None:
        self.step = step
        self.tensors = tensors
        self.checksums = checksums

    @classmethod
    def from_tensors(cls, tensors: dict[str, torch.Tensor], *, step: int) -> Replica:
        """A replica of tensors the caller vouches for as ``step`` (checksums computed here)."""
        return cls(step, tensors, {n: tensor_checksum(t) for n, t in tensors.items()})

    @classmethod
    def from_anchor(cls, obj: StepObject, *, device: str | torch.device = "cpu") -> Replica:
        """Load an anchor and check every tensor's checksum."""
        h = obj.header
        if h.kind != "anchor":
            raise BaseStepMismatchError(f"{obj.where}: a fresh replica needs an anchor, this is a delta on step {h.base_step}")
        tensors = {name: obj.tensor(name).to(device) for name in h.tensors}
        checksums = {name: tensor_checksum(t) for name, t in tensors.items()}
        _check(h, checksums, obj.where, names=h.tensors)
        for alias, target in h.aliases.items():
            tensors[alias] = tensors[target]
        return cls(h.step, tensors, checksums)

    def state_dict(self) -> dict[str, torch.Tensor]:
        return dict(self.tensors)

    def apply(self, obj: StepObject, *, verify: Verify = "incremental") -> None:
        """Advance to ``obj``'s step: a delta on this replica's step, or an anchor (loaded in place)."""
        h = obj.header
        if h.kind == "anchor":
            self._load_anchor_in_place(obj)
            return
        if h.base_step != self.step:
            raise BaseStepMismatchError(
                f"{obj.where}: delta to step {h.step} is based on step {h.base_step}, but the replica holds step {self.step}"
            )
        _check_layout(h, self.tensors, obj.where)
        patches = obj.patches()  # decodes and validates everything before any write
        deltas = _apply_patches(self.tensors, patches)
        new = {name: (c + deltas.get(name, 0)) & MASK64 for name, c in self.checksums.items()}
        if verify == "full":
            new.update({name: tensor_checksum(self.tensors[name]) for name, _, _ in patches})
        try:
            _check(h, new, obj.where, names=h.tensors)
        except ChecksumMismatchError:
            _apply_patches(self.tensors, patches)  # XOR again: back to the exact previous bits
            raise
        self.checksums = new
        self.step = h.step

    def _load_anchor_in_place(self, obj: StepObject) -> None:
        h = obj.header
        _check_layout(h, self.tensors, obj.where)
        incoming = {name: obj.tensor(name) for name in h.tensors}
        checksums = {name: tensor_checksum(t) for name, t in incoming.items()}
        _check(h, checksums, obj.where, names=h.tensors)
        for name, t in incoming.items():
            self.tensors[name].copy_(t)
        self.checksums = checksums
        self.step = h.step


def _check_layout(h: StepHeader, tensors: Mapping[str, torch.Tensor], where: str) -> None:
    names = set(h.tensors) | set(h.aliases)
    if names != set(tensors):
        raise TensorMismatchError(
            f"{where}: tensor names differ from the replica's: unknown {sorted(names - set(tensors))[:5]}, "
            f"missing {sorted(set(tensors) - names)[:5]}"
        )
    for name, th in h.tensors.items():
        t = tensors[name]
        if tuple(t.shape) != th.shape or t.dtype != th.torch_dtype:
            raise TensorMismatchError(
                f"{where}: tensor {name!r} is {th.shape} {th.dtype} in the step, {tuple(t.shape)} {t.dtype} in the replica"
            )


def _check(h: StepHeader, checksums: Mapping[str, int], where: str, *, names: Mapping[str, object]) -> None:
    bad = [n for n in names if checksums[n] != parse_checksum(h.tensors[n].checksum)]
    if bad:
        n = bad[0]
        raise ChecksumMismatchError(
            f"{where}: {len(bad)} tensor(s) do not match the trainer's checksums after step {h.step}, first {n!r}: "
            f"expected {h.tensors[n].checksum}, got {format_checksum(checksums[n])}"
        )


def _apply_patches(tensors: Mapping[str, torch.Tensor], patches: list[Patch]) -> dict[str, int]:
    """XOR each patch into its tensor in place; returns each tensor's checksum change."""
    return {name: xor_into(tensors[name], pos, xor) for name, pos, xor in patches}


def xor_into(t: torch.Tensor, positions: np.ndarray | None, xor: np.ndarray) -> int:
    """``t.flat[positions] ^= xor`` (every element when positions is None); returns the checksum change.

    Positions must already be validated as in range.
    """
    if not t.is_contiguous():
        raise TensorMismatchError(f"cannot patch a non-contiguous tensor of shape {tuple(t.shape)} in place")
    if t.device.type == "cpu":
        u = np_bits(t)
        return int(_kernels.xor_dense(u, xor, 0) if positions is None else _kernels.xor_at(u, positions, xor))
    return _xor_into_torch(int_view(t), positions, xor)


def _xor_into_torch(bits: torch.Tensor, positions: np.ndarray | None, xor: np.ndarray) -> int:
    """``xor_into`` for flat integer bits on an accelerator (torch ops; same numbers as the CPU kernels)."""
    x = torch.from_numpy(xor.view(f"i{xor.itemsize}")).to(bits.device)
    idx = (
        torch.arange(bits.numel(), device=bits.device)
        if positions is None
        else torch.from_numpy(positions).to(bits.device)
    )
    old = bits[idx]
    new = old ^ x
    bits[idx] = new
    return int((_torch_hash(_unsigned64(new), idx).sum() - _torch_hash(_unsigned64(old), idx).sum()).item()) & MASK64
