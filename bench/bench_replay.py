"""Replay benchmark: the exact weights of step N from an anchor plus 20 deltas, against loading one full
checkpoint of the same model from the same store, same run.

    .venv/bin/python bench/bench_replay.py [--steps 20] [--repeats 3] [--hidden 768 --layers 12] [--contend]
                                           [--streams DIR]

Trains a Qwen3-shaped model (>= 100M parameters, fp32 master weights, AdamW at lr 1e-6, published as
bf16) and publishes step 0 as an anchor and steps 1..N (N = --steps) as deltas to a local store; step N is also
published as a full checkpoint (an anchor) to a second stream in the same store. Each measurement runs in
a fresh process (after a warm-up that loads the compiled kernels), timing the call and sampling the
resident set (/proc/self/statm) every millisecond for its peak growth, and the process's CPU time (user +
system, every thread: on a machine shared with other jobs the wall time follows their load, the CPU time
much less):
  full            reconstruct_state_dict of step N from the full checkpoint (its digest + every checksum);
  replay          reconstruct_state_dict of step N from the anchor + N deltas (same checks, every step);
  replay-folder   replay_to_folder: the same, written as a checkpoint folder (what `deltasync replay` does);
  plain-load      safetensors.load_file of the full checkpoint, copied into memory, unverified (reference);
  replica         StreamReader.state_dict: the follower's path (Replica, delta by delta), once;
  breakdown       the replay's stages on one thread, each timed in process CPU time (best of 3 passes; the
                  digest's own threads count: BLAKE3 hashes on a pool of its own, invisible to thread CPU time;
                  nothing else runs meanwhile; the anchor lands in memory freed by the pass before, so the
                  page faults of fresh memory, which a fresh process's full load and replay both pay, are not in it):
                  reading the anchor's tensors and hashing the same bytes (the manifest's digest: BLAKE3, or
                  SHA-256 in older streams; read once), fetch + digest of the deltas, reading and decoding the
                  deltas, applying them, the final checksum;
                  then the kernels and calls that took the most time in a profiled pass.
Targets (issue 22): replay <= 1.5x the full load's time and <= 1.1x its peak memory. Prints a table, writes JSON.
``--streams DIR`` builds the streams there and keeps them (a later run with the same DIR reuses them: the
trained model and its deltas stay the same from one measurement to the next).
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

from bench._common import Training, machine, parser, write_results  # noqa: E402

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

    from deltasync import StreamReader, replay_to_folder
    from deltasync.history import reconstruct_state_dict

    warm = work / "warm-up"  # compiled kernels, thread pools, imports: outside the measurement
    reconstruct_state_dict(str(warm), 1)
    out = work / f"out-{case}"
    shutil.rmtree(out, ignore_errors=True)
    held = None  # what the call returns stays in memory until the measurement ends
    cpu0 = time.process_time()
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
    cpu = time.process_time() - cpu0
    del held
    shutil.rmtree(out, ignore_errors=True)
    return {"case": case, "seconds": m.seconds, "cpu_seconds": cpu, "peak_rss_growth_bytes": m.growth}


def breakdown(url: str, step: int, work: Path, passes: int = 3) -> dict:
    """The replay's stages on one thread, in process CPU time (the least of ``passes``), and a profile.

    The stages are those of ``Chain.rebuild``, called one by one: what each costs, whatever the load. Process
    time, not thread time: the digest (``blake3`` with ``max_threads=AUTO``) runs on threads of its own, and
    thread time counted only the reading of the anchor and of the deltas, not their hashing."""
    import cProfile
    import io
    import pstats

    import numba

    from deltasync import StreamReader
    from deltasync.format.checksum import tensor_checksum
    from deltasync.history import reconstruct_state_dict
    from deltasync.history.replay import Chain, group_full, open_checked, xor_patches

    reconstruct_state_dict(str(work / "warm-up"), 1)
    numba.set_num_threads(1)
    reader = StreamReader(url)
    steps = reader.chain(step)
    best: dict[str, float] = {}
    counts = {"deltas": len(steps) - 1, "patches": 0, "changed_elements": 0}
    for k in range(passes + 1):  # the last pass runs under the profiler
        spent: dict[str, float] = dict.fromkeys(
            ("read + digest anchor (once)", "fetch + digest deltas", "read + decode deltas",
             "apply (XOR)", "checksum (final state)"), 0.0)
        profile = cProfile.Profile() if k == passes else None

        def timed(stage: str, fn, *a, spent=spent, **kw):
            t0 = time.process_time()
            out = fn(*a, **kw)
            spent[stage] += time.process_time() - t0
            return out

        if profile:
            profile.enable()
        anchor, landed = reader.open_unhashed(steps[0]), {}
        assert anchor is not None, "a local store reads its anchor once"
        first = reader.manifest(steps[0])
        digest = timed("read + digest anchor (once)", anchor.read_tensors_hashed, landed.__setitem__,
                       algorithm=first.algorithm)
        reader.store.check_digest(first, digest)
        objects = [anchor] + [timed("fetch + digest deltas", open_checked, reader, s) for s in steps[1:]]
        with Chain(objects) as chain:
            for name in chain.order():
                t = landed.pop(name)
                group = []  # as Chain.rebuild groups them: a few patches, then applied block by block
                for obj in objects[1:]:
                    if obj.header.tensors[name].changed:
                        group.append(timed("read + decode deltas", obj.change, name))
                        if k == 0:
                            counts["patches"] += 1
                            counts["changed_elements"] += obj.header.tensors[name].changed
                        if group_full(t, group):
                            timed("apply (XOR)", xor_patches, t, group)
                            group = []
                timed("apply (XOR)", xor_patches, t, group)
                timed("checksum (final state)", tensor_checksum, t)
        if profile:
            profile.disable()
            text = io.StringIO()
            pstats.Stats(profile, stream=text).sort_stats("tottime").print_stats(12)
        else:
            best = {s: min(best.get(s, v), v) for s, v in spent.items()}
    return {"case": "breakdown", "stages_cpu_seconds": best, **counts, "profile": text.getvalue()}


def run_case(case: str, url: str, step: int, work: Path) -> dict:
    cmd = [sys.executable, __file__, "--measure", case, "--url", url, "--step", str(step), "--work", str(work)]
    done = subprocess.run(cmd, check=True, capture_output=True, text=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def build_streams(args, work: Path) -> tuple[str, str, dict]:
    from deltasync import DeltaPublisher
    from deltasync.testing import save_model_dir, tiny_qwen3

    train = Training(args)
    model = train.model
    numel = sum(p.numel() for p in model.parameters())
    print(f"model: {numel / 1e6:.1f}M parameters; machine: {machine()}", flush=True)
    files = save_model_dir(tiny_qwen3(hidden_size=64, layers=1, vocab_size=300), work / "model-files")
    stream, full = str(work / "store" / "run"), str(work / "store" / "full")
    densities = []
    with DeltaPublisher(stream, model, dtype=torch.bfloat16, anchor_every=10**9, on_backlog="block",
                        files=files) as pub:
        pub.publish(0)
        for step in range(1, args.steps + 1):
            train.step()
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
    ap.add_argument("--streams", help="build the streams in this folder and keep them (reused when it holds them)")
    for internal in ("--measure", "--url", "--step", "--work"):  # one measurement, in a child process
        ap.add_argument(internal, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.measure == "breakdown":
        print(json.dumps(breakdown(args.url, int(args.step), Path(args.work))))
        return
    if args.measure:
        print(json.dumps(measure(args.measure, args.url, int(args.step), Path(args.work))))
        return

    kept = Path(args.streams) if args.streams else None
    work = kept or Path(tempfile.mkdtemp(prefix="deltasync-bench-replay-"))
    try:
        stream, full, info = reuse_streams(args, work) if kept else build_streams(args, work)
        n = args.steps
        rows: dict[str, list[dict]] = {c: [] for c in (*CASES, "replica")}
        for r in range(args.repeats):
            for case in CASES:  # interleaved: another process's load falls on every case alike
                url = full if case in ("full", "plain-load") else stream
                rows[case].append(run_case(case, url, n, work))
                print(f"repeat {r + 1}: {case:13s} {rows[case][-1]['seconds']:.2f} s, "
                      f"+{rows[case][-1]['peak_rss_growth_bytes'] / 1e6:.0f} MB", flush=True)
        rows["replica"].append(run_case("replica", stream, n, work))
        parts = run_case("breakdown", stream, n, work)
        report(args, info, rows, stream, full, parts)
    finally:
        if kept is None:
            shutil.rmtree(work, ignore_errors=True)
        for out in work.glob("out-*"):  # a measurement killed half-way
            shutil.rmtree(out, ignore_errors=True)


def reuse_streams(args, work: Path) -> tuple[str, str, dict]:
    """The streams kept in ``work`` by an earlier run with the same arguments, or built there now."""
    saved = work / "streams.json"
    want = {k: getattr(args, k) for k in ("steps", "lr", "hidden", "layers", "vocab")}
    if saved.exists():
        found = json.loads(saved.read_text())
        if found["args"] != want:
            raise SystemExit(f"{work} holds streams built with {found['args']}, not {want}: name another --streams "
                             "folder")
        print(f"reusing the streams in {work}", flush=True)
        return found["stream"], found["full"], found["info"]
    if work.exists() and any(work.iterdir()):
        raise SystemExit(f"{work} is not empty and holds no streams.json: name an empty or new folder")
    work.mkdir(parents=True, exist_ok=True)
    stream, full, info = build_streams(args, work)
    saved.write_text(json.dumps({"args": want, "stream": stream, "full": full, "info": info}))
    return stream, full, info


def report(args, info: dict, rows: dict[str, list[dict]], stream: str, full: str, parts: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    from deltasync import StreamReader

    def med(case: str, key: str) -> float:
        return statistics.median(r[key] for r in rows[case])

    full_s, full_mem = med("full", "seconds"), med("full", "peak_rss_growth_bytes")
    full_cpu = med("full", "cpu_seconds")
    model_bytes = StreamReader(full).manifest(args.steps).object_bytes
    anchor_bytes = StreamReader(stream).manifest(0).object_bytes
    read_bytes = anchor_bytes + sum(info["delta_bytes"])
    table = Table(title=f"replay benchmark: {info['numel'] / 1e6:.0f}M params, step {args.steps} = anchor + "
                        f"{args.steps} "
                  f"deltas (median density {statistics.median(info['densities']):.2%}); medians of {args.repeats} "
                  f"fresh processes")
    for col in ("path", "seconds", "x full load", "CPU seconds", "x full load", "peak RSS growth", "x full load",
                "read from store"):
        table.add_column(col, justify="right")
    labels = {
        "full": "full checkpoint (verified)",
        "replay": "anchor + deltas (verified)",
        "replay-folder": "... written as a folder",
        "plain-load": "full, safetensors unverified",
        "replica": "anchor + deltas, Replica",
    }
    for case in (*CASES, "replica"):
        s, cpu, mem = med(case, "seconds"), med(case, "cpu_seconds"), med(case, "peak_rss_growth_bytes")
        read = model_bytes if case in ("full", "plain-load") else read_bytes
        table.add_row(labels[case], f"{s:.2f}", f"{s / full_s:.2f}", f"{cpu:.2f}", f"{cpu / full_cpu:.2f}",
                      f"{mem / 1e6:.0f} MB", f"{mem / full_mem:.2f}", f"{read / 1e6:.0f} MB")
    Console(width=160).print(table)
    stages = Table(title=f"replay breakdown, one thread: {parts['deltas']} deltas, {parts['patches']} patches, "
                   f"{parts['changed_elements'] / 1e6:.1f}M changed elements (process CPU time, best of 3)")
    for col in ("stage", "CPU ms", "share", "ns per changed element"):
        stages.add_column(col, justify="right")
    total = sum(parts["stages_cpu_seconds"].values())
    for stage, sec in parts["stages_cpu_seconds"].items():
        stages.add_row(stage, f"{sec * 1e3:.0f}", f"{sec / total:.0%}",
                       f"{sec / max(1, parts['changed_elements']) * 1e9:.1f}")
    stages.add_row("total", f"{total * 1e3:.0f}", "100%", "")
    Console(width=160).print(stages)
    print(parts["profile"])
    replay_s, replay_mem = med("replay", "seconds"), med("replay", "peak_rss_growth_bytes")
    print(f"load average at the end (1, 5, 15 min): {os.getloadavg()}; replay CPU time "
          f"{med('replay', 'cpu_seconds') / full_cpu:.2f}x the full load's")
    print(f"model (bf16 checkpoint): {model_bytes / 1e6:.0f} MB; replay time {replay_s / full_s:.2f}x the full load "
          f"(target <= 1.5x: {'met' if replay_s <= 1.5 * full_s else 'missed'}), "
          f"peak memory {replay_mem / full_mem:.2f}x "
          f"(target <= 1.1x: {'met' if replay_mem <= 1.1 * full_mem else 'missed'})")
    write_results(args, "replay", {"model_bytes": model_bytes, "anchor_bytes": anchor_bytes, **info, "rows": rows,
                                   "breakdown": parts, "load_average": os.getloadavg()})


if __name__ == "__main__":
    main()
