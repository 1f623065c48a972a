"""Catch-up benchmark (issue 34 item 3): bytes and requests a follower 8, 32 and 128 steps behind reads to reach
the newest step, today (the steps' own objects: deltas, or an anchor and the deltas after it) against catch-up
deltas (docs/FORMAT.md section 5g), and what writing them costs.

    .venv/bin/python bench/bench_catchup.py [--steps 192] [--hidden 256 --layers 4 --vocab 4096] [--lr 1e-6]

Trains a Qwen3-shaped model (fp32 master weights) with AdamW at an RL-like lr, publishes every step as bf16 to an
in-process ``memory://`` store (default publisher options: an anchor every 20 steps, each carrying its own delta),
then, in the same run and on the same stream:

- **today**: ``chain(newest, start=H, catchup=False)``: what a reader that knows no catch-ups reads;
- **aligned**: after ``deltasync catchup --distances 4,16,64 --no-consumers`` (one pass over the stream);
- **+consumers**: after a second pass that also serves the followers' heartbeats (one catch-up from each held
  step to the newest).

Each follower holds a step H = newest - lag - j (j = 0..7: every alignment to the aligned catch-ups of 4 steps)
and catches up with a fresh ``StreamReader`` (cold caches) over a transport that counts every request and byte;
the table gives the mean (and worst) over the 8 followers of a lag. Every caught-up replica is checked against the
newest step's checksums, and one per lag bit for bit against the replica today's way builds.
"""

from __future__ import annotations

import statistics
import sys
import time
import tracemalloc
import uuid
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench._common import Training, machine, parser, write_results  # noqa: E402
from deltasync import DeltaPublisher, StreamReader  # noqa: E402
from deltasync.follow.consumers import write_heartbeat  # noqa: E402
from deltasync.format.checksum import format_checksum, state_checksum  # noqa: E402
from deltasync.history import CatchupOptions, CatchupWriter  # noqa: E402
from deltasync.store import Store  # noqa: E402

LAGS = (8, 32, 128)
ALIGNMENTS = 8


