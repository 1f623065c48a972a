"""Tiny random Qwen3 checkpoints and in-process vLLM engines for the engine-side tests.

Everything is built at test time (no hub access): a 2-layer Qwen3 with head_dim 64 (what vLLM's CPU
attention supports) and a byte-level tokenizer made with ``tokenizers``.
"""

from __future__ import annotations

import gc
import json
import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

EXTENSION = "rollout_loader.vllm.worker.DeltaWorkerExtension"
VOCAB = 512
_INT = {2: torch.int16, 4: torch.int32}


def build_checkpoint(out: Path, *, tie: bool, seed: int = 0) -> None:
    """A random bf16 Qwen3 checkpoint plus a byte-level tokenizer in ``out``."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(seed)
    cfg = Qwen3Config(
        vocab_size=VOCAB,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        max_position_embeddings=1024,
        tie_word_embeddings=tie,
        initializer_range=0.1,  # large enough that greedy output is not one token repeated
        eos_token_id=VOCAB - 1,  # never produced in practice: generations run to max_tokens
        bos_token_id=None,
        pad_token_id=None,
    )
    model = Qwen3ForCausalLM(cfg).to(torch.bfloat16)
    with torch.no_grad():
        for p in model.parameters():
            if p.ndim == 1:  # norms start at exactly 1: make them differ
                p.add_(torch.randn_like(p) * 0.2)
    model.save_pretrained(out)
    save_tokenizer(out)


def save_tokenizer(out: Path) -> None:
    """A byte-level tokenizer (every byte one token) in ``out``: no hub access needed."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tok = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    PreTrainedTokenizerFast(tokenizer_object=tok).save_pretrained(out)


def save_like(src: Path, out: Path, state: dict[str, torch.Tensor]) -> Path:
    """A copy of checkpoint directory ``src`` with weights ``state``."""
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.suffix == ".json":
            (out / f.name).write_bytes(f.read_bytes())
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


def load_state(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(path / "model.safetensors"))


def xor_patch(old: torch.Tensor, new: torch.Tensor, *, dense: bool = False) -> tuple[torch.Tensor | None, torch.Tensor]:
    """(positions, xor) turning ``old`` into ``new`` bit for bit; ``dense``: positions None, xor everywhere."""
    w = _INT[old.element_size()]
    x = old.reshape(-1).view(w) ^ new.reshape(-1).view(w)
    if dense:
        return None, x
    pos = torch.nonzero(x).reshape(-1)
    return pos, x[pos]


def perturb(
    state: dict[str, torch.Tensor], names: list[str], *, seed: int, density: float = 0.05
) -> dict[str, torch.Tensor]:
    """A copy of ``state`` with about ``density`` of the elements of ``names`` changed by finite amounts."""
    g = torch.Generator().manual_seed(seed)
    out = dict(state)
    for name in names:
        t = state[name].clone().reshape(-1)
        n = max(2, int(t.numel() * density))
        pos = torch.randperm(t.numel(), generator=g)[:n]
        scale = float(t.float().std()) + 0.05
        t[pos] = (t[pos].float() + torch.randn(n, generator=g) * 3 * scale).to(t.dtype)
        t[pos[0]] = -0.0  # a signed zero: bit-exact, not value-exact
        out[name] = t.reshape(state[name].shape)
    return out


@dataclass(frozen=True)
class Scenario:
    """A base checkpoint, the same checkpoint with some tensors changed, and the patch between them."""

    tie: bool
    dtype: str
    base_dir: Path
    new_dir: Path
    base: dict[str, torch.Tensor]
    new: dict[str, torch.Tensor]
    patch: dict[str, tuple[torch.Tensor | None, torch.Tensor]]

    @property
    def shapes_json(self) -> str:
        return json.dumps({k: list(v.shape) for k, v in self.base.items()})


def perturbed_names(tie: bool) -> list[str]:
    names = [
        "model.embed_tokens.weight",
        "model.layers.0.self_attn.q_proj.weight",
        "model.layers.0.self_attn.k_proj.weight",
        "model.layers.0.self_attn.v_proj.weight",
        "model.layers.0.self_attn.q_norm.weight",
        "model.layers.0.mlp.gate_proj.weight",
        "model.layers.1.mlp.up_proj.weight",
        "model.layers.1.self_attn.o_proj.weight",
        "model.layers.1.mlp.down_proj.weight",
        "model.layers.1.input_layernorm.weight",
        "model.norm.weight",
    ]
    return names if tie else [*names, "lm_head.weight"]


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[bool, Path]:
    """{tie_word_embeddings: bf16 checkpoint directory}."""
    root = tmp_path_factory.mktemp("tiny-qwen3")
    out = {}
    for tie in (True, False):
        out[tie] = root / ("tied" if tie else "untied")
        build_checkpoint(out[tie], tie=tie)
    return out


