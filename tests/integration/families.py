"""Tiny random checkpoints of the model families RL teams train, built with transformers from their configs.

Each is a 2-layer bf16 model with the family's real module structure (vLLM loads it with the family's own
model class): dense Llama, Gemma (tied), Phi-3 (q/k/v and gate/up fused in the checkpoint), Qwen3-MoE and
Mixtral (FusedMoE experts and a router), DeepSeek-V2 (MLA attention, a dense first layer, routed plus shared
experts). Sizes are what vLLM's CPU kernels accept (head_dim 64, MLA rope dim 64, kv_lora_rank 512).
"""

from __future__ import annotations

from pathlib import Path

import torch

from tests.integration.conftest import VOCAB, save_tokenizer

FAMILIES = ("llama", "gemma", "phi3", "qwen3_moe", "mixtral", "deepseek_v2")
MOE = ("qwen3_moe", "mixtral", "deepseek_v2")
# cases left out of CI's 20-minute budget (./run.sh test -m outside_ci runs them): the llama routes are also
# exercised by its fp8 case, a tied head by the qwen3 tests, and the stock-kernel MoE path by qwen3_moe's
OUTSIDE_CI = {("llama", "live", "bf16"), ("gemma", "live", "bf16"), ("mixtral", "stock", "bf16"),
              ("deepseek_v2", "stock", "bf16")}
OUTSIDE_CI_NOTE = " (outside CI: `./run.sh test -m outside_ci`)"


def _test(family: str, kernels: str, dtype: str) -> str:
    case = f"test_vllm_models::test_family_follows_a_stream_bit_exact_against_fresh_engines[{family}-{kernels}-{dtype}]"
    return case + (OUTSIDE_CI_NOTE if (family, kernels, dtype) in OUTSIDE_CI else "")


def build_family(family: str, out: Path, *, seed: int = 0) -> Path:
    """A random checkpoint of ``family`` (see :data:`FAMILIES`) plus a byte-level tokenizer in ``out``."""
    import transformers as tf

    torch.manual_seed(seed)
    common = dict(vocab_size=VOCAB, hidden_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=1024, initializer_range=0.1,
                  eos_token_id=VOCAB - 1, bos_token_id=None, pad_token_id=None, tie_word_embeddings=False)
    experts = dict(num_experts_per_tok=2)
    if family == "llama":
        model = tf.LlamaForCausalLM(tf.LlamaConfig(head_dim=64, intermediate_size=256, **common))
    elif family == "gemma":
        model = tf.GemmaForCausalLM(tf.GemmaConfig(head_dim=64, intermediate_size=256,
                                                   **{**common, "tie_word_embeddings": True}))
    elif family == "phi3":
        model = tf.Phi3ForCausalLM(tf.Phi3Config(intermediate_size=256, **common))
    elif family == "qwen3_moe":
        model = tf.Qwen3MoeForCausalLM(tf.Qwen3MoeConfig(
            head_dim=64, intermediate_size=256, moe_intermediate_size=64, num_experts=4, decoder_sparse_step=1,
            **experts, **common))
    elif family == "mixtral":
        model = tf.MixtralForCausalLM(tf.MixtralConfig(head_dim=64, intermediate_size=64, num_local_experts=4,
                                                       **experts, **common))
    elif family == "deepseek_v2":
        model = tf.DeepseekV2ForCausalLM(tf.DeepseekV2Config(
            intermediate_size=256, moe_intermediate_size=64, n_routed_experts=4, n_shared_experts=1,
            first_k_dense_replace=1, kv_lora_rank=512, q_lora_rank=None, qk_rope_head_dim=64, qk_nope_head_dim=64,
            v_head_dim=64, n_group=1, topk_group=1, **experts, **common))
    else:
        raise ValueError(f"unknown family {family!r}; known: {FAMILIES}")
    model = model.to(torch.bfloat16)
    with torch.no_grad():
        for p in model.parameters():
            if p.ndim == 1:  # norms start at exactly 1 or 0: make them differ
                p.add_(torch.randn_like(p) * 0.2)
    model.save_pretrained(out)
    save_tokenizer(out)
    return out


# The support matrix docs/MODELS.md shows: one row per verified configuration, each the parameters of a test
# (tests/test_models_doc.py checks that the document shows exactly this table).
SHADOW_EXPERTS = "experts shadowed (CPU prepack)"
MATRIX: list[dict[str, str]] = [
    *({"family": f, "tp": "1", "ep": "-", "dtype": "bf16", "kernels": "live",
       "path": {"llama": "in place", "gemma": "in place (tied head: nothing to do)",
                "phi3": "in place (fused q/k/v and gate/up checkpoint: routed in pieces)",
                "qwen3_moe": f"in place; {SHADOW_EXPERTS}", "mixtral": f"in place; {SHADOW_EXPERTS}",
                "deepseek_v2": f"in place (MLA W_UK_T/W_UV share kv_b_proj); {SHADOW_EXPERTS}"}[f],
       "test": _test(f, "live", "bf16")}
      for f in FAMILIES),
    {"family": "llama", "tp": "1", "ep": "-", "dtype": "fp8 engine, bf16 stream", "kernels": "live",
     "path": "linears shadowed: vLLM re-quantizes them (float8 weights, scales)",
     "test": _test("llama", "live", "fp8")},
    *({"family": f, "tp": "1", "ep": "-", "dtype": "bf16", "kernels": "stock",
       "path": "linears and experts shadowed (CPU repack/prepack)",
       "test": _test(f, "stock", "bf16")}
      for f in MOE),
    {"family": "qwen3_moe", "tp": "2", "ep": "-", "dtype": "bf16", "kernels": "live",
     "path": f"in place, each rank its slices; {SHADOW_EXPERTS}",
     "test": "test_vllm_models::test_moe_tensor_parallel_2_bit_exact_against_a_fresh_engine (outside CI: "
             "`./run.sh test -m outside_ci`)"},
    {"family": "qwen3 (dense, tied and untied)", "tp": "1, 2", "ep": "-", "dtype": "bf16, fp32",
     "kernels": "live, stock",
     "path": "in place (live); linears shadowed (stock)",
     "test": "test_vllm_worker, test_vllm_engine, test_vllm_follow"},
]
COLUMNS = ("family", "tp", "ep", "dtype", "kernels", "path", "test")


def matrix_markdown() -> str:
    """The support matrix as the Markdown table docs/MODELS.md holds."""
    rows = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    rows += ["| " + " | ".join(r[c] for c in COLUMNS) + " |" for r in MATRIX]
    return "\n".join(rows) + "\n"


if __name__ == "__main__":
    print(matrix_markdown(), end="")
