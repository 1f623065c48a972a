"""XOR into a slice of an engine parameter, and checksums of slices (docs/FORMAT.md sections 3 and 4).

An engine parameter holds a box of a checkpoint tensor (q's rows of ``qkv_proj``, a rank's shard), so both
operations take the elements' own flat indices (``idx``) and their checkpoint flat indices (``hf_idx``): the
``mix64-sum`` checksum hashes each element with its checkpoint index, which makes the ranks' parts add up.

This is the only module of rollout_loader that reaches below deltasync's public API (its numba kernel and
its element checksum); it goes once deltasync exports an index-mapped XOR apply.
"""

from __future__ import annotations

import torch

from deltasync.format._bits import UNSIGNED_NP
from deltasync.format._kernels import xor_at_indexed
from deltasync.format.checksum import MASK64, checksum_elements

SIGNED = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}

__all__ = ["MASK64", "SIGNED", "add", "checksum_part", "int_bits", "xor_into"]


def int_bits(t: torch.Tensor) -> torch.Tensor:
    """A flat signed-integer view of a contiguous tensor's bits (same storage)."""
    return t.reshape(-1).view(SIGNED[t.element_size()])


def add(*parts: int) -> int:
    """Checksums of disjoint parts of one tensor added up (mod 2**64)."""
    return sum(parts) & MASK64


def checksum_part(bits: torch.Tensor, hf_idx: torch.Tensor) -> int:
    """Checksum of ``bits`` (flat integers) that sit at checkpoint flat indices ``hf_idx``."""
    return checksum_elements(bits, hf_idx) & MASK64


def xor_into(bits: torch.Tensor, idx: torch.Tensor, x: torch.Tensor, hf_idx: torch.Tensor) -> tuple[torch.Tensor, int]:
    """``bits[idx] ^= x``: returns (the old bits, the checksum change over those elements at ``hf_idx``).

    The new bits are read back after the write, so the checksum follows what landed.
    """
    if bits.device.type == "cpu" and bits.is_contiguous():
        unsigned = UNSIGNED_NP[bits.element_size()]
        old = torch.empty_like(x)
        delta = xor_at_indexed(
            bits.numpy().view(unsigned),
            idx.contiguous().numpy(),
            x.contiguous().numpy().view(unsigned),
            hf_idx.to(torch.int64).contiguous().numpy(),
            old.numpy().view(unsigned),
        )
        return old, int(delta)
    old = bits[idx]
    bits[idx] = old ^ x.to(bits.device)
    new = bits[idx]
    return old, (checksum_elements(new, hf_idx) - checksum_elements(old, hf_idx)) & MASK64
