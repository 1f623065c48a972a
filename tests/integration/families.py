"""Tiny random checkpoints of the model families RL teams train, built with transformers from their configs.

Each is a 2-layer bf16 model with the family's real module structure (vLLM loads it with the family's own
model class): dense Llama, Gemma (tied), Phi-3 (q/k/v and gate/up fused in the checkpoint), Qwen3-MoE and
Mixtral (FusedMoE experts and a router), DeepSeek-V2 (MLA attention, a dense first layer, routed plus shared
experts), DeepSeek-V3 (Kimi-K2's architecture: noaux_tc routing with an fp32 ``e_score_correction_bias`` vLLM
shares between the router and the experts, MLA with q_lora), gpt-oss (experts stored fused as ``[E, H, 2I]``,
which vLLM's loader permutes into ``[E, 2I, H]``; attention sinks and biases), Qwen3-Next (gated DeltaNet linear
attention, whose bf16 ``A_log`` vLLM widens to fp32, plus MoE with a shared expert) and a tied Qwen3 whose
checkpoint also stores ``lm_head.weight`` (``deltasync.testing``'s own writer). Sizes are what vLLM's CPU kernels
accept (head_dim 64, MLA rope dim 64, kv_lora_rank 512).
"""

from __future__ import annotations

from pathlib import Path

import torch

from tests.integration.conftest import VOCAB, save_tokenizer

FAMILIES = ("llama", "gemma", "phi3", "qwen3_moe", "mixtral", "deepseek_v2", "deepseek_v3", "gpt_oss", "qwen3_next",
            "tied_head")
MOE = ("qwen3_moe", "mixtral", "deepseek_v2")
# checkpoint tensors a family's model ties (alias -> the tensor it shares): a trainer publishes them equal
TIED = {"tied_head": {"lm_head.weight": "model.embed_tokens.weight"}}
# cases left out of CI's 20-minute budget (./run.sh test -m outside_ci runs them): the llama routes are also
# exercised by its fp8 case, a tied head by the qwen3 tests, and the stock-kernel MoE path by qwen3_moe's; the
# round-2 families' mechanisms (a shared router bias, a permuted copy, a widened dtype, a tied head the checkpoint
# stores) by test_vllm_models::test_round_2_mechanisms_follow_a_delta_bit_exact
OUTSIDE_CI = {("llama", "live", "bf16"), ("gemma", "live", "bf16"), ("mixtral", "stock", "bf16"),
              ("deepseek_v2", "stock", "bf16"), ("deepseek_v3", "live", "bf16"), ("gpt_oss", "live", "bf16"),
              ("qwen3_next", "live", "bf16"), ("tied_head", "live", "bf16")}
OUTSIDE_CI_NOTE = " (outside CI: `./run.sh test -m outside_ci`)"
# (family, kernels, served) of every family case: test_vllm_models follows a stream with each, and
# test_vllm_poisoned_start starts each from random weights
FAMILY_CASES = ([(f, "live", "bf16") for f in FAMILIES] + [(f, "stock", "bf16") for f in MOE]
                + [("llama", "live", "fp8")])
