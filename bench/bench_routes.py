"""Route-table build for the largest MoE models, from their configs on the meta device (no weights).

    .venv/bin/python bench/bench_routes.py [--models qwen3-235b-a22b kimi-k2 gpt-oss-120b]

For each model: the vLLM model is built on the meta device from the model's published config (tensor
parallelism 1, this process's own one-rank group), its checkpoint tensor list is what ``save_pretrained`` writes
for the transformers model of the same config (one tensor per expert; built on meta too), and the deltasync
routing table is learned from vLLM's loader exactly as the engine does at init (``trace_loader`` +
``build_routing_table``). Reports the build time (trace and table apart), the Python heap the build allocated
(tracemalloc peak), the table's size pickled, and how many tensors and pieces it routes. Baseline in the same
run: building the vLLM model itself on meta (what any engine start pays before loading a byte). Timings come from a run
without tracemalloc; the heap figure from a second run under it.
"""

from __future__ import annotations

import json
import math
import os
import pickle
import sys
import tempfile
import time
import tracemalloc
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench._common import _Parser, write_results  # noqa: E402

# the published configs (config.json on the Hugging Face Hub), the fields vLLM and transformers read
CONFIGS = {
    "qwen3-235b-a22b": {
        "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "hidden_size": 4096,
        "intermediate_size": 12288, "moe_intermediate_size": 1536, "num_hidden_layers": 94,
        "num_attention_heads": 64, "num_key_value_heads": 4, "head_dim": 128, "num_experts": 128,
        "num_experts_per_tok": 8, "decoder_sparse_step": 1, "mlp_only_layers": [], "norm_topk_prob": True,
        "vocab_size": 151936, "max_position_embeddings": 40960, "rope_theta": 1000000.0, "rms_norm_eps": 1e-6,
        "tie_word_embeddings": False, "torch_dtype": "bfloat16", "hidden_act": "silu",
    },
    "kimi-k2": {
        "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "hidden_size": 7168,
        "intermediate_size": 18432, "moe_intermediate_size": 2048, "num_hidden_layers": 61,
        "num_attention_heads": 64, "num_key_value_heads": 64, "n_routed_experts": 384, "n_shared_experts": 1,
        "num_experts_per_tok": 8, "first_k_dense_replace": 1, "moe_layer_freq": 1, "n_group": 1, "topk_group": 1,
        "routed_scaling_factor": 2.827, "scoring_func": "sigmoid", "topk_method": "noaux_tc", "norm_topk_prob": True,
        "q_lora_rank": 1536, "kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
        "v_head_dim": 128, "vocab_size": 163840, "max_position_embeddings": 131072, "rope_theta": 50000.0,
        "rms_norm_eps": 1e-6, "tie_word_embeddings": False, "torch_dtype": "bfloat16", "hidden_act": "silu",
        "num_nextn_predict_layers": 0,
    },
    # bf16 (the published checkpoint is MXFP4; a bf16 trainer publishes bf16): experts stored fused [E, H, 2I],
    # which vLLM's loader permutes into w13 [E, 2I, H]
    "gpt-oss-120b": {
        "architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss", "hidden_size": 2880,
        "intermediate_size": 2880, "num_hidden_layers": 36, "num_attention_heads": 64, "num_key_value_heads": 8,
        "head_dim": 64, "num_local_experts": 128, "num_experts_per_tok": 4, "experts_per_token": 4,
        "vocab_size": 201088, "max_position_embeddings": 131072, "sliding_window": 128,
        "layer_types": ["sliding_attention", "full_attention"] * 18, "rms_norm_eps": 1e-5, "swiglu_limit": 7.0,
        "rope_theta": 150000, "rope_scaling": {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0,
                                               "beta_slow": 1.0, "truncate": False,
                                               "original_max_position_embeddings": 4096},
        "attention_bias": True, "tie_word_embeddings": False, "torch_dtype": "bfloat16", "hidden_act": "silu",
    },
}
DEFAULT_MODELS = ["qwen3-235b-a22b", "kimi-k2"]


