"""GPU benchmark (issue 22): the device path of diff, transfer and apply, against plain copies on the same card.

    python bench/bench_gpu.py [--shape auto|tiny|1.7b|8b ...] [--steps 4] [--lr 1e-6]
    python bench/bench_gpu.py --device cpu --shape tiny       # the same code on CPU tensors, in seconds

Builds Qwen3-shaped weights (plain tensors, no model code) sized to the device's memory: fp32 master weights
on the device, the trainer's last-published bf16 copy (``Snapshot(dtype=bf16)``, on the device) and an engine's
bf16 parameters on the device. Each step adds lr x N(0, 1) to the masters (an Adam-sized update: ~1-3% of the
bf16 weights change) and measures, with the device synchronized around each timing:
  copy          a plain device copy of all bf16 weights (the reference every ratio divides by);
  diff, no change   the device diff of two equal models (its fixed cost);
  diff          diff on the device + compaction + one device-to-host transfer (``Snapshot.diff``);
  encode        the host encode into a step object (tmpfs);
  decode        the host decode of that object;
  scatter       one host-to-device transfer of all positions and xor + the in-place XOR into the engine's
                parameters (``xor_apply_many``, checksum off: the sealed write of an engine's pause); also with
                the checksum change (``apply_staged``'s device path) and, where Triton runs, one launch per width;
  full reload   a copy of a pinned host state dict into the engine's parameters (what vLLM's reload of the same
                step costs at minimum).
After every step the engine's bits must equal the masters' bf16 cast; any mismatch exits 1. Prints a table
of ratios and writes bench/results/gpu-<shape>-<date>.json.
"""

from __future__ import annotations

import os
import statistics
import sys
import tempfile
import time
from importlib.util import find_spec
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench._common import parser, write_results  # noqa: E402
from deltasync.format._bits import int_view  # noqa: E402
from deltasync.format.objects import StepObject  # noqa: E402
from deltasync.publish.steps import snapshot_headers, write_step  # noqa: E402
from deltasync.stages._device import diff_device, xor_apply_many  # noqa: E402
from deltasync.stages.diff import Snapshot  # noqa: E402

# Qwen3 configurations: hidden, intermediate, layers, heads, kv heads, head dim, vocab, tied embeddings
SHAPES = {
    "tiny": (64, 192, 2, 2, 1, 32, 512, False),
    "1.7b": (2048, 6144, 28, 16, 8, 128, 151936, True),
    "8b": (4096, 12288, 36, 32, 8, 128, 151936, False),
}
BYTES_PER_PARAM = 8.8  # fp32 master + bf16 snapshot + bf16 engine + headroom for the step's temporaries


def qwen3_shapes(name: str) -> dict[str, tuple[int, ...]]:
    hidden, inter, layers, heads, kv, hd, vocab, tied = SHAPES[name]
    out: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (vocab, hidden)}
    for i in range(layers):
        p = f"model.layers.{i}."
        out.update({
            p + "self_attn.q_proj.weight": (heads * hd, hidden), p + "self_attn.k_proj.weight": (kv * hd, hidden),
            p + "self_attn.v_proj.weight": (kv * hd, hidden), p + "self_attn.o_proj.weight": (hidden, heads * hd),
            p + "self_attn.q_norm.weight": (hd,), p + "self_attn.k_norm.weight": (hd,),
            p + "mlp.gate_proj.weight": (inter, hidden), p + "mlp.up_proj.weight": (inter, hidden),
            p + "mlp.down_proj.weight": (hidden, inter),
            p + "input_layernorm.weight": (hidden,), p + "post_attention_layernorm.weight": (hidden,),
        })
    out["model.norm.weight"] = (hidden,)
    if not tied:
        out["lm_head.weight"] = (vocab, hidden)
    return out


def numel(shapes: dict[str, tuple[int, ...]]) -> int:
    return sum(torch.Size(s).numel() for s in shapes.values())


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(device: torch.device, fn, repeats: int = 1) -> tuple[float, object]:
    """Best wall time of ``fn`` over ``repeats``, the device synchronized before and after; and its last result."""
    best, out = float("inf"), None
    for _ in range(repeats):
        sync(device)
        t0 = time.perf_counter()
        out = fn()
        sync(device)
        best = min(best, time.perf_counter() - t0)
    return best, out


