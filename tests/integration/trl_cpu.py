"""TRL's ``AsyncGRPOTrainer`` on a CPU-only machine: what stands in for its two GPU-only pieces, and a tiny model
its real rollout worker can prompt.

TRL 1.16.0 needs a GPU in exactly two places on this path (notes: /work/notes/trl-findings.md):

- ``AsyncGRPOTrainer.__init__`` asks ``torch.cuda.get_device_name`` for the device's peak FLOPs (MFU metrics):
  replaced by its documented answer for an unknown device, ``None`` (MFU metrics off);
- training forwards through tree attention (``attn_implementation="tree_fa3"``), whose kernel is the Hub's
  ``kernels-community/flash-attn3``: replaced by :func:`flash_attn_varlen_func`, the same function in plain torch.

Everything else runs as TRL ships it: the trainer, its callbacks, the GRPO loss and optimizer, and its
``AsyncRolloutWorker`` (a spawned child process generating from the vLLM server over HTTP).
"""

from __future__ import annotations

import types
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from tests.integration.conftest import build_checkpoint


def flash_attn_varlen_func(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor,
                           cu_seqlens_k: torch.Tensor, max_seqlen_q: int, max_seqlen_k: int, *,
                           softmax_scale: float | None = None, causal: bool = True,
                           window_size: tuple[int, int] = (-1, -1), **_: object) -> torch.Tensor:
    """flash-attn's varlen attention in torch: segment ``i`` of ``q`` (rows ``cu_seqlens_q[i]:[i+1]``, heads
    ``H``) attends to segment ``i`` of ``k``/``v`` (``H / Hk`` query heads per key head), causally aligned at the
    bottom right as flash-attn does when a query segment is shorter than its keys (TRL's tree attention: each
    segment's keys are its whole root-to-segment path)."""
    if not causal or window_size != (-1, -1):
        raise NotImplementedError("only the causal, unwindowed attention TRL's tree attention uses")
    group = q.shape[1] // k.shape[1]
    out = []
    for i in range(len(cu_seqlens_q) - 1):
        qi = q[cu_seqlens_q[i]:cu_seqlens_q[i + 1]].transpose(0, 1)
        ki, vi = (x[cu_seqlens_k[i]:cu_seqlens_k[i + 1]].transpose(0, 1).repeat_interleave(group, 0) for x in (k, v))
        mask = torch.ones(qi.shape[1], ki.shape[1], dtype=torch.bool).tril(ki.shape[1] - qi.shape[1])
        out.append(F.scaled_dot_product_attention(qi, ki, vi, attn_mask=mask, scale=softmax_scale).transpose(0, 1))
    return torch.cat(out)


def run_on_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """The two stand-ins above, for this test only."""
    import trl.experimental.async_grpo.async_grpo_trainer as trainer_module
    import trl.experimental.async_grpo.packing as packing

    monkeypatch.setattr(trainer_module, "get_peak_flops_per_device", lambda accelerator, dtype: None)
    monkeypatch.setattr(packing, "_flash_attn", lambda: types.SimpleNamespace(
        flash_attn_varlen_func=flash_attn_varlen_func))


def chat_model(out: Path) -> Path:
    """The tests' tiny random bf16 Qwen3 with its byte-level tokenizer, given Qwen3's chat template (the rollout
    worker renders prompts with it and parses responses by it), a pad and an eos token."""
    from transformers import AutoTokenizer
    from trl.chat_template_utils import qwen3_chat_template

    build_checkpoint(out, tie=False)
    tokenizer = AutoTokenizer.from_pretrained(out)
    tokenizer.pad_token, tokenizer.eos_token = tokenizer.convert_ids_to_tokens([0, 255])
    tokenizer.chat_template = qwen3_chat_template
    tokenizer.save_pretrained(out)
    return out


def reward_short(completions: list, **_: object) -> list[float]:
    """Shorter answers are better: enough for every GRPO step to move the policy. Module-level: the rollout
    worker pickles its reward functions into a spawned process."""
    return [-float(len(c[0].get("content") or "")) if c else 0.0 for c in completions]
