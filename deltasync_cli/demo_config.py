"""What both demos share (:mod:`deltasync_cli.demo` over a store, :mod:`deltasync_cli.demo_nixl` over NIXL): the
demo's settings, and the trainer's own checksums that every row is checked against."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from deltasync.format.checksum import format_checksum, tensor_checksum
from deltasync.publish.names import named_tensors

__all__ = ["DemoConfig", "bf16_checksums"]


@dataclass(frozen=True, kw_only=True)
class DemoConfig:
    steps: int = 30
    lr: float = 2e-6
    anchor_every: int = 10
    hidden_size: int = 256
    layers: int = 4
    seq_len: int = 128
    batch_size: int = 8
    seed: int = 0
    engine: str = "vllm"  # "vllm": a real vLLM engine follows; "torch": a state dict in this process
    transport: str = "store"  # "store": the follower reads the store; "nixl": trainer and consumer processes over NIXL


def bf16_checksums(model: torch.nn.Module) -> dict[str, str]:
    """The trainer's own view: checksums of the bf16 weights, computed from scratch."""
    tensors, _ = named_tensors(model)
    return {n: format_checksum(tensor_checksum(t.to(torch.bfloat16) if t.is_floating_point() else t))
            for n, t in tensors.items()}