# how a poisoned start gets its random weights: a checkpoint of random weights, or vLLM's load_format="dummy"
STARTS = ("random", "dummy")
# the poisoned-start cases CI runs (a dense family; one with tensors vLLM derives after loading: MLA's absorbed
# weights, prepacked MoE experts); the others run outside CI
POISONED_IN_CI = {("llama", "live", "bf16", "random"), ("deepseek_v2", "live", "bf16", "dummy")}


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
    if family == "tied_head":  # what deltasync.testing writes for a tied model: lm_head.weight stored too
        from deltasync.testing import save_model_dir, tiny_qwen3

        model = tiny_qwen3(hidden_size=128, layers=2, vocab_size=VOCAB, tie=True, seed=seed)
        _spread(model)
        return save_model_dir(model, out)
    if family in ("deepseek_v3", "deepseek_v3_bf16_bias"):  # Kimi-K2's architecture: noaux_tc routing, MLA + q_lora
        model = tf.DeepseekV3ForCausalLM(tf.DeepseekV3Config(
            intermediate_size=256, moe_intermediate_size=64, n_routed_experts=4, n_shared_experts=1,
            first_k_dense_replace=1, kv_lora_rank=512, q_lora_rank=96, qk_rope_head_dim=64, qk_nope_head_dim=64,
            v_head_dim=64, n_group=1, topk_group=1, topk_method="noaux_tc", scoring_func="sigmoid",
            routed_scaling_factor=2.5, **experts, **common))
        model = model.to(torch.bfloat16)
        _spread(model)
        for module in model.modules():
            bias = getattr(module, "e_score_correction_bias", None)
            if isinstance(bias, torch.Tensor):
                # the published checkpoints store it in fp32 (transformers keeps it so); the other variant in bf16,
                # as a trainer that publishes every tensor in bf16 does: vLLM then widens it into its fp32 parameter
                dtype = torch.bfloat16 if family.endswith("_bf16_bias") else torch.float32
                module.e_score_correction_bias = (torch.randn(bias.shape) * 0.1).to(dtype)
        model.save_pretrained(out)
        save_tokenizer(out)
        return out
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
    elif family == "gpt_oss":
        model = tf.GptOssForCausalLM(tf.GptOssConfig(
            head_dim=64, intermediate_size=64, num_local_experts=4, sliding_window=128,
            **experts, **common))
    elif family == "qwen3_next":
        model = tf.Qwen3NextForCausalLM(tf.Qwen3NextConfig(
            head_dim=64, intermediate_size=256, moe_intermediate_size=64, shared_expert_intermediate_size=64,
            num_experts=4, linear_conv_kernel_dim=4, linear_key_head_dim=64, linear_value_head_dim=64,
            linear_num_key_heads=2, linear_num_value_heads=4, layer_types=["linear_attention", "full_attention"],
            **experts, **common))
    elif family == "deepseek_v2":
        model = tf.DeepseekV2ForCausalLM(tf.DeepseekV2Config(
            intermediate_size=256, moe_intermediate_size=64, n_routed_experts=4, n_shared_experts=1,
            first_k_dense_replace=1, kv_lora_rank=512, q_lora_rank=None, qk_rope_head_dim=64, qk_nope_head_dim=64,
            v_head_dim=64, n_group=1, topk_group=1, **experts, **common))
    else:
        raise ValueError(f"unknown family {family!r}; known: {FAMILIES}")
    model = model.to(torch.bfloat16)
    _spread(model)
    model.save_pretrained(out)
    save_tokenizer(out)
    return out


def _spread(model: torch.nn.Module) -> None:
    with torch.no_grad():
        for p in model.parameters():
            if p.ndim == 1:  # norms start at exactly 1 or 0: make them differ
                p.add_(torch.randn_like(p) * 0.2)


