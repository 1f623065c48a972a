"""Live CPU linear weights: make vLLM's CPU linears read their parameters, so in-place writes take effect.

After loading, vLLM's CPU backend repacks linear weights for oneDNN (``weight`` becomes an empty tensor) or
keeps a packed copy next to a still-present ``weight`` (the LM head), so writes to parameters do not reach
the matmuls. With :func:`enable_live_cpu_weights` called before the engine loads (or env
``DELTASYNC_CPU_LIVE_WEIGHTS=1`` in the engine's process) CPU linears run ``F.linear`` on their parameters,
as on GPU, and every update is a pure in-place write. Importing this module imports vLLM.
"""

from __future__ import annotations

import functools
import os
from typing import Literal

import torch
import torch.nn.functional as F

LIVE_ENV = "DELTASYNC_CPU_LIVE_WEIGHTS"
ModuleKind = Literal["live", "refresh", "reload"]


def live_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """The CPU GEMM of live mode: a plain matmul on the parameter itself, so in-place writes take effect."""
    return F.linear(x, weight, bias)


def enable_live_cpu_weights() -> None:
    """Keep CPU linear weights as live parameters in engines created after this call.

    Sets ``DELTASYNC_CPU_LIVE_WEIGHTS=1``, which spawned engine processes inherit (vLLM's default
    multiprocess mode), and hooks vLLM's CPU GEMM dispatch in this process (in-process mode). The worker
    extension and the weight-transfer plugin install the same hook in every worker before the model loads.
    """
    os.environ[LIVE_ENV] = "1"
    install_dispatch_hook()


def install_dispatch_hook() -> None:
    """Wrap ``dispatch_cpu_unquantized_gemm`` so it keeps weights live while ``DELTASYNC_CPU_LIVE_WEIGHTS=1``.

    The decision is taken when each layer is dispatched (at model load), so the hook is inert otherwise.
    vLLM's linear and embedding methods import the function at call time, so patching the module works.
    """
    from vllm.model_executor.layers import utils as layer_utils

    original = layer_utils.dispatch_cpu_unquantized_gemm
    if getattr(original, "_deltasync_hook", False):
        return

    @functools.wraps(original)
    def dispatch(layer: torch.nn.Module, remove_weight: bool) -> None:
        if os.environ.get(LIVE_ENV) == "1" and not layer.weight.is_meta and layer.weight.ndim == 2:
            layer.cpu_linear = live_linear  # type: ignore[assignment]  # torch types Module attributes as Tensor | Module
            return
        original(layer, remove_weight)

    dispatch._deltasync_hook = True  # type: ignore[attr-defined]
    layer_utils.dispatch_cpu_unquantized_gemm = dispatch


def module_kind(module: torch.nn.Module) -> ModuleKind:
    """How writes to this module's parameters reach its kernel.

    "live": the kernel reads the parameter (GPU, non-linear layers, live mode); "refresh": the CPU backend
    keeps its own copy next to a still-present weight (rebuild it after a write); "reload": the weight was
    repacked away (re-load it through vLLM from a host copy of its checkpoint tensors).
    """
    kernel = getattr(module, "cpu_linear", None)
    if kernel is None or kernel is live_linear or kernel is F.linear:
        return "live"
    weight = getattr(module, "weight", None)
    if isinstance(weight, torch.Tensor) and weight.numel() == 0:
        return "reload"
    return "refresh"
