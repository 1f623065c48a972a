"""The runtime fingerprint of a vLLM engine: every parameter and buffer it computes with, in its own layout.

The deltasync engine proves the checkpoint-format weights it writes; what vLLM derives from them after loading
(CPU-prepacked MoE experts, FP8 weights and scales, repacked linears) is produced by vLLM's own reload code and
otherwise never checked. A fingerprint (docs/FORMAT.md section 5f) covers those bytes: per rank, the
``mix64-sum`` of each parameter and buffer over its own flat elements (deltasync's checksum kernels: numba on
CPU, torch on an accelerator), digested, with the key of the configuration that decides the layout
(:func:`engine_config`). Tensors a CPU kernel captured beside its module (sgl's packed weight) are included;
a kernel whose copy is opaque to Python (oneDNN's packed linears: stock CPU kernels) is listed in ``opaque``:
its bytes are not covered, and the fingerprint says so.

:func:`rollout_loader.vllm.reference.reference_for_step` makes a reference from a fresh engine. Importing this
module imports no vLLM; its functions do.
"""

from __future__ import annotations

import hashlib
import json
import logging
import platform
from collections.abc import Iterator
from typing import Any

import torch

from deltasync.engine import DTYPES, RankFingerprint, TensorPrint, format_checksum, tensor_checksum

log = logging.getLogger(__name__)

__all__ = ["engine_config", "fingerprint_model", "rank_and_size", "runtime_checksums"]

_DROPPED = ("transformers_version", "torch_dtype", "dtype")  # names and versions, not layout (dtype: its own field)


def engine_config(vllm_config: Any) -> dict[str, str | int | bool | None]:
    """The configuration that decides an engine's runtime layout (docs/FORMAT.md section 5f): the model (its
    architectures and a digest of its Hugging Face configuration, paths and names left out), dtype, quantization,
    tensor- and pipeline-parallel sizes, expert parallelism, the platform and device (CPU: architecture and the
    ISA its kernels pick; GPU: name and compute capability), CPU kernels (live or stock), vLLM and torch versions."""
    import os

    import vllm
    from vllm.platforms import current_platform

    from .live_cpu import LIVE_ENV

    mc, pc = vllm_config.model_config, vllm_config.parallel_config
    hf = {k: v for k, v in mc.hf_config.to_dict().items() if not k.startswith("_") and k not in _DROPPED
          and k != "name_or_path"}
    model = hashlib.sha256(json.dumps(hf, sort_keys=True, default=str).encode()).hexdigest()[:16]
    device_type = str(current_platform.device_type)
    if device_type == "cpu":
        isa = ("amx" if torch.cpu._is_amx_tile_supported() else  # what vLLM's CPU GEMM dispatch decides by
               "avx512_bf16" if torch.cpu._is_avx512_bf16_supported() else torch.backends.cpu.get_cpu_capability())
        device = f"{platform.machine()}/{isa}"
        kernels: str | None = "live" if os.environ.get(LIVE_ENV) == "1" else "stock"
    else:
        cap = current_platform.get_device_capability()
        device = f"{current_platform.get_device_name()}/sm{cap.to_int() if cap is not None else '?'}"
        kernels = None
    return {
        "architectures": ",".join(hf.get("architectures") or []),
        "model_config": model,
        "dtype": str(mc.dtype).removeprefix("torch."),
        "quantization": mc.quantization,
        "tensor_parallel_size": int(pc.tensor_parallel_size),
        "pipeline_parallel_size": int(pc.pipeline_parallel_size),
        "expert_parallel": bool(getattr(pc, "enable_expert_parallel", False)),
        "platform": device_type,
        "device": device,
        "cpu_kernels": kernels,
        "vllm": str(vllm.__version__),
        "torch": str(torch.__version__),
    }


def rank_and_size() -> tuple[int, int]:
    """This worker's rank among the engine's model-parallel ranks (pipeline stage major) and their number."""
    from vllm.distributed import get_pp_group, get_tp_group

    tp, pp = get_tp_group(), get_pp_group()
    return pp.rank_in_group * tp.world_size + tp.rank_in_group, tp.world_size * pp.world_size


def _tensors(model: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """Every parameter and buffer of ``model`` (shared ones once), and the tensors its CPU kernels captured."""
    yield from model.named_parameters()
    yield from (("buffer:" + n, b) for n, b in model.named_buffers())
    for name, module in model.named_modules():
        for i, t in enumerate(_kernel_tensors(module)):
            yield f"kernel:{name}.cpu_linear:{i}", t


def _kernel_tensors(module: torch.nn.Module) -> list[torch.Tensor]:
    kernel = module.__dict__.get("cpu_linear")
    cells = getattr(kernel, "__closure__", None) or ()
    defaults = getattr(kernel, "__defaults__", None) or ()
    out = []
    for value in [c.cell_contents for c in cells if _filled(c)] + list(defaults):
        if isinstance(value, torch.Tensor):
            out.append(value)
    return out


def _filled(cell: Any) -> bool:
    try:
        cell.cell_contents  # noqa: B018 - an empty cell raises
    except ValueError:
        return False
    return True


def _opaque(model: torch.nn.Module) -> list[str]:
    """Modules whose CPU kernel computes with a copy of their weight that no tensor here holds (oneDNN)."""
    from .live_cpu import module_kind

    return sorted(name for name, m in model.named_modules()
                  if "cpu_linear" in m.__dict__ and module_kind(m) != "live" and not _kernel_tensors(m))


def _checksum(t: torch.Tensor) -> int:
    t = t.detach()
    if t.dtype not in DTYPES.values():  # a dtype deltasync's kernels have no width for: its raw bytes
        t = t.contiguous().reshape(-1).view(torch.uint8)
    return tensor_checksum(t)


def runtime_checksums(model: torch.nn.Module) -> dict[str, int]:
    """The ``mix64-sum`` of every parameter, buffer and captured kernel tensor of ``model`` (or of one of its
    modules), by the names :func:`fingerprint_model` gives them: one pass, to tell which changed."""
    return {name: _checksum(t) for name, t in _tensors(model)}


def fingerprint_model(model: torch.nn.Module) -> RankFingerprint:
    """This rank's runtime fingerprint: one pass over every parameter, buffer and captured kernel tensor."""
    from deltasync.engine import rank_digest

    tensors = {name: TensorPrint(checksum=format_checksum(_checksum(t)), dtype=str(t.dtype).removeprefix("torch."),
                                 shape=list(t.shape))
               for name, t in _tensors(model)}
    return RankFingerprint(digest=rank_digest(tensors), tensors=tensors, opaque=_opaque(model))
