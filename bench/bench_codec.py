"""Codec benchmark: bytes and seconds per step on a real AdamW stream, against baselines in the same run.

    .venv/bin/python bench/bench_codec.py [--steps 10] [--lr 1e-6] [--hidden 768 --layers 12]

Trains a Qwen3-shaped model (fp32 master weights, >= 100M parameters) with AdamW on the Python standard
library's source; after each step the bf16 weights are diffed and encoded by deltasync and by three
baselines on the same change:
  full      a full bf16 checkpoint (safetensors);
  idx32     int32 indices + bf16 new values (TRL v1);
  gap16     uint16 gap-coded indices (uint32 for a tensor whose largest gap needs it) + bf16 values (TRL v3).
Reference time: one plain copy of all the model's tensors (copy_ into preallocated tensors), same run.
Floors, same run, for diff + encode: `compare` reads the weights and the snapshot once and only counts
the words that differ (the memory traffic any diff pays, on the same thread pool); `diff, no change` is
deltasync's diff of a step that changed nothing (its fixed cost: the scan and the per-tensor calls).
Prints a table and writes bench/results/codec-<date>.json.
"""

from __future__ import annotations

import atexit
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numba
import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench._common import Training, machine, parser, write_results
from deltasync.engine import warm_kernels
from deltasync.format.objects import StepObject
from deltasync.publish.names import named_tensors
from deltasync.publish.steps import snapshot_headers, write_step
from deltasync.stages.apply import Replica
from deltasync.stages.diff import Snapshot


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def plain_copy_s(tensors: dict[str, torch.Tensor], repeats: int = 3) -> float:
    dst = {n: torch.empty_like(t) for n, t in tensors.items()}
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        for n, t in tensors.items():
            dst[n].copy_(t)
        best = min(best, time.perf_counter() - t0)
    return best


def baseline_diff(old: dict[str, torch.Tensor], new: dict[str, torch.Tensor]):
    """Plain-torch diff as the baselines do it: changed indices and new values, per tensor."""
    out = {}
    for n, t in new.items():
        a, b = t.reshape(-1).view(torch.int16), old[n].reshape(-1).view(torch.int16)
        idx = (a != b).nonzero().squeeze(1)
        out[n] = (idx, a[idx])
    return out


def baseline_encode(d, kind: str) -> tuple[int, dict]:
    blobs = {}
    for n, (idx, val) in d.items():
        if idx.numel() == 0:
            continue
        if kind == "idx32":
            blobs[n] = (idx.to(torch.int32).numpy().tobytes(), val.numpy().tobytes())
        else:
            gaps = torch.diff(idx, prepend=torch.tensor([-1])) if idx.numel() else idx
            dtype = np.uint16 if int(gaps.max()) < 65536 else np.uint32
            blobs[n] = (gaps.numpy().astype(dtype).tobytes(), val.numpy().tobytes())
    return sum(len(a) + len(b) for a, b in blobs.values()), blobs


def baseline_apply(state: dict[str, torch.Tensor], blobs: dict, kind: str) -> None:
    for n, (ib, vb) in blobs.items():
        if kind == "idx32":
            idx = torch.from_numpy(np.frombuffer(ib, np.int32).astype(np.int64))
        else:
            dtype = np.uint16 if len(ib) == len(vb) else np.uint32
            idx = torch.from_numpy(np.frombuffer(ib, dtype).astype(np.int64)).cumsum(0) - 1
        vals = torch.from_numpy(np.frombuffer(vb, np.int16).copy())
        state[n].reshape(-1).view(torch.int16)[idx] = vals


@numba.njit(nogil=True, cache=True)
def _count_unequal(a: np.ndarray, b: np.ndarray) -> int:
    n = 0
    for i in range(a.size):
        n += a[i] != b[i]
    return n