def checkpoint_layout(folder: Path) -> tuple[dict[str, list[int]], dict]:
    """Names and shapes ``save_pretrained`` writes for the transformers model of this config (built on meta)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.core_model_loading import revert_weight_conversion

    cfg = AutoConfig.from_pretrained(folder)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    sd = revert_weight_conversion(model, model.state_dict())
    # what from_pretrained keeps in fp32 (DeepSeek-V3's e_score_correction_bias), the published checkpoints store so
    fp32 = tuple(getattr(model, "_keep_in_fp32_modules_strict", None) or ())
    return ({n: list(t.shape) for n, t in sd.items()},
            {n: torch.float32 if any(k in n for k in fp32) else t.dtype for n, t in sd.items()})


def vllm_model_on_meta(folder: Path):
    import torch
    from vllm.config import set_current_vllm_config
    from vllm.distributed import ensure_model_parallel_initialized, init_distributed_environment
    from vllm.engine.arg_utils import EngineArgs
    from vllm.model_executor.model_loader.utils import initialize_model
    from vllm.utils.torch_utils import set_default_torch_dtype

    config = EngineArgs(model=str(folder), skip_tokenizer_init=True, dtype="bfloat16", enforce_eager=True,
                        max_model_len=4096, load_format="dummy").create_engine_config()
    with set_current_vllm_config(config):
        if not torch.distributed.is_initialized():
            port = 20000 + os.getpid() % 20000
            init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo",
                                         distributed_init_method=f"tcp://127.0.0.1:{port}")
            ensure_model_parallel_initialized(1, 1)
        with torch.device("meta"), set_default_torch_dtype(config.model_config.dtype):  # as vLLM's loader builds it
            return initialize_model(vllm_config=config)


def measure(name: str, work: Path) -> dict:
    from rollout_loader.routing import build_routing_table
    from rollout_loader.vllm.layout import param_owners
    from rollout_loader.vllm.trace import reloaded_attrs, tied_aliases, trace_loader

    folder = work / name
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(CONFIGS[name]))
    shapes, dtypes = checkpoint_layout(folder)
    t0 = time.perf_counter()
    model = vllm_model_on_meta(folder)
    build_s = time.perf_counter() - t0
    tied = tied_aliases(model)

    def build() -> tuple[Any, Any, float, float]:
        t1 = time.perf_counter()
        trace = trace_loader(model, shapes, dtypes)
        t2 = time.perf_counter()
        table = build_routing_table(shapes, trace.copies, {n: s for n, (s, _) in trace.params.items()},
                                    fills=trace.fills, problems=trace.problems, untraced=trace.untraced,
                                    reloadable=trace.reloadable, refused=trace.refused, unfed_ok=tied, tied=tied)
        return trace, table, t2 - t1, time.perf_counter() - t2

    trace, table, trace_s, table_s = build()  # timed as the engine runs it
    tracemalloc.start()  # again, for the Python heap it allocates (tracemalloc slows Python down: not timed)
    build()
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    pieces = sum(len(p) for p in table.routes.values())
    flat = [r for p in table.routes.values() for r in p]
    owners = param_owners(model)
    attrs = reloaded_attrs(model)
    shared = sorted(n for n, ms in owners.items() if len({m for m, _ in ms}) > 1 and n in trace.params)
    return {
        # the round-2 mechanisms on this model: pieces routed through a permute (axes), a reshape or step (grids), a
        # dtype conversion (casts); parameters held by several modules, and which of those modules' reloads load them
        "permuted_pieces": sum(bool(r.axes) for r in flat), "regridded_pieces": sum(bool(r.hf_grid or r.param_grid)
                                                                                   for r in flat),
        "converted_pieces": sum(bool(r.casts) for r in flat), "untraced_params": len(table.untraced),
        "discarded": len(table.discarded), "shared_params": len(shared),
        "shared_params_reloaded_by_an_owner": sum(any(a in attrs.get(m, ()) for m, a in owners[n]) for n in shared),
        "shared_example": shared[:1],
        "model": name, "checkpoint_tensors": len(shapes), "routed_tensors": len(table.routes), "pieces": pieces,
        "parameters": len(trace.params), "elements": sum(math.prod(s) for s in shapes.values()),
        "vllm_model_on_meta_s": round(build_s, 3), "trace_s": round(trace_s, 3), "table_s": round(table_s, 3),
        "routes_total_s": round(trace_s + table_s, 3), "heap_peak_mib": round(peak / 2**20, 1),
        "table_pickled_mib": round(len(pickle.dumps(dict(table.routes))) / 2**20, 2),
    }


def main() -> None:
    ap = _Parser(description=__doc__, formatter_class=__import__("argparse").RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", default=DEFAULT_MODELS, choices=list(CONFIGS))
    ap.add_argument("--out", default=str(Path(__file__).parent / "results"))
    args = ap.parse_args()
    rows = []
    with tempfile.TemporaryDirectory(prefix="deltasync-bench-routes-") as work:
        for name in args.models:
            rows.append(measure(name, Path(work)))
            r = rows[-1]
            print(f"{name}: {r['checkpoint_tensors']} checkpoint tensors ({r['elements'] / 1e9:.0f}B elements), "
                  f"{r['pieces']} pieces; routes in {r['routes_total_s']:.2f} s (trace {r['trace_s']:.2f} s, "
                  f"table {r['table_s']:.2f} s), heap peak {r['heap_peak_mib']} MiB, table {r['table_pickled_mib']} "
                  f"MiB pickled; vLLM model on meta {r['vllm_model_on_meta_s']:.2f} s; pieces permuted "
                  f"{r['permuted_pieces']}, regridded {r['regridded_pieces']}, converted {r['converted_pieces']}; "
                  f"untraced parameters {r['untraced_params']}; parameters with several owners "
                  f"{r['shared_params']} ({r['shared_params_reloaded_by_an_owner']} loaded by an owner's reload)",
                  flush=True)
    print("\n| model | checkpoint tensors | pieces | trace s | table s | heap peak MiB | table MiB | vLLM model on "
          "meta s |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['model']} | {r['checkpoint_tensors']} | {r['pieces']} | {r['trace_s']} | {r['table_s']} | "
              f"{r['heap_peak_mib']} | {r['table_pickled_mib']} | {r['vllm_model_on_meta_s']} |")
    write_results(args, "routes", {"rows": rows})


if __name__ == "__main__":
    main()
