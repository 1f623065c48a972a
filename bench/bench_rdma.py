"""The NIXL fast path measured: pipeline vs raw read, publish()->live over NIXL vs a local store, anchors.

For each model size a trainer process publishes a bf16 model with ``DeltaPublisher`` through
``NixlTransport.trainer`` (an anchor, then deltas at ``--density``); this process follows with
``RdmaConsumer``'s reader and, for every step, times in the same process on the same bytes:

- **pipeline**: ``reader.open`` (manifest from the store, READ of the ring slot over NIXL, SHA-256 in the
  inbox and against the manifest, header parse) + decode + apply + checksum verify (``Replica``);
- **raw**: a second READ of the same slot (``Inbox.transfer``: the transfer only, nothing checked);
- **publish()->live**: from ``publish()`` returning in the trainer to the step applied here (one clock:
  CLOCK_MONOTONIC is system-wide). The trainer waits for each step to be live before the next, so every
  step is measured alone. The same run then repeats over the local store alone (the consumer polls
  ``latest_step`` every millisecond).

Then ``bench/simulate_rdma.py`` is validated: ``nic_gbps``/``fixed_ms`` are fitted from the raw reads of
the smallest and largest anchors and ``consumer_gbps`` from their pipelines; the other sizes are predicted
(held out) and compared with what was measured.

    .venv/bin/python bench/bench_rdma.py                     # table + bench/results/bench_rdma-<date>.json
    .venv/bin/python bench/bench_rdma.py --sizes 1,4 --steps 3   # quick
"""

from __future__ import annotations

import multiprocessing as mp
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench._common import parser, write_results

CTX = mp.get_context("spawn")


def _model(melems: float) -> dict[str, Any]:
    import torch

    n = int(melems * 1e6) // 4
    g = torch.Generator().manual_seed(0)
    return {f"layers.{i}.weight": torch.randn(n, generator=g).to(torch.bfloat16) for i in range(4)}


def _step(state: dict[str, Any], step: int, density: float) -> None:
    import torch

    g = torch.Generator().manual_seed(step)
    for t in state.values():
        idx = torch.randperm(t.numel(), generator=g)[: int(t.numel() * density)]
        t[idx] = (t[idx].float() * 1.01 + 1e-3).to(t.dtype)


def trainer(address: str | None, url: str, melems: float, steps: int, density: float, out: Any, go: Any) -> None:
    """Publish ``steps`` steps; after each, wait for the consumer's go (so each step is measured alone)."""
    import torch

    from deltasync.publish.publisher import DeltaPublisher
    from deltasync.store import Store
    from deltasync.transports.nixl import NixlTransport

    state = _model(melems)
    slot = ((int(melems * 1e6) * 2 + (4 << 20)) >> 20) << 20
    transport = (NixlTransport.trainer(url, rdma={"controller": address, "slot_bytes": slot, "slots": 2,
                                                  "plan_wait_s": 60.0}) if address else None)
    store = Store(url, transport=transport) if transport else Store(url)
    with DeltaPublisher(store, state, anchor_every=1000, on_backlog="block") as pub:
        for s in range(steps):
            if s:
                _step(state, s, density)
            with torch.no_grad():
                pub.publish(s)
            out.put(("published", s, time.monotonic()))
            go.get(timeout=120)
    if transport:
        transport.close()


def follow(url: str, address: str | None, steps: int, out: Any, go: Any) -> list[dict[str, Any]]:
    from deltasync.format.objects import StepObject
    from deltasync.rdma.consumer import RdmaConsumer
    from deltasync.reader import StreamReader
    from deltasync.stages.apply import Replica

    consumer = RdmaConsumer(url, rdma={"controller": address, "capacity_bytes": 1 << 30}, consumer_id="bench",
                            plan_wait_s=60.0) if address else None
    reader = consumer.reader if consumer else StreamReader(url)
    rows, replica = [], None
    try:
        for s in range(steps):
            while True:  # new steps: from announcements over NIXL, by polling the store otherwise
                if consumer:
                    consumer.ring.poll()
                    newest = consumer.ring.newest()
                    if newest is not None and newest >= s:
                        break
                    consumer.ring.wait_message(0.001)
                else:
                    latest = reader.latest_step()
                    if latest is not None and latest >= s:
                        break
                    time.sleep(0.001)
            t0 = time.perf_counter()
            with reader.open(s) as obj:
                t1 = time.perf_counter()
                if replica is None:
                    replica = Replica.from_anchor(obj)
                else:
                    replica.apply(obj, verify="incremental")
            t2 = time.perf_counter()
            live = time.monotonic()
            row = {"step": s, "kind": reader.manifest(s).kind, "bytes": reader.manifest(s).object_bytes,
                   "read_s": t1 - t0, "pipeline_s": t2 - t0, "live_mono": live}
            if consumer:
                info = consumer.ring.link.announced(s)  # before applied(): that forgets the announcement
                consumer.applied(s)
                row["via"] = consumer.arrived.get(s, "?")
                raws = []
                for _ in range(10):  # the least of 10: this machine is shared
                    r0 = time.perf_counter()
                    consumer.ring.inbox.transfer(info)
                    raws.append(time.perf_counter() - r0)
                row["raw_s"] = min(raws)
                with StepObject(bytes(consumer.ring.inbox.read(info)), where="raw check"):
                    pass  # the raw READ brought the same object
            rows.append(row)
            go.put(s)
    finally:
        if consumer:
            consumer.close()
        else:
            reader.close()
    return rows