def floors_s(snap: Snapshot, new: dict[str, torch.Tensor], repeats: int = 3) -> dict[str, float]:
    """The two floors of diff + encode (see the module doc), best of ``repeats``."""
    from deltasync.format._bits import np_bits, np_words
    from deltasync.threads import parallel_map

    pairs = [(np_words(np_bits(new[n]))[0], np_words(np_bits(t))[0]) for n, t in snap.tensors.items()]
    pairs = [(a, b) for a, b in pairs if a is not None and b is not None]
    _count_unequal(pairs[0][0][:8], pairs[0][1][:8])
    same = {n: t.clone() for n, t in snap.tensors.items()}
    best = {"compare_s": float("inf"), "diff_no_change_s": float("inf")}
    for _ in range(repeats):
        t0 = time.perf_counter()
        parallel_map(lambda ab: _count_unequal(*ab), pairs, cost=lambda ab: ab[0].size)
        t1 = time.perf_counter()
        snap.diff(same)
        t2 = time.perf_counter()
        best = {"compare_s": min(best["compare_s"], t1 - t0),
                "diff_no_change_s": min(best["diff_no_change_s"], t2 - t1)}
    return best


def main() -> None:
    ap = parser(__doc__, steps=10)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--batch", type=int, default=2)
    args = ap.parse_args()

    train = Training(args)
    model = train.model
    tensors, _ = named_tensors(model)
    bf16 = {n: t.to(torch.bfloat16) for n, t in tensors.items()}
    numel = sum(t.numel() for t in bf16.values())
    print(f"model: {numel / 1e6:.1f}M parameters ({len(bf16)} tensors), lr {args.lr}, machine: {machine()}")

    rss0 = rss_bytes()
    snap = Snapshot(bf16)
    snapshot_rss = rss_bytes() - rss0
    model_bytes = sum(t.numel() * t.element_size() for t in bf16.values())
    print(f"snapshot (last-published copy, host): {snapshot_rss / 1e6:.0f} MB resident for a {model_bytes / 1e6:.0f} "
          "MB bf16 model")
    copy_s = plain_copy_s(bf16)
    tmp = Path(tempfile.mkdtemp(prefix="deltasync-bench-"))
    atexit.register(shutil.rmtree, tmp, ignore_errors=True)  # nothing left behind, Ctrl-C included
    anchor = tmp / "anchor.safetensors"
    write_step(anchor, kind="anchor", step=0, base_step=None, headers=snapshot_headers(snap), anchor_tensors=bf16)
    full_bytes = anchor.stat().st_size
    replica = Replica.from_anchor(StepObject(anchor, where="anchor"))
    base_state = {n: t.clone() for n, t in bf16.items()}
    base_states = {"idx32": {n: t.clone() for n, t in bf16.items()}, "gap16": {n: t.clone() for n, t in bf16.items()}}

    rows = []
    # warm-up: load the compiled kernels from numba's cache (or compile them), outside the measurement
    warm_kernels()
    warm = {"w": torch.zeros(1 << 16, dtype=torch.bfloat16)}
    wsnap = Snapshot(warm)
    write_step(tmp / "w0", kind="anchor", step=0, base_step=None, headers=snapshot_headers(wsnap), anchor_tensors=warm)
    wrep = Replica.from_anchor(StepObject(tmp / "w0", where="warm-up"))
    warm["w"][::7] = 1
    wchanges = [c for c in wsnap.diff(warm) if c.changed]
    write_step(tmp / "w1", kind="delta", step=1, base_step=0, headers=snapshot_headers(wsnap), changes=wchanges)
    wrep.apply(StepObject(tmp / "w1", where="warm-up"))

    for step in range(1, args.steps + 1):
        train.step(seq=args.seq, batch=args.batch)
        new = {n: t.to(torch.bfloat16) for n, t in tensors.items()}  # what the trainer would serve
        copy_s = min(copy_s, plain_copy_s(new, repeats=1))

        t0 = time.perf_counter()
        changes = [c for c in snap.diff(new) if c.changed]
        t1 = time.perf_counter()
        path = tmp / f"{step}.safetensors"
        write_step(path, kind="delta", step=step, base_step=step - 1, headers=snapshot_headers(snap), changes=changes)
        t2 = time.perf_counter()
        obj = StepObject(path, where=f"step {step}")
        replica.apply(obj, verify="incremental")
        t3 = time.perf_counter()
        assert all(torch.equal(replica.tensors[n].view(torch.int16), new[n].view(torch.int16)) for n in new)
        changed = sum(c.changed for c in changes)
        row = {
            "step": step,
            "density": changed / numel,
            "changed": changed,
            "copy_s": copy_s,
            "deltasync": {
                "bytes": path.stat().st_size,
                "diff_s": t1 - t0,
                "encode_s": t2 - t1,
                "diff_encode_s": t2 - t0,
                "decode_apply_s": t3 - t2,
            },
            "full": {"bytes": full_bytes, "diff_encode_s": copy_s, "decode_apply_s": copy_s},
        }
        tb = time.perf_counter()
        bd = baseline_diff(base_state, new)
        tbd = time.perf_counter() - tb
        for kind in ("idx32", "gap16"):
            te = time.perf_counter()
            nbytes, blobs = baseline_encode(bd, kind)
            te = time.perf_counter() - te
            ta = time.perf_counter()
            baseline_apply(base_states[kind], blobs, kind)
            ta = time.perf_counter() - ta
            row[kind] = {"bytes": nbytes, "diff_encode_s": tbd + te, "decode_apply_s": ta}
        base_state = {n: t.clone() for n, t in new.items()}
        for k in ("deltasync", "full", "idx32", "gap16"):
            row[k]["bytes_per_changed"] = row[k]["bytes"] / changed if changed else float("nan")
        rows.append(row)
        d = row["deltasync"]
        print(
            f"step {step:3d}: density {row['density']:.2%}  {d['bytes_per_changed']:.2f} B/changed  "
            f"diff+encode {d['diff_encode_s'] * 1e3:.0f} ms ({d['diff_encode_s'] / copy_s:.1f}x copy)  "
            f"decode+apply {d['decode_apply_s'] * 1e3:.0f} ms ({d['decode_apply_s'] / copy_s:.1f}x copy)",
            flush=True,
        )

    from rich.console import Console
    from rich.table import Table

    def mean(key: str, field: str) -> float:
        """Median over steps: robust to another process stealing the CPU during one step."""
        return float(np.median([r[key][field] for r in rows]))

    table = Table(title=f"codec benchmark (medians over steps): {numel / 1e6:.0f}M params, {len(rows)} AdamW steps, lr "
                        f"{args.lr}, "
                  f"mean density {np.mean([r['density'] for r in rows]):.2%}; plain copy {copy_s * 1e3:.0f} ms")
    for col in ("encoding", "B/changed", "MB/step", "diff+encode ms", "x copy", "decode+apply ms", "x copy"):
        table.add_column(col, justify="right")
    for k in ("deltasync", "gap16", "idx32", "full"):
        table.add_row(
            k,
            f"{mean(k, 'bytes_per_changed'):.2f}",
            f"{mean(k, 'bytes') / 1e6:.2f}",
            f"{mean(k, 'diff_encode_s') * 1e3:.0f}",
            f"{mean(k, 'diff_encode_s') / copy_s:.2f}",
            f"{mean(k, 'decode_apply_s') * 1e3:.0f}",
            f"{mean(k, 'decode_apply_s') / copy_s:.2f}",
        )
    Console(width=140).print(table)
    floors = floors_s(snap, new)
    print("floors of diff + encode, same run (best of 3): "
          + ", ".join(f"{k.removesuffix('_s').replace('_', ' ')} {v * 1e3:.0f} ms = {v / copy_s:.2f}x copy"
                      for k, v in floors.items()))
    write_results(args, "codec", {
        "numel": numel, "copy_s": copy_s, "floors_s": floors, "model_bytes": model_bytes,
        "snapshot_rss_bytes": snapshot_rss,
        "rss_growth_after_run_bytes": rss_bytes() - rss0 - snapshot_rss, "rows": rows,
    })


if __name__ == "__main__":
    main()
