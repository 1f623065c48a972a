"""Streaming publish benchmark: peak extra memory of publishing from a generator, today's way and streamed.

    .venv/bin/python bench/bench_stream_publish.py [--hidden 2048 --layers 24] [--density 0.02] [--anchor-every 3]

A model of ``layers`` square ``hidden`` x ``hidden`` linears (with biases) holds fp32 master weights; a
generator materialises each parameter on the fly as a fresh bf16 tensor, as an FSDP2 trainer's
``full_tensor()`` under a bf16 ``MixedPrecisionPolicy`` does (verl's per-tensor params, vLLM's
``ModuleSource``). Each step changes ``density`` of every weight's elements, then is published with
``dtype=torch.bfloat16`` and flushed (committed to a local store):
  today     ``current = dict(generator)``, then ``publish(step)`` from ``source=lambda: current`` (what an
            integration had to do: the dict is a second full model), the dict dropped after the commit;
  stream    ``publish(step, weights=generator)``: each tensor diffed as it arrives (deltasync/publish/stream.py).
Steps: 0 (the first anchor: the snapshot is built), 1 and 2 (deltas), 3 (an anchor with ``--anchor-every 3``:
today copies the snapshot to the host for the upload, a stream writes it from the snapshot itself).

Memory: each mode runs in a fresh process with ``MALLOC_MMAP_THRESHOLD_=65536`` (glibc gives every allocation
above 64 KiB its own mapping and returns it on free, so the resident set follows live memory instead of
freed blocks kept in the heap). Before each step the kernel's peak-RSS mark is reset (``/proc/self/clear_refs``
``5``); after the commit, ``VmHWM`` (the peak since) minus the RSS before the step is the step's extra peak.
tracemalloc cannot see torch's allocations, and sampling RSS from a thread can miss a short peak; the
kernel's mark cannot. The kernels are warmed and a tiny stream published first, so one-time costs (numba,
thread pools) are not counted; each snapshot's diff scratch (~20 MB per diff thread and width) is, in both
modes alike.

Prints a table and writes bench/results/stream-publish-<date>.json.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench._common import machine  # noqa: E402

MB = 1e6
STEPS = (0, 1, 2, 3)


def _status(field: str) -> int:
    """A ``/proc/self/status`` size in bytes (``VmRSS``, ``VmHWM``)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"/proc/self/status has no {field}")


def _reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM to the current RSS (Linux >= 4.0)


def child(mode: str, url: str, out: str, hidden: int, layers: int, density: float, anchor_every: int) -> None:
    """One mode's run in this (fresh) process; writes its rows to ``out``."""
    import torch

    from deltasync import DeltaPublisher
    from deltasync.engine import warm_kernels

    warm_kernels()
    with tempfile.TemporaryDirectory(prefix="deltasync-bench-warm-") as tmp:  # threads, pools, imports
        w = {"a": torch.randn(64, 64), "b": torch.randn(64)}
        with DeltaPublisher(str(Path(tmp) / "s"), w, dtype=torch.bfloat16, on_backlog="block") as pub:
            pub.publish(0)
            w["a"][0] += 1
            pub.publish(1)
        with DeltaPublisher(str(Path(tmp) / "t"), None, dtype=torch.bfloat16) as pub:
            pub.publish(0, weights=w.items())

    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(hidden, hidden) for _ in range(layers)])  # fp32 master weights
    params = dict(model.named_parameters())
    model_bytes = sum(p.numel() * 2 for p in params.values())  # as published (bf16)
    largest = max(p.numel() * 2 for p in params.values())
    gen = torch.Generator().manual_seed(1)

    def materialise():
        for name, p in params.items():
            yield name, p.detach().to(torch.bfloat16)  # a fresh tensor per parameter, as full_tensor() makes

    pub = DeltaPublisher(url, None if mode == "stream" else (lambda: current), dtype=torch.bfloat16,
                         anchor_every=anchor_every, on_backlog="block", lease_s=600)
    current: dict = {}
    rows = []
    for step in STEPS:
        if step:
            with torch.no_grad():
                for p in params.values():
                    flat = p.view(-1)
                    idx = torch.randint(0, flat.numel(), (max(1, int(density * flat.numel())),), generator=gen)
                    flat[idx] += flat[idx].abs().clamp_min(1e-2) * 0.05
        _reset_peak()
        rss0 = _status("VmRSS")
        t0 = time.perf_counter()
        if mode == "stream":
            pub.publish(step, weights=materialise())
        else:
            current = dict(materialise())
            pub.publish(step)
        pub.flush()
        current = {}
        seconds = time.perf_counter() - t0
        peak, rss1 = _status("VmHWM"), _status("VmRSS")
        m = pub.metrics[-1]
        rows.append({"mode": mode, "step": step, "kind": m.kind, "extra_peak_bytes": peak - rss0,
                     "kept_bytes": rss1 - rss0, "seconds": seconds, "changed": m.changed,
                     "object_bytes": m.object_bytes, "model_bytes": model_bytes, "largest_tensor_bytes": largest,
                     # the step's patches in the upload queue: int64 positions + bf16 xor bits per changed element
                     "patch_bytes": m.changed * 10 if m.kind == "delta" else None})
    pub.close()
    Path(out).write_text(json.dumps(rows))