def run(melems: float, steps: int, density: float, rdma: bool) -> list[dict[str, Any]]:
    from deltasync.rdma.controller import Controller

    with tempfile.TemporaryDirectory(prefix="bench-rdma-") as tmp:
        url = str(Path(tmp) / "store")
        controller = Controller(trainers=1, consumers=1) if rdma else None
        out, go = CTX.Queue(), CTX.Queue()
        p = CTX.Process(target=trainer, args=(controller.address if controller else None, url, melems, steps, density,
                                              out, go), daemon=True)
        p.start()
        try:
            rows = follow(url, controller.address if controller else None, steps, out, go)
            published = dict(out.get(timeout=60)[1:] for _ in range(steps))
            p.join(60)
        finally:
            if p.is_alive():
                p.kill()
                p.join()
            if controller:
                controller.close()
    for r in rows:
        r["live_ms"] = (r.pop("live_mono") - published[r["step"]]) * 1e3
    return rows


def main() -> None:
    ap = parser(__doc__, steps=4)
    ap.add_argument("--sizes", default="1,4,16,32", help="model sizes in millions of bf16 elements")
    ap.add_argument("--density", type=float, default=0.03)
    args = ap.parse_args()
    import simulate_rdma as sim  # bench/ is on sys.path when run as a script

    sizes = [float(x) for x in args.sizes.split(",")]
    results: dict[str, Any] = {"sizes": {}}
    for m in sizes:
        nixl = run(m, args.steps, args.density, rdma=True)
        store = run(m, args.steps, args.density, rdma=False)
        results["sizes"][str(m)] = {"nixl": nixl, "store": store}
        print(f"{m:g}M elements done", file=sys.stderr)
    print("| M elems | step | kind | MB | via | raw read ms | pipeline ms | raw/pipeline | live ms NIXL | live ms local store |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for m, r in results["sizes"].items():
        for a, b in zip(r["nixl"], r["store"]):
            print(f"| {m} | {a['step']} | {a['kind']} | {a['bytes'] / 1e6:.2f} | {a['via']} | {a['raw_s'] * 1e3:.2f} | "
                  f"{a['pipeline_s'] * 1e3:.2f} | {a['raw_s'] / a['pipeline_s']:.2f} | {a['live_ms']:.1f} | {b['live_ms']:.1f} |")
    deltas = [a for r in results["sizes"].values() for a in r["nixl"] if a["kind"] == "delta"]
    anchors = [a for r in results["sizes"].values() for a in r["nixl"] if a["kind"] == "anchor"]
    summary = {
        "delta_raw_over_pipeline_median": statistics.median(a["raw_s"] / a["pipeline_s"] for a in deltas),
        "anchor_raw_over_pipeline_median": statistics.median(a["raw_s"] / a["pipeline_s"] for a in anchors),
        "live_ms_nixl_median": statistics.median(a["live_ms"] for r in results["sizes"].values() for a in r["nixl"][1:]),
        "live_ms_store_median": statistics.median(a["live_ms"] for r in results["sizes"].values() for a in r["store"][1:]),
    }
    # --- the simulator: fit on the smallest and largest anchors, predict every other step (held out) ---
    lo, hi = min(anchors, key=lambda a: a["bytes"]), max(anchors, key=lambda a: a["bytes"])
    gbps = (hi["bytes"] - lo["bytes"]) / (hi["raw_s"] - lo["raw_s"]) / 1e9
    fixed_ms = max(lo["raw_s"] - lo["bytes"] / (gbps * 1e9), 0.0) * 1e3
    extra = lambda a: a["pipeline_s"] - a["raw_s"]
    consumer_gbps = (hi["bytes"] - lo["bytes"]) / (extra(hi) - extra(lo)) / 1e9
    topo = sim.Topology(trainer_gpus=1, inference_gpus=1, engine_gpus=1, attention_tp=1, nic_gbps=gbps,
                        per_read_us=0.0, fixed_ms=fixed_ms, consumer_gbps=consumer_gbps)
    checks = []
    for a in anchors + deltas:
        if a is lo or a is hi:
            continue
        raw_p, pipe_p = sim.loopback(a["bytes"], topo)
        checks.append({"bytes": a["bytes"], "kind": a["kind"], "raw_s": a["raw_s"], "raw_pred_s": raw_p,
                       "pipeline_s": a["pipeline_s"], "pipeline_pred_s": pipe_p,
                       "raw_err": raw_p / a["raw_s"] - 1, "pipeline_err": pipe_p / a["pipeline_s"] - 1})
    print(f"\nsimulator fitted on {lo['bytes'] / 1e6:.1f} and {hi['bytes'] / 1e6:.1f} MB anchors: nic {gbps:.2f} GB/s, "
          f"fixed {fixed_ms:.2f} ms, consumer {consumer_gbps:.2f} GB/s")
    print("| MB | kind | raw ms | predicted | error | pipeline ms | predicted | error |")
    print("|---|---|---|---|---|---|---|---|")
    for c in checks:
        print(f"| {c['bytes'] / 1e6:.2f} | {c['kind']} | {c['raw_s'] * 1e3:.2f} | {c['raw_pred_s'] * 1e3:.2f} | "
              f"{c['raw_err']:+.0%} | {c['pipeline_s'] * 1e3:.2f} | {c['pipeline_pred_s'] * 1e3:.2f} | {c['pipeline_err']:+.0%} |")
    big = [c for c in checks if c["bytes"] >= 1e6]
    summary["simulator"] = {"nic_gbps": gbps, "fixed_ms": fixed_ms, "consumer_gbps": consumer_gbps, "checks": checks,
                            "max_abs_pipeline_err_over_1MB": max((abs(c["pipeline_err"]) for c in big), default=None),
                            "max_abs_raw_err_over_1MB": max((abs(c["raw_err"]) for c in big), default=None)}
    print("\n" + "\n".join(f"{k}: {v:.3f}" for k, v in summary.items() if isinstance(v, float)))
    write_results(args, "bench_rdma", {**results, "summary": summary})


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    main()
