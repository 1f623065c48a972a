"""vLLM benchmark: generation-paused time per step and publish-to-live latency, against a full reload.

    .venv/bin/python bench/bench_vllm.py [--steps 10] [--hidden 768 --layers 12]

Trains a Qwen3-shaped model (>= 100M parameters, AdamW, lr 1e-6) and publishes every step as bf16 to a
local store; a real vLLM engine (CPU, in-process, live weights) follows it with a Follower thread.
Per step: how long the engine was held (decode + in-place apply + prefix-cache reset + checksums of the
changed tensors), and publish() returning -> step live in the engine. Baseline in the same run: a full
reload of the same step's checkpoint through vLLM's reload_weights. Prints a table, writes JSON.
"""

from __future__ import annotations

import atexit
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench._common import machine, parser, write_results
from deltasync import DeltaPublisher
from deltasync.publish.steps import snapshot_headers, write_step
from deltasync.stages.diff import Snapshot
from deltasync_cli.demo import save_model_dir, stdlib_corpus, tiny_qwen3
from rollout_loader import Follower
from rollout_loader.vllm import VllmTarget, start_engine


def main() -> None:
    args = parser(__doc__, steps=10).parse_args()
    work = Path(tempfile.mkdtemp(prefix="deltasync-bench-vllm-"))
    atexit.register(shutil.rmtree, work, True)  # removed at exit, on success, error or Ctrl-C
    model = tiny_qwen3(hidden_size=args.hidden, layers=args.layers, vocab_size=args.vocab).float()
    numel = sum(p.numel() for p in model.parameters())
    print(f"model: {numel / 1e6:.1f}M parameters; machine: {machine()}")
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    data = stdlib_corpus()
    g = torch.Generator().manual_seed(0)
    model_dir = save_model_dir(model, work / "step0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    llm = start_engine(model_dir, in_process=True, dtype="bfloat16", enforce_eager=True, max_model_len=256)
    target = VllmTarget(llm, step=0)  # the engine starts from step 0's weights
    live: dict[int, float] = {}
    url = str(work / "stream")
    rows = []
    with DeltaPublisher(url, model, dtype=torch.bfloat16, anchor_every=1000) as pub:
        pub.publish(0)
        pub.flush()
        follower = Follower(url, target, poll_s=0.01, on_step=lambda s: live.setdefault(s, time.perf_counter()))
        follower.start()
        follower.wait_for(0)
        for step in range(1, args.steps + 1):
            starts = torch.randint(0, data.numel() - 65, (2,), generator=g)
            batch = torch.stack([data[s : s + 65] for s in starts])
            model(input_ids=batch[:, :-1], labels=batch[:, 1:]).loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            pub.publish(step)
            t_pub = time.perf_counter()
            follower.wait_for(step, timeout_s=300)
            paused = target.pauses_s[-1]
            m = pub.metrics[-1] if pub.metrics and pub.metrics[-1].step == step else None
            # baseline, same run, same step: a full reload of this step's checkpoint through vLLM
            # (the same step as an anchor object: a safetensors checkpoint with deltasync's header, which the
            # worker loads through vLLM's reload path)
            ckpt = work / "full.safetensors"
            bf16 = {k: v.detach().to(torch.bfloat16).contiguous() for k, v in model.state_dict().items()
                    if not (model.config.tie_word_embeddings and k == "lm_head.weight")}
            write_step(ckpt, kind="anchor", step=step, base_step=None, headers=snapshot_headers(Snapshot(bf16)),
                       anchor_tensors=bf16)
            reply = target.engine.rpc("deltasync_load", str(ckpt), "auto")[0]
            target.checksums()  # re-seed incremental verification after the reload (not timed)
            rows.append({
                "step": step,
                "density": m.density if m else None,
                "object_bytes": m.object_bytes if m else None,
                "paused_s": paused,
                "live_after_publish_s": live[step] - t_pub,
                "full_reload_s": reply["reload_s"],
            })
            r = rows[-1]
            print(f"step {step:3d}: density {r['density']:.2%}  paused {paused * 1e3:.0f} ms  "
                  f"live +{r['live_after_publish_s'] * 1e3:.0f} ms  full reload {r['full_reload_s'] * 1e3:.0f} ms "
                  f"({paused / r['full_reload_s']:.1%})", flush=True)
        follower.close()

    from rich.console import Console
    from rich.table import Table

    med = {k: float(np.median([r[k] for r in rows])) for k in ("paused_s", "live_after_publish_s", "full_reload_s", "density")}
    t = Table(title=f"vLLM CPU engine following a stream: {numel / 1e6:.0f}M params, {len(rows)} steps, "
              f"median density {med['density']:.2%} (medians over steps)")
    for col in ("measure", "ms", "target"):
        t.add_column(col, justify="right")
    t.add_row("generation paused per step", f"{med['paused_s'] * 1e3:.0f}", "<= 10% of full reload")
    t.add_row("full reload through vLLM (same step)", f"{med['full_reload_s'] * 1e3:.0f}", "")
    t.add_row("paused / full reload", f"{med['paused_s'] / med['full_reload_s']:.1%}", "<= 10%")
    t.add_row("publish() returned -> live in engine", f"{med['live_after_publish_s'] * 1e3:.0f}", "<= 1000")
    Console(width=120).print(t)
    write_results(args, "vllm", {"numel": numel, "rows": rows})


if __name__ == "__main__":
    main()