def main() -> None:
    import argparse

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--density", type=float, default=0.02)
    ap.add_argument("--anchor-every", type=int, default=3)
    ap.add_argument("--out", default=str(Path(__file__).parent / "results"))
    args = ap.parse_args()
    rows = []
    with tempfile.TemporaryDirectory(prefix="deltasync-bench-stream-") as tmp:
        for mode in ("today", "stream"):
            out = str(Path(tmp) / f"{mode}.json")
            cmd = [sys.executable, __file__, "--child", mode, str(Path(tmp) / mode), out, str(args.hidden),
                   str(args.layers), str(args.density), str(args.anchor_every)]
            env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536"}
            subprocess.run(cmd, check=True, env=env)
            rows += json.loads(Path(out).read_text())
    first = rows[0]
    print(f"machine: {machine()}")
    print(f"model: {args.layers} x Linear({args.hidden}, {args.hidden}), {first['model_bytes'] / MB:.1f} MB as bf16, "
          f"largest tensor {first['largest_tensor_bytes'] / MB:.1f} MB; density {args.density}")
    print(f"{'mode':>6} {'step':>4} {'kind':>6} {'extra peak MB':>13} {'kept MB':>8} {'transient MB':>12} "
          f"{'x largest':>9} {'patches MB':>10} {'object MB':>9} {'s':>6}")
    by = {(r["mode"], r["step"]): r for r in rows}
    for r in rows:
        transient = r["extra_peak_bytes"] - max(0, r["kept_bytes"])
        print(f"{r['mode']:>6} {r['step']:>4} {r['kind']:>6} {r['extra_peak_bytes'] / MB:>13.1f} "
              f"{r['kept_bytes'] / MB:>8.1f} {transient / MB:>12.1f} {transient / r['largest_tensor_bytes']:>9.2f} "
              f"{'-' if r['patch_bytes'] is None else format(r['patch_bytes'] / MB, '.1f'):>10} "
              f"{r['object_bytes'] / MB:>9.1f} {r['seconds']:>6.2f}")
    print("stream / today, extra peak: " + ", ".join(
        f"step {s} {by[('stream', s)]['extra_peak_bytes'] / by[('today', s)]['extra_peak_bytes']:.2f}x"
        for s in STEPS))
    path = Path(args.out)
    path.mkdir(parents=True, exist_ok=True)
    import datetime as dt

    path = path / f"stream-publish-{dt.date.today().isoformat()}.json"
    path.write_text(json.dumps({"machine": machine(), "args": vars(args), "rows": rows}, indent=1))
    print(f"wrote {path}")


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        mode, url, out, hidden, layers, density, anchor_every = sys.argv[2:9]
        child(mode, url, out, int(hidden), int(layers), float(density), int(anchor_every))
    else:
        main()
