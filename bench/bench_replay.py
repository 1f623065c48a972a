"""Replay benchmark: the exact weights of step N from an anchor plus 20 deltas, against loading one full
checkpoint of the same model from the same store, same run.

    .venv/bin/python bench/bench_replay.py [--steps 20] [--repeats 3] [--hidden 768 --layers 12]

Trains a Qwen3-shaped model (>= 100M parameters, fp32 master weights, AdamW at lr 1e-6, published as
bf16) and publishes step 0 as an anchor and steps 1..N (N = --steps) as deltas to a local store; step N is also
published as a full checkpoint (an anchor) to a second stream in the same store. Each measurement runs in
a fresh process (after a warm-up that loads the compiled kernels), timing the call and sampling the
resident set (/proc/self/statm) every millisecond for its peak growth:
  full            reconstruct_state_dict of step N from the full checkpoint (SHA-256 + every checksum);
  replay          reconstruct_state_dict of step N from the anchor + N deltas (same checks, every step);
  replay-folder   replay_to_folder: the same, written as a checkpoint folder (what `deltasync replay` does);
  plain-load      safetensors.load_file of the full checkpoint, copied into memory, unverified (reference);
  replica         StreamReader.state_dict: the follower's path (Replica, delta by delta), once.
Targets: replay <= 2x the full load's time and <= 1.2x its peak memory. Prints a table, writes JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench._common import machine, parser, write_results  # noqa: E402

CASES = ("full", "replay", "replay-folder", "plain-load")


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class PeakRss:
    """Peak growth of the resident set while the block runs (a thread samples it every millisecond)."""

    def __enter__(self) -> PeakRss:
        self.base = self.peak = rss_bytes()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        self.t0 = time.perf_counter()
        return self

    def _sample(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, rss_bytes())
            time.sleep(0.001)

    def __exit__(self, *exc: object) -> None:
        self.seconds = time.perf_counter() - self.t0
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, rss_bytes())
        self.growth = self.peak - self.base


def measure(case: str, url: str, step: int, work: Path) -> dict:
    """One measurement, in this (fresh) process."""
    import safetensors.torch

    from deltasync import StreamReader, reconstruct_state_dict, replay_to_folder

    warm = work / "warm-up"  # compiled kernels, thread pools, imports: outside the measurement
    reconstruct_state_dict(str(warm), 1)
    out = work / f"out-{case}"
    shutil.rmtree(out, ignore_errors=True)
    held = None  # what the call returns stays in memory until the measurement ends
    with PeakRss() as m:
        if case in ("full", "replay"):
            held = reconstruct_state_dict(url, step)
        elif case == "replay-folder":
            replay_to_folder(url, step, out)
        elif case == "plain-load":
            path = StreamReader(url).store.fetch_object(StreamReader(url).manifest(step))
            held = {n: t.clone() for n, t in safetensors.torch.load_file(str(path)).items()}
        elif case == "replica":
            held = StreamReader(url).state_dict(step)
        else:
            raise ValueError(case)
    del held
    shutil.rmtree(out, ignore_errors=True)
    return {"case": case, "seconds": m.seconds, "peak_rss_growth_bytes": m.growth}


def run_case(case: str, url: str, step: int, work: Path) -> dict:
    cmd = [sys.executable, __file__, "--measure", case, "--url", url, "--step", str(step), "--work", str(work)]
    done = subprocess.run(cmd, check=True, capture_output=True, text=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def build_streams(args, work: Path) -> tuple[str, str, dict]:
    from deltasync import DeltaPublisher
    from deltasync_cli.demo import save_model_dir, stdlib_corpus, tiny_qwen3

    model = tiny_qwen3(hidden_size=args.hidden, layers=args.layers, vocab_size=args.vocab).float()
    numel = sum(p.numel() for p in model.parameters())
    print(f"model: {numel / 1e6:.1f}M parameters; machine: {machine()}", flush=True)
    files = save_model_dir(tiny_qwen3(hidden_size=64, layers=1, vocab_size=300), work / "model-files")
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    data = stdlib_corpus()
    g = torch.Generator().manual_seed(0)
    stream, full = str(work / "store" / "run"), str(work / "store" / "full")
    densities = []
    with DeltaPublisher(stream, model, dtype=torch.bfloat16, anchor_every=10**9, on_backlog="block", files=files) as pub:
        pub.publish(0)
        for step in range(1, args.steps + 1):
            starts = torch.randint(0, data.numel() - 65, (2,), generator=g)
            batch = torch.stack([data[s : s + 65] for s in starts])
            model(input_ids=batch[:, :-1], labels=batch[:, 1:]).loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            pub.publish(step)
            print(f"trained and published step {step}/{args.steps}", flush=True)
        pub.flush()
        densities = [m.density for m in pub.metrics if m.kind == "delta"]
        delta_bytes = [m.object_bytes for m in pub.metrics if m.kind == "delta"]
    with DeltaPublisher(full, model, dtype=torch.bfloat16) as pub:
        pub.publish(args.steps)
    # a small stream to warm each measuring process up with (kernels, pools), outside the measurement
    warm_model = tiny_qwen3(hidden_size=64, layers=1, vocab_size=300)
    with DeltaPublisher(str(work / "warm-up"), warm_model, dtype=torch.bfloat16, on_backlog="block") as pub:
        pub.publish(0)
        with torch.no_grad():
            for p in warm_model.parameters():
                p.mul_(1.01)
        pub.publish(1)
    info = {"numel": numel, "densities": densities, "delta_bytes": delta_bytes}
    return stream, full, info


def main() -> None:
    ap = parser(__doc__, steps=20)
    ap.add_argument("--repeats", type=int, default=3, help="fresh-process measurements per case")
    for internal in ("--measure", "--url", "--step", "--work"):  # one measurement, in a child process
        ap.add_argument(internal, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.measure:
        print(json.dumps(measure(args.measure, args.url, int(args.step), Path(args.work))))
        return

    work = Path(tempfile.mkdtemp(prefix="deltasync-bench-replay-"))
    try:
        stream, full, info = build_streams(args, work)
        n = args.steps
        rows: dict[str, list[dict]] = {c: [] for c in (*CASES, "replica")}
        for r in range(args.repeats):
            for case in CASES:  # interleaved: another process's load falls on every case alike
                url = full if case in ("full", "plain-load") else stream
                rows[case].append(run_case(case, url, n, work))
                print(f"repeat {r + 1}: {case:13s} {rows[case][-1]['seconds']:.2f} s, "
                      f"+{rows[case][-1]['peak_rss_growth_bytes'] / 1e6:.0f} MB", flush=True)
        rows["replica"].append(run_case("replica", stream, n, work))
        report(args, info, rows, stream, full)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def report(args, info: dict, rows: dict[str, list[dict]], stream: str, full: str) -> None:
    from rich.console import Console
    from rich.table import Table

    from deltasync import StreamReader

    def med(case: str, key: str) -> float:
        return statistics.median(r[key] for r in rows[case])

    full_s, full_mem = med("full", "seconds"), med("full", "peak_rss_growth_bytes")
    model_bytes = StreamReader(full).manifest(args.steps).object_bytes
    anchor_bytes = StreamReader(stream).manifest(0).object_bytes
    read_bytes = anchor_bytes + sum(info["delta_bytes"])
    table = Table(title=f"replay benchmark: {info['numel'] / 1e6:.0f}M params, step {args.steps} = anchor + {args.steps} "
                  f"deltas (median density {statistics.median(info['densities']):.2%}); medians of {args.repeats} "
                  f"fresh processes")
    for col in ("path", "seconds", "x full load", "peak RSS growth", "x full load", "read from store"):
        table.add_column(col, justify="right")
    labels = {
        "full": "full checkpoint (verified)",
        "replay": "anchor + deltas (verified)",
        "replay-folder": "... written as a folder",
        "plain-load": "full, safetensors unverified",
        "replica": "anchor + deltas, Replica",
    }
    for case in (*CASES, "replica"):
        s, mem = med(case, "seconds"), med(case, "peak_rss_growth_bytes")
        read = model_bytes if case in ("full", "plain-load") else read_bytes
        table.add_row(labels[case], f"{s:.2f}", f"{s / full_s:.2f}", f"{mem / 1e6:.0f} MB", f"{mem / full_mem:.2f}",
                      f"{read / 1e6:.0f} MB")
    Console(width=140).print(table)
    replay_s, replay_mem = med("replay", "seconds"), med("replay", "peak_rss_growth_bytes")
    print(f"model (bf16 checkpoint): {model_bytes / 1e6:.0f} MB; replay time {replay_s / full_s:.2f}x the full load "
          f"(target <= 2x: {'met' if replay_s <= 2 * full_s else 'missed'}), peak memory {replay_mem / full_mem:.2f}x "
          f"(target <= 1.2x: {'met' if replay_mem <= 1.2 * full_mem else 'missed'})")
    write_results(args, "replay", {"model_bytes": model_bytes, "anchor_bytes": anchor_bytes, **info, "rows": rows})


if __name__ == "__main__":
    main()