@pytest.fixture(scope="session")
def scenario(
    checkpoints: dict[bool, Path], tmp_path_factory: pytest.TempPathFactory
) -> Callable[[bool, str], Scenario]:
    """``scenario(tie, dtype)``: cached per (tie, dtype); fp32 ones are the bf16 checkpoints upcast."""
    cache: dict[tuple[bool, str], Scenario] = {}

    def get(tie: bool, dtype: str) -> Scenario:
        if (tie, dtype) not in cache:
            root = tmp_path_factory.mktemp(f"{'tied' if tie else 'untied'}-{dtype}")
            base = {k: v.to(getattr(torch, dtype)) for k, v in load_state(checkpoints[tie]).items()}
            base_dir = save_like(checkpoints[tie], root / "base", base)
            new = perturb(base, perturbed_names(tie), seed=7 + tie)
            new_dir = save_like(checkpoints[tie], root / "new", new)
            patch = {n: xor_patch(base[n], new[n], dense=n == "model.norm.weight") for n in perturbed_names(tie)}
            cache[tie, dtype] = Scenario(tie, dtype, base_dir, new_dir, base, new, patch)
        return cache[tie, dtype]

    return get


def engine_kwargs(path: Path, dtype: str) -> dict:
    return dict(
        model=str(path),
        dtype=dtype,
        enforce_eager=True,
        max_model_len=512,
        seed=0,
        worker_extension_cls=EXTENSION,  # the read-only status of the deltasync engine
        weight_transfer_config={"backend": "deltasync"},
    )


@contextmanager
def engine(path: Path, dtype: str, *, live: bool) -> Iterator:
    """An in-process vLLM engine (starts in 2-3 s instead of 16-26 s); ``live`` keeps CPU linear weights live.

    The environment is set for the engine's lifetime only and vLLM's environment cache (which the engine
    turns on) is dropped afterwards, so other tests see their own settings. One engine at a time: in-process
    engines share global distributed state, and closing one breaks any other still open.
    """
    from vllm import LLM, envs

    from rollout_loader.vllm.plugin import register
    from rollout_loader.vllm.worker import LIVE_ENV

    register()  # the deltasync weight-transfer engine, in this process (the engine's)

    env = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_KVCACHE_SPACE": "1", LIVE_ENV: "1" if live else "0"}
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        llm = LLM(distributed_executor_backend="uni", **engine_kwargs(path, dtype))
        try:
            yield llm
        finally:
            # shut the engine down now: whatever still refers to it (a target, an error kept in a follower)
            # would otherwise let the garbage collector do it later, tearing down the distributed state of
            # the next in-process engine (vLLM's shutdown is a weakref finalizer: it runs once)
            finalizer = getattr(getattr(llm.llm_engine, "engine_core", None), "_finalizer", None)
            if finalizer is not None:
                finalizer()
            del llm
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        envs.disable_envs_cache()
        gc.collect()


PROMPTS = [
    "The quick brown fox",
    "weights move in small steps; " * 12,  # ~350 tokens: longer than one 128-token KV block
]


def generate(llm, prompts: list[str] = PROMPTS, max_tokens: int = 12) -> list[list[int]]:
    from vllm import SamplingParams

    sp = SamplingParams(max_tokens=max_tokens, temperature=0.0, detokenize=False, ignore_eos=True)
    return [list(o.outputs[0].token_ids) for o in llm.generate(prompts, sp, use_tqdm=False)]


@pytest.fixture(scope="session")
def reference_tokens(scenario) -> Callable[[bool, str, bool], list[list[int]]]:
    """``reference_tokens(tie, dtype, live)``: greedy tokens of a fresh engine loaded from the perturbed
    checkpoint, with the same CPU kernels (live or stock) as the engine it is compared with; cached."""
    cache: dict[tuple[bool, str, bool], list[list[int]]] = {}

    def get(tie: bool, dtype: str, live: bool) -> list[list[int]]:
        if (tie, dtype, live) not in cache:
            with engine(scenario(tie, dtype).new_dir, dtype, live=live) as llm:
                cache[tie, dtype, live] = generate(llm)
        return cache[tie, dtype, live]

    return get


def update_to(llm, step: int) -> None:
    """One weight update of an engine running the deltasync weight-transfer engine, as an RL loop drives it."""
    llm.start_weight_update()
    llm.update_weights({"update_info": {"step": step}})
    llm.finish_weight_update(weight_version=str(step))
    llm.reset_prefix_cache()
