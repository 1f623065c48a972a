"""Fixtures for tests, examples and benchmarks: a tiny random model of a real family, a checkpoint folder an
engine loads, a training corpus that needs no download.

Here rather than in the CLI's demo (which uses them too) so that a benchmark or a downstream test suite gets
them without importing the command line. Needs the ``demo`` extra (transformers).

    from deltasync.testing import save_model_dir, tiny_qwen3
    model = tiny_qwen3(hidden_size=128, layers=2)
    save_model_dir(model, "ckpt")        # config, bf16 safetensors, a byte-level tokenizer

``deltasync.testing.store_contract`` holds the store contract, the pytest suite a new store backend runs to prove
itself (subclass ``StoreContract``); it imports pytest, so this package does not import it.
"""

from __future__ import annotations

import random
import sysconfig
from pathlib import Path
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from transformers import PreTrainedModel

__all__ = ["save_model_dir", "stdlib_corpus", "tiny_qwen3"]


def tiny_qwen3(*, hidden_size: int = 256, layers: int = 4, vocab_size: int = 512, tie: bool = False, seed: int = 0):
    """A random Qwen3 model built with transformers (no download): head_dim 64, as vLLM's CPU attention wants.
    ``MissingDependencyError`` naming the extra without transformers."""
    try:
        from transformers import Qwen3Config, Qwen3ForCausalLM
    except ImportError as e:
        from deltasync.errors import MissingDependencyError

        raise MissingDependencyError(f"the demo trains a small Qwen3 model with transformers ({e}): "
                                     "pip install 'deltasync[demo]'") from None

    torch.manual_seed(seed)
    cfg = Qwen3Config(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=hidden_size * 3,
        num_hidden_layers=layers,
        num_attention_heads=hidden_size // 64,
        num_key_value_heads=max(1, hidden_size // 128),
        head_dim=64,
        max_position_embeddings=2048,
        tie_word_embeddings=tie,
        # transformers 5 calls it dtype (torch_dtype still works there, with a warning); 4.x knows only torch_dtype
        torch_dtype="bfloat16",
    )
    return Qwen3ForCausalLM(cfg)


def save_model_dir(model: PreTrainedModel, out: str | Path, *, dtype: torch.dtype = torch.bfloat16) -> Path:
    """A checkpoint folder an inference engine loads: config, weights in ``dtype``, a byte-level tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    out = Path(out)
    state = {k: v.detach().to(dtype) if v.is_floating_point() else v for k, v in model.state_dict().items()}
    model.save_pretrained(out, state_dict=state)  # a copy: the trainer's fp32 master weights stay untouched
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tok = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    PreTrainedTokenizerFast(tokenizer_object=tok).save_pretrained(out)
    return out


def stdlib_corpus(max_bytes: int = 4 << 20, seed: int = 0) -> torch.Tensor:
    """Bytes of the Python standard library's source, as token ids."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(root.glob("*.py"))
    random.Random(seed).shuffle(files)
    buf = bytearray()
    for f in files:
        buf += f.read_bytes()
        if len(buf) >= max_bytes:
            break
    return torch.frombuffer(buf[:max_bytes], dtype=torch.uint8).to(torch.long)