# The support matrix docs/MODELS.md shows: one row per verified configuration, each the parameters of a test
# (tests/test_models_doc.py checks that the document shows exactly this table).
SHADOW_EXPERTS = "experts shadowed (CPU prepack)"
MATRIX: list[dict[str, str]] = [
    *({"family": f, "tp": "1", "ep": "-", "dtype": "bf16", "kernels": "live",
       "path": {"llama": "in place", "gemma": "in place (tied head: nothing to do)",
                "phi3": "in place (fused q/k/v and gate/up checkpoint: routed in pieces)",
                "qwen3_moe": f"in place; {SHADOW_EXPERTS}", "mixtral": f"in place; {SHADOW_EXPERTS}",
                "deepseek_v2": f"in place (MLA W_UK_T/W_UV share kv_b_proj); {SHADOW_EXPERTS}",
                "deepseek_v3": "in place (MLA with q_lora; the fp32 router bias the router and the experts share: "
                               f"in place, the experts' reload does not load it); {SHADOW_EXPERTS}",
                "gpt_oss": "in place (attention sinks, biases); experts [E, H, 2I] routed through the loader's "
                           f"permute into w13 [E, 2I, H]; {SHADOW_EXPERTS}",
                "qwen3_next": "in place (gated DeltaNet); A_log widened to fp32 by the loader: a bf16 host copy, "
                              f"converted into the parameter after each write; {SHADOW_EXPERTS}",
                "tied_head": "in place; lm_head.weight stored in a tied checkpoint: discarded by the engine, "
                             "checked against embed_tokens"}[f],
       "test": _test(f, "live", "bf16")}
      for f in FAMILIES),
    {"family": "llama", "tp": "1", "ep": "-", "dtype": "fp8 engine, bf16 stream", "kernels": "live",
     "path": "linears shadowed: vLLM re-quantizes them (float8 weights, scales) from host copies",
     "test": _test("llama", "live", "fp8")},
    {"family": "llama", "tp": "1", "ep": "-", "dtype": "fp8 engine, FP8 stream (per tensor)", "kernels": "live",
     "path": "in place: the FP8 weights and scales the trainer quantized with vLLM's functions (docs/FORMAT.md "
             "section 7), no host copy",
     "test": "test_vllm_fp8::test_fp8_engine_follows_its_fp8_representation_in_place_bit_exact (a delta, an anchor, "
             "a delta; the refusals)"},
    *({"family": "llama", "tp": "1", "ep": "-", "dtype": f"fp8 engine, FP8 stream ({scheme})", "kernels": "live",
       "path": "in place, compared after a delta on a delta and after an anchor" + extra,
       "test": f"test_vllm_fp8::test_fp8_stream_at_every_kind_of_step_and_its_replay_loads[{q}]{OUTSIDE_CI_NOTE}"}
      for scheme, q, extra in (("per tensor", "fp8", "; the replayed FP8 step loads in vLLM as an FP8 checkpoint"),
                               ("per channel", "fp8_per_channel", ""))),
    *({"family": f, "tp": "1", "ep": "-", "dtype": "bf16", "kernels": "stock",
       "path": "linears and experts shadowed (CPU repack/prepack)",
       "test": _test(f, "stock", "bf16")}
      for f in MOE),
    {"family": "qwen3_moe", "tp": "2", "ep": "-", "dtype": "bf16", "kernels": "live",
     "path": f"in place, each rank its slices; {SHADOW_EXPERTS}",
     "test": "test_vllm_models::test_moe_tensor_parallel_2_bit_exact_against_a_fresh_engine (outside CI: "
             "`./run.sh test -m outside_ci`)"},
    {"family": "deepseek_v3 (router bias in bf16), gpt_oss, tied_head", "tp": "1", "ep": "-", "dtype": "bf16",
     "kernels": "live",
     "path": "one delta each: the router bias two modules share, widened into fp32 (host copy, converted); the "
             "permuted experts; the stored tied head (carried as a second tensor) checked, never written; a module "
             "whose loader computes its weight (no element map) re-loaded through vLLM",
     "test": "test_vllm_models::test_round_2_mechanisms_follow_a_delta_bit_exact (in CI: the sibling of the "
             "deepseek_v3, gpt_oss, qwen3_next and tied_head rows)"},
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


def poisoned_markdown() -> str:
    """The poisoned-start table docs/MODELS.md holds: a row per family case, a column per kind of random start
    (bit-equal to a fresh engine after the first update, in CI or outside it), and the test's parameters."""
    test = "test_vllm_poisoned_start::test_a_random_start_told_no_step_is_healed_by_the_anchor"
    rows = ["| family | kernels | dtype | random checkpoint | `load_format=\"dummy\"` | test |",
            "|---|---|---|---|---|---|"]
    for family, kernels, served in FAMILY_CASES:
        cells = [f"bit-equal ({'CI' if (family, kernels, served, start) in POISONED_IN_CI else 'outside CI'})"
                 for start in STARTS]
        dtype = "fp8 engine, bf16 stream" if served == "fp8" else served
        case = f"{family}-{kernels}-{served}-{{{','.join(STARTS)}}}"
        rows.append(f"| {family} | {kernels} | {dtype} | {' | '.join(cells)} | {test}[{case}] |")
    return "\n".join(rows) + "\n"


if __name__ == "__main__":
    print(matrix_markdown())
    print(poisoned_markdown(), end="")
