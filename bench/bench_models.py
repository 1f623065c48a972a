"""Model families in a live vLLM engine: pause and bytes per step, MoE and MLA against a dense model.

    .venv/bin/python bench/bench_models.py [--steps 5] [--families llama qwen3_moe deepseek_v2]

For each family a small random model of its real structure (transformers, from a config: hidden 512, 4 layers,
8 experts of 256 for the MoE ones) takes AdamW steps (lr 1e-6, on random gradients: what sets how many bf16
elements change is the update's size, not its direction) and every step is published as
bf16 to a local store. A real vLLM CPU engine (in-process, live CPU linear weights) follows it through the
deltasync weight-transfer engine. Per step: the pause (``start_weight_update`` to ``reset_prefix_cache``), the
object's bytes and the changed elements; baseline, same run, same step: vLLM's own full reload of the step's
replayed checkpoint (``reload_weights``). Per family: what the engine writes in place and what it shadows (host
copies of the checkpoint tensors feeding modules vLLM transforms after loading: the CPU-prepacked experts),
with the shadow's memory against the model's. Prints a table, writes JSON.
"""

from __future__ import annotations

import atexit
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench._common import _Parser, machine, write_results  # noqa: E402
from bench.bench_vllm import _full_reload, _update  # noqa: E402


def build(family: str) -> Any:
    """A transformers model of ``family`` at benchmark size (fp32 master weights)."""
    import transformers as tf

    torch.manual_seed(0)
    common = dict(vocab_size=4096, hidden_size=512, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4,
                  max_position_embeddings=1024, tie_word_embeddings=False, bos_token_id=None, eos_token_id=None,
                  pad_token_id=None)
    if family == "llama":
        return tf.LlamaForCausalLM(tf.LlamaConfig(head_dim=64, intermediate_size=2048, **common))
    if family == "qwen3_moe":
        return tf.Qwen3MoeForCausalLM(tf.Qwen3MoeConfig(head_dim=64, intermediate_size=2048, moe_intermediate_size=256,
                                                        num_experts=8, num_experts_per_tok=2, decoder_sparse_step=1,
                                                        **common))
    if family == "deepseek_v2":
        return tf.DeepseekV2ForCausalLM(tf.DeepseekV2Config(
            intermediate_size=2048, moe_intermediate_size=256, n_routed_experts=8, num_experts_per_tok=2,
            n_shared_experts=1, first_k_dense_replace=1, kv_lora_rank=512, q_lora_rank=None, qk_rope_head_dim=64,
            qk_nope_head_dim=64, v_head_dim=64, n_group=1, topk_group=1, **common))
    raise ValueError(family)


def run_family(family: str, steps: int, work: Path) -> dict[str, Any]:
    from deltasync import DeltaPublisher, replay_to_folder
    from rollout_loader.vllm import start_engine
    from tests.integration.conftest import save_tokenizer

    model = build(family)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-6)
    gen = torch.Generator().manual_seed(1)
    numel = sum(p.numel() for p in model.parameters())
    model_dir = work / family
    model.to(torch.bfloat16).save_pretrained(model_dir)
    model.float()
    save_tokenizer(model_dir)
    url = str(work / f"{family}-stream")
    llm = start_engine(str(model_dir), in_process=True, dtype="bfloat16", enforce_eager=True,
                       max_model_len=256)
    rows = []
    try:
        with DeltaPublisher(url, model, dtype=torch.bfloat16, anchor_every=1000, on_backlog="block") as pub:
            pub.publish(0)
            pub.flush()
            llm.init_weight_transfer_engine({"init_info": {"url": url, "step": 0}})
            engine = llm.collective_rpc(lambda worker: worker.weight_transfer_engine)[0]
            state = engine._state
            host_bytes = sum(t.numel() * t.element_size() for t in state.host.values())
            shadowed = sorted(state.feeds)
            for step in range(1, steps + 1):
                for p in model.parameters():  # AdamW on random gradients: the update's size (lr 1e-6) sets the density
                    p.grad = torch.randn(p.shape, generator=gen)
                opt.step()
                opt.zero_grad()
                pub.publish(step)
                pub.flush()
                deadline = time.monotonic() + 120
                while not engine.is_staged(step) and time.monotonic() < deadline:
                    time.sleep(0.002)
                times = _update(llm, step)
                assert engine.held_step == step
                m = next(x for x in pub.metrics if x.step == step)
                folder = work / f"{family}-replayed-{step}"
                replay_to_folder(url, step, str(folder))
                full_s = _full_reload(llm, folder)
                shutil.rmtree(folder)
                rows.append({"step": step, "paused_s": times["paused_s"], "write_s": engine.pause_parts[-1]["write"],
                             "full_reload_s": full_s, "object_bytes": m.object_bytes, "changed": m.changed,
                             "density": m.changed / numel})
    finally:
        del llm
        import gc

        gc.collect()
    med = {k: statistics.median(r[k] for r in rows) for k in ("paused_s", "write_s", "full_reload_s", "object_bytes",
                                                               "density")}
    return {"family": family, "parameters": numel, "model_bytes_bf16": 2 * numel, "shadowed_modules": len(shadowed),
            "shadow_host_bytes": host_bytes, "steps": rows, "median": med,
            "pause_vs_full_reload": med["paused_s"] / med["full_reload_s"],
            "bytes_per_changed_element": statistics.median(r["object_bytes"] / max(1, r["changed"]) for r in rows)}


def main() -> None:
    ap = _Parser(description=__doc__, formatter_class=__import__("argparse").RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--families", nargs="+", default=["llama", "qwen3_moe", "deepseek_v2"])
    ap.add_argument("--out", default=str(Path(__file__).parent / "results"))
    args = ap.parse_args()
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    work = Path(tempfile.mkdtemp(prefix="deltasync-bench-models-"))
    atexit.register(shutil.rmtree, work, True)
    print(f"machine: {machine()}")
    results = [run_family(f, args.steps, work) for f in args.families]
    print("\n| family | params | shadowed modules | shadow host MiB (model MiB) | pause ms | full reload ms | "
          "pause / reload | object KiB | B per changed element | density |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in results:
        m = r["median"]
        print(f"| {r['family']} | {r['parameters'] / 1e6:.1f}M | {r['shadowed_modules']} | "
              f"{r['shadow_host_bytes'] / 2**20:.1f} ({r['model_bytes_bf16'] / 2**20:.1f}) | {1e3 * m['paused_s']:.1f} "
              "| "
              f"{1e3 * m['full_reload_s']:.1f} | {r['pause_vs_full_reload']:.1%} | {m['object_bytes'] / 1024:.0f} | "
              f"{r['bytes_per_changed_element']:.2f} | {m['density']:.2%} |")
    write_results(args, "models", {"families": results})


if __name__ == "__main__":
    main()