def mismatches(engine: dict[str, torch.Tensor], masters: dict[str, torch.Tensor]) -> list[str]:
    return [n for n, t in engine.items() if not torch.equal(int_view(t), int_view(masters[n].to(torch.bfloat16)))]


def run_shape(shape: str, args, device: torch.device) -> dict:
    shapes = qwen3_shapes(shape)
    n_params = numel(shapes)
    gen = torch.Generator(device=device).manual_seed(0)
    masters = {}
    for n, s in shapes.items():
        masters[n] = (torch.ones(s, device=device) if len(s) == 1 else
                      0.02 * torch.randn(s, device=device, generator=gen))
    snap = Snapshot(masters, dtype=torch.bfloat16)  # the trainer's last-published copy, on the device
    engine = {n: t.clone() for n, t in snap.tensors.items()}  # the engine's parameters, at the same step
    model_bytes = 2 * n_params
    print(f"{shape}: {n_params / 1e6:.1f}M parameters, {len(shapes)} tensors, bf16 model {model_bytes / 2**30:.2f} GiB",
          flush=True)
    tmp = Path(tempfile.mkdtemp(prefix="deltasync-bench-gpu-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None))
    triton_ok = (device.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1") and bool(find_spec("triton"))
    rows, bad = [], []

    def copy_all() -> None:
        for n, t in engine.items():
            t.copy_(snap.tensors[n])

    for step in range(args.steps + 1):  # step 0 warms every path up (allocator, kernels, pinned blocks); not counted
        with torch.no_grad():
            for t in masters.values():
                t.add_(torch.randn(t.shape, device=device, generator=gen), alpha=args.lr)
        row: dict = {"step": step}
        row["copy_s"], _ = timed(device, copy_all, repeats=3)
        items = [(n, t, int_view(engine[n]), 0) for n, t in snap.tensors.items()]
        row["diff_no_change_s"], _ = timed(device, lambda: diff_device(items, step_elems=1 << 25))  # noqa: B023 - timed() calls it at once
        row["diff_s"], changes = timed(device, lambda: snap.diff(masters))
        changes = [c for c in changes if c.changed]
        path = tmp / f"{step}.safetensors"
        row["encode_s"], _ = timed(device, lambda: write_step(path, kind="delta", step=step + 1, base_step=step,  # noqa: B023 - timed() calls it at once
                                                             headers=snapshot_headers(snap), changes=changes))  # noqa: B023 - timed() calls it at once
        row["decode_s"], patches = timed(device, lambda: StepObject(path, where=f"step {step}").patches())  # noqa: B023 - timed() calls it at once
        batch = [(int_view(engine[p.name]), p.positions, p.xor, None) for p in patches]
        row["scatter_s"], _ = timed(device, lambda: xor_apply_many(batch, checksum=False))  # noqa: B023 - timed() calls it at once
        # XOR undoes itself: apply, undo and redo give three timings over the same bits
        row["scatter_checksum_s"], _ = timed(device, lambda: xor_apply_many(batch, checksum=True))  # noqa: B023 - timed() calls it at once
        row["scatter_checksum_s"] = min(row["scatter_checksum_s"], timed(device, lambda: xor_apply_many(batch))[0])  # noqa: B023 - timed() calls it at once
        if triton_ok:
            undo, _ = timed(device, lambda: xor_apply_many(batch, checksum=False, scatter="triton"))  # noqa: B023 - timed() calls it at once
            redo, _ = timed(device, lambda: xor_apply_many(batch, checksum=False, scatter="triton"))  # noqa: B023 - timed() calls it at once
            row["scatter_triton_s"] = min(undo, redo)
        changed = sum(c.changed for c in changes)
        row.update(changed=changed, density=changed / n_params, bytes=path.stat().st_size)
        path.unlink()
        wrong = mismatches(engine, masters)
        row["exact"] = not wrong
        bad += wrong
        rows.append(row)
        print(f"  step {step}: density {row['density']:.2%}, {row['bytes'] / 1e6:.1f} MB, copy "
              f"{row['copy_s'] * 1e3:.2f} ms, "
              f"diff {row['diff_s'] * 1e3:.1f} ms, scatter {row['scatter_s'] * 1e3:.2f} ms, "
              f"{'bit-exact' if not wrong else 'MISMATCH ' + str(wrong[:3])}", flush=True)
    host = {n: t.to("cpu") for n, t in engine.items()}
    if device.type == "cuda":
        host = {n: t.pin_memory() for n, t in host.items()}

    def reload() -> None:
        for n, t in engine.items():
            t.copy_(host[n], non_blocking=True)

    reload_s, _ = timed(device, reload, repeats=3)
    bad += mismatches(engine, masters)
    os.rmdir(tmp)
    measured = rows[1:] or rows
    med = {k: statistics.median(r[k] for r in measured) for k in measured[0] if k.endswith("_s")}
    med.update(density=statistics.median(r["density"] for r in measured),
               bytes=statistics.median(r["bytes"] for r in measured))
    return {"shape": shape, "params": n_params, "tensors": len(shapes), "model_bytes": model_bytes,
            "reload_s": reload_s, "medians": med, "rows": rows, "exact": not bad, "mismatched": sorted(set(bad))[:20]}


def print_table(r: dict) -> None:
    m, copy = r["medians"], r["medians"]["copy_s"]
    lines = [
        ("plain device copy of all weights", copy),
        ("diff of no change", m["diff_no_change_s"]),
        ("diff + compact + D2H (Snapshot.diff)", m["diff_s"]),
        ("diff + D2H + encode", m["diff_s"] + m["encode_s"]),
        ("decode (host)", m["decode_s"]),
        ("H2D + scatter (sealed pause)", m["scatter_s"]),
        ("H2D + scatter + checksum", m["scatter_checksum_s"]),
        ("decode + H2D + scatter + checksum", m["decode_s"] + m["scatter_checksum_s"]),
    ]
    if "scatter_triton_s" in m:
        lines.append(("H2D + scatter, Triton (1 launch/width)", m["scatter_triton_s"]))
    lines.append(("full reload (pinned host -> params)", r["reload_s"]))
    print(f"\n{r['shape']}: {r['params'] / 1e6:.1f}M params, median density {m['density']:.2%}, "
          f"{m['bytes'] / 1e6:.1f} MB/step vs {r['model_bytes'] / 1e6:.0f} MB bf16")
    print(f"{'measure':<42}{'ms':>10}{'x copy':>9}")
    for name, s in lines:
        print(f"{name:<42}{s * 1e3:>10.2f}{s / copy:>9.2f}")
    print(f"{'pause / full reload':<42}{'':>10}{m['scatter_s'] / r['reload_s']:>9.3f}")


def main() -> int:
    ap = parser(__doc__, steps=4)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--shape", nargs="+", default=["auto"], choices=["auto", *SHAPES])
    args = ap.parse_args()
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("no CUDA device: use --device cpu --shape tiny to try the script", file=sys.stderr)
        return 2
    card = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    shapes = args.shape
    if shapes == ["auto"]:
        mem = torch.cuda.get_device_properties(device).total_memory if device.type == "cuda" else 8 << 30
        shapes = [s for s in ("1.7b", "8b") if numel(qwen3_shapes(s)) * BYTES_PER_PARAM <= 0.95 * mem] or ["tiny"]
    print(f"device: {card} (torch {torch.__version__}); shapes {shapes}", flush=True)
    results = []
    for shape in shapes:
        r = run_shape(shape, args, device)
        results.append(r)
        print_table(r)
        if device.type == "cuda":
            torch.cuda.empty_cache()
    ok = all(r["exact"] for r in results)
    write_results(args, f"gpu-{'-'.join(shapes)}",
                  {"card": card, "torch": torch.__version__, "results": results, "ok": ok})
    print(f"{card}: {'every step bit-exact' if ok else 'MISMATCH: ' + str([r['mismatched'] for r in results])}")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