class Counting:
    """A transport wrapper that counts requests and the bytes they returned (what a follower pays for)."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner
        self.requests = 0
        self.bytes = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def get(self, key: str, **kw: Any) -> bytes:
        data = self._inner.get(key, **kw)
        self.requests += 1
        self.bytes += len(data)
        return data

    def get_file(self, key: str, local: Path, *, max_bytes: int | None = None) -> None:
        self._inner.get_file(key, local, max_bytes=max_bytes)
        self.requests += 1
        self.bytes += Path(local).stat().st_size

    def list(self, prefix: str = "") -> Any:
        self.requests += 1
        return self._inner.list(prefix)

    def exists(self, key: str) -> bool:
        self.requests += 1
        return self._inner.exists(key)


def follow(url: str, held: int, newest: int, *, catchup: bool, same_as: Any = None) -> dict[str, Any]:
    """A follower holding ``held`` catches up to ``newest``: its replica is built first (not counted), then every
    request of the catch-up is. ``same_as``: a replica the result must equal bit for bit."""
    with StreamReader(url) as r:
        rep = r.replica(held)
    with StreamReader(url) as r:
        counting = Counting(r.store.transport)
        r.store.transport = counting
        t0 = time.perf_counter()
        if catchup:
            chain = r.catch_up(rep, newest)
        else:
            chain = r.chain(newest, start=held, catchup=False)
            for s in chain:
                with r.open(s, base=rep.step) as obj:
                    rep.apply(obj)
        seconds = time.perf_counter() - t0
        assert rep.step == newest and state_checksum({n: format_checksum(c) for n, c in rep.checksums.items()}
                                                      ) == r.manifest(newest).state_checksum
    if same_as is not None:
        want, got = same_as.state_dict(), rep.state_dict()
        assert all(torch.equal(want[k].view(torch.uint8), got[k].view(torch.uint8)) for k in want), (held, newest)
    return {"held": held, "newest": newest, "bytes": counting.bytes, "requests": counting.requests,
            "objects": len(chain), "seconds": seconds, "state": rep}


def main() -> None:
    ap = parser(__doc__ or "", steps=192)
    ap.set_defaults(hidden=256, layers=4, vocab=4096)
    ap.add_argument("--distances", default="4,16,64", help="aligned catch-up distances (deltasync catchup)")
    args = ap.parse_args()
    distances = tuple(int(d) for d in args.distances.split(","))
    assert args.steps > max(LAGS) + ALIGNMENTS + 8, "need more steps than the largest lag"
    train = Training(args)
    numel = sum(p.numel() for p in train.model.parameters())
    print(f"model: {numel / 1e6:.1f}M parameters, {args.steps} AdamW steps at lr {args.lr}; machine: {machine()}")
    url = f"memory://bench-catchup-{uuid.uuid4().hex[:8]}"
    store = Store(url)
    results: dict[str, Any] = {"today": {lag: [] for lag in LAGS}, "aligned": {lag: [] for lag in LAGS},
                               "consumers": {lag: [] for lag in LAGS}}
    costs: dict[str, list[dict[str, Any]]] = {"aligned": [], "consumers": []}

    def write(name: str, options: CatchupOptions) -> None:
        tracemalloc.start()
        t = time.perf_counter()
        with CatchupWriter(url, options=options) as w:
            report = w.run_once()
        seconds = time.perf_counter() - t
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
        written = sum(n for _, _, n in report.written)
        # the catch-ups it stores land in this process (memory://) and are traced: not the writer's own memory
        costs[name].append({"written": len(report.written), "bytes": written, "seconds": seconds,
                            "peak_host_bytes": peak, "peak_less_stored_bytes": peak - written,
                            "largest_bytes": max((n for _, _, n in report.written), default=0),
                            "skipped": len(report.skipped)})

    aligned = CatchupOptions(distances=distances, consumers=False, horizon=10**6, grace_s=0)
    consumers = CatchupOptions(distances=distances, consumers=True, horizon=10**6, grace_s=0, min_lag=2)
    t0 = time.perf_counter()
    with DeltaPublisher(url, train.model, on_backlog="block", dtype=torch.bfloat16) as pub:
        for s in range(args.steps):
            train.step()
            pub.publish(s)
            if s < args.steps - ALIGNMENTS:
                continue
            # the newest step is s: followers preempted at s - lag resume now; the writer ran its pass after s
            pub.flush()
            write("aligned", aligned)
            helds = {lag: s - lag for lag in LAGS}
            exact = {lag: follow(url, h, s, catchup=False) for lag, h in helds.items()}
            for lag, run in exact.items():
                results["today"][lag].append(run)
                results["aligned"][lag].append(follow(url, helds[lag], s, catchup=True, same_as=run.pop("state")))
            for lag, h in helds.items():
                write_heartbeat(store, f"rollout-{lag}", h)
            write("consumers", consumers)
            for lag, h in helds.items():
                results["consumers"][lag].append(follow(url, h, s, catchup=True, same_as=None))
                store.delete(f"consumers/rollout-{lag}.json")
                store.delete_catchup(s, h)  # served: the next step's followers hold other steps
    print(f"trained, published and caught up in {time.perf_counter() - t0:.0f}s")
    reader = StreamReader(store)
    steps = reader.steps()
    newest = steps[-1]
    manifests = {s: reader.manifest(s) for s in steps}
    deltas = [m.object_bytes for m in manifests.values() if m.kind == "delta"]
    anchors = [m.object_bytes for m in manifests.values() if m.kind == "anchor"]
    stream_bytes = sum(m.object_bytes + (m.delta.object_bytes if m.delta else 0) for m in manifests.values())
    print(f"one step's delta: median {statistics.median(deltas) / 1e3:.1f} kB; an anchor {anchors[0] / 1e6:.2f} MB; "
          f"the stream {stream_bytes / 1e6:.1f} MB")
    stored = sum(e.object_bytes for e in store.catchup_entries() if e.committed)

    def row(name: str, lag: int) -> dict[str, float]:
        runs, base = results[name][lag], results["today"][lag]
        ratios = [r["bytes"] / b["bytes"] for r, b in zip(runs, base, strict=True)]
        return {"mb": statistics.mean(r["bytes"] for r in runs) / 1e6,
                "requests": statistics.mean(r["requests"] for r in runs),
                "objects": statistics.mean(r["objects"] for r in runs),
                "ratio": statistics.mean(ratios), "worst": max(ratios), "best": min(ratios)}

    table = {lag: {name: row(name, lag) for name in results} for lag in LAGS}
    print(f"\nfollowers catching up to the newest step (mean over {ALIGNMENTS} newest steps {newest - ALIGNMENTS + 1}.."
          f"{newest}, each with followers exactly `lag` behind; ratio: bytes / today's bytes, same follower)")
    print(f"{'lag':>4} | {'way':>10} | {'MB read':>8} | {'requests':>8} | {'objects':>7} | {'x today':>7} | "
          f"{'worst':>6} | {'best':>6}")
    for lag in LAGS:
        for name in results:
            r = table[lag][name]
            print(f"{lag:>4} | {name:>10} | {r['mb']:8.3f} | {r['requests']:8.1f} | {r['objects']:7.1f} | "
                  f"{r['ratio']:7.2f} | {r['worst']:6.2f} | {r['best']:6.2f}")
    first = costs["aligned"][0]
    later = costs["aligned"][1:]
    print(f"writing, aligned ({args.distances}), first pass over {newest - ALIGNMENTS + 1} steps: {first['written']} "
          f"catch-ups, {first['bytes'] / 1e6:.2f} MB, {first['seconds']:.1f}s, host peak "
          f"{first['peak_less_stored_bytes'] / 1e6:.1f} MB traced beyond what it stored (largest catch-up "
          f"{first['largest_bytes'] / 1e6:.2f} MB); then per new step: "
          f"{statistics.mean(c['written'] for c in later):.2f} catch-ups, "
          f"{statistics.mean(c['seconds'] for c in later):.2f}s")
    print(f"stored: aligned catch-ups {stored / 1e6:.2f} MB = {stored / stream_bytes:.2f}x the stream's "
          f"{stream_bytes / 1e6:.1f} MB ({stored / sum(deltas):.2f}x its deltas alone)")
    cons = costs["consumers"]
    print(f"writing, consumers (3 lagging followers a pass): {statistics.mean(c['seconds'] for c in cons):.2f}s, "
          f"{statistics.mean(c['bytes'] for c in cons) / 1e6:.2f} MB a pass, host peak "
          f"{max(c['peak_less_stored_bytes'] for c in cons) / 1e6:.1f} MB traced beyond what it stored. The trainer: "
          "nothing (no accelerator or host memory, no time: the writer reads the store)")
    for runs in results.values():
        for lag_runs in runs.values():
            for r in lag_runs:
                r.pop("state", None)
    write_results(args, "catchup", {
        "numel": numel, "steps": args.steps, "delta_median_bytes": statistics.median(deltas),
        "anchor_bytes": anchors[0], "stream_bytes": stream_bytes, "aligned_stored_bytes": stored,
        "distances": distances, "table": table, "runs": results, "write": costs,
    })


if __name__ == "__main__":
    main()
