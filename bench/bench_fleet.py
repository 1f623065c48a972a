"""Fleet benchmark: what N followers cost the source store, directly and through a mirror (issue 18).

    .venv/bin/python bench/bench_fleet.py [--fleet 1 8 32 128] [--steps 6] [--cadence-s 3] [--idle-s 30]

Starts SeaweedFS on loopback behind a request-counting proxy. A publisher commits ``--steps`` steps of a small
model every ``--cadence-s`` seconds; N followers (threads spread over a few processes, each a ``Follower`` at
the library's defaults with a state-dict target) follow them, then the stream stays quiet for ``--idle-s``.
Measured at the proxy, for the source bucket only: requests per idle follower-minute, requests and bytes out
of the source per step, and publish->applied latency p50/p99 (the writer's commit time in latest.json to each
follower's apply). "mirrored": one ``mirror_follow`` reads the source through the proxy and the followers
read the copy (through the proxy too: the copy's requests are counted apart). "pushed": as mirrored, and the
mirror serves its steps as events (``EventServer``); each follower listens (``EventFeed``) and polls the copy
only as a safety net. "node-cache": direct, all followers of this host sharing one ``NodeCache``. Baseline in the same
run: followers polling the way the library did before (``latest_step()`` every 50 ms: the hint, two existence checks, a
listing where s3fs falls back), idle only. Every follower's final weights are compared with the publisher's. Prints a
table and writes bench/results/fleet-<date>.json.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import shutil
import signal
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench._common import machine  # noqa: E402

PROCESSES = 4  # followers are threads in this many processes (each imports torch once)


def _state(step: int):
    import torch

    g = torch.Generator().manual_seed(1000 + step)
    return {"w": torch.randn(200_000, generator=g).bfloat16(), "b": torch.randn(256, generator=g).bfloat16()}


def _followers(url: str, options: dict, n: int, run_s: float, legacy: bool, out: str, notify: str | None = None,
               node_cache: str | None = None) -> None:
    """A process of ``n`` followers for ``run_s`` seconds; writes {"applied": [[step, unix time]...] per follower,
    "exact": [...]} to ``out``."""
    import faulthandler

    import torch

    faulthandler.enable()  # a process that dies of a signal says where (seen: SIGSEGV in 2 of 3 runs at 8 threads)
    signal.signal(signal.SIGTERM, signal.default_int_handler)  # the parent's terminate(): close the followers below
    torch.set_num_threads(1)
    try:
        _run_followers(url, options, n, run_s, legacy, out, notify, node_cache)
    except BaseException as e:  # the parent reports it: a process that died says why
        Path(out).write_text(json.dumps({"error": f"{type(e).__name__}: {e}", "applied": [], "exact": [False] * n}))
        raise


def _run_followers(url: str, options: dict, n: int, run_s: float, legacy: bool, out: str, notify: str | None,
                   node_cache: str | None) -> None:
    import torch

    from deltasync import NodeCache, StreamReader
    from deltasync.notify import EventFeed
    from rollout_loader import Follower, StateDictTarget

    stop = threading.Event()
    applied: list[list[tuple[int, float]]] = [[] for _ in range(n)]
    followers = []
    if legacy:  # the poll of the library before issue 18: latest_step() every 50 ms
        readers = [StreamReader(url, storage_options=options) for _ in range(n)]

        def poll(reader) -> None:
            while not stop.is_set():
                try:
                    reader.store.latest_step()
                except Exception:  # noqa: BLE001
                    pass
                stop.wait(0.05)

        threads = [threading.Thread(target=poll, args=(r,), daemon=True) for r in readers]
        for t in threads:
            t.start()
        time.sleep(run_s)
        stop.set()
        for t in threads:
            t.join()
        Path(out).write_text(json.dumps({"applied": [], "exact": []}))
        return
    feeds = [EventFeed(notify) for _ in range(n)] if notify else [None] * n
    node = NodeCache(node_cache) if node_cache else None
    try:
        for i in range(n):
            reader = StreamReader(url, storage_options=options, node_cache=node)
            f = Follower(reader, StateDictTarget(), on_step=lambda s, i=i: applied[i].append((s, time.time())),
                         notifier=feeds[i])
            followers.append(f.start())
        time.sleep(run_s)
    finally:  # however the run ends (an interrupt too): no follower left running, no download cache left behind
        for f in followers:
            f.close()
            f.reader.close()
        for feed in feeds:
            if feed is not None:
                feed.close()
    exact = []
    for f in followers:
        held = f.target.state_dict() if f.target.step is not None else None
        want = _state(f.target.step) if f.target.step is not None else None
        exact.append(held is not None and all(torch.equal(held[k].view(torch.int16), want[k].view(torch.int16))
                                              for k in want))
    Path(out).write_text(json.dumps({"applied": applied, "exact": exact, "steps": [f.target.step for f in followers]}))


def _through(options: dict, endpoint: str) -> dict:
    return {**options, "client_kwargs": {**options["client_kwargs"], "endpoint_url": endpoint}}


def run(server, n: int, mode: str, args: argparse.Namespace, work: Path) -> dict:
    """One measurement: ``mode`` is "direct", "node-cache", "mirrored", "pushed" or "baseline" (idle only)."""
    from deltasync import DeltaPublisher
    from deltasync.history.mirror import mirror_follow
    from deltasync.notify import EventServer
    from deltasync.store import Store
    from tests.integration.counting_proxy import counting_proxy

    opts = server.storage_options
    src = server.new_url()
    with DeltaPublisher(src, _state(0), on_backlog="block", storage_options=opts) as pub:
        pub.publish(0)
    with counting_proxy(opts["client_kwargs"]["endpoint_url"]) as proxy:
        via_proxy = _through(opts, proxy.url)
        stop_mirror = threading.Event()
        mirror_thread = events = None
        follow_url, follow_opts = src, via_proxy
        dst = None
        if mode in ("mirrored", "pushed"):
            dst = server.new_url()
            follow_url = dst  # the region's followers read the copy (through the proxy: counted apart)
            events = EventServer() if mode == "pushed" else None
            mirror_thread = threading.Thread(target=mirror_follow, args=(src, dst), daemon=True,
                                             kwargs=dict(src_options=via_proxy, dst_options=opts, stop=stop_mirror,
                                                         events=events))
            mirror_thread.start()
        notify = events.url if events is not None else None
        node_cache = str(work / f"node-{n}") if mode == "node-cache" else None
        run_s = (args.warmup_s + (0 if mode == "baseline" else args.steps * args.cadence_s + args.settle_s)
                 + args.idle_s + 2)
        procs, outs = [], []
        per = [n // PROCESSES + (1 if i < n % PROCESSES else 0) for i in range(min(PROCESSES, n))]
        ctx = mp.get_context("spawn")
        for i, k in enumerate(per):
            outs.append(str(work / f"{mode}-{n}-{i}.json"))
            # daemonic: a parent stopped early terminates them at its exit (they close their followers on SIGTERM)
            procs.append(ctx.Process(target=_followers, args=(follow_url, follow_opts, k, run_s, mode == "baseline",
                                                              outs[-1], notify, node_cache), daemon=True))
        for p in procs:
            p.start()
        time.sleep(args.warmup_s)  # started, caught up on step 0
        proxy.take()
        committed: dict[int, float] = {}
        step_requests: list = []
        if mode != "baseline":
            with DeltaPublisher(src, _state(0), on_backlog="block", storage_options=opts) as pub:
                for s in range(1, args.steps + 1):
                    time.sleep(args.cadence_s)
                    pub.source = _state(s)
                    pub.publish(s)
                    pub.flush()
                    with Store(src, storage_options=opts) as store:
                        committed[s] = store.latest_hint().committed_unix_s
            time.sleep(args.settle_s)  # the last step reaches everyone
            step_requests = proxy.take()
        t_idle = time.monotonic()
        time.sleep(args.idle_s)
        idle_requests = proxy.take()
        idle_s = time.monotonic() - t_idle
        for p in procs:
            p.join(timeout=600)
        stop_mirror.set()
        if mirror_thread is not None:
            mirror_thread.join(timeout=60)
        if events is not None:
            events.close()

    def under(url: str, reqs: list) -> list:
        return [r for r in reqs if r.path.startswith("/" + url.removeprefix("s3://"))
                or "prefix=" + url.split("/", 3)[3] in r.query]

    src_only = lambda reqs: under(src, reqs)  # noqa: E731
    idle = src_only(idle_requests)
    copy_idle = under(dst, idle_requests) if dst is not None else []
    results = [json.loads(Path(o).read_text()) if Path(o).exists() else
               {"error": f"follower process {i} wrote nothing (exit code {p.exitcode})", "applied": [],
                "exact": [False]}
               for i, (o, p) in enumerate(zip(outs, procs, strict=True))]
    errors = [r["error"] for r in results if "error" in r]
    latencies = [t - committed[s] for r in results for f in r["applied"] for s, t in f if s in committed]
    exact = [e for r in results for e in r["exact"]]
    steps = src_only(step_requests)
    row = {
        "followers": n, "mode": mode,
        "idle_requests_per_follower_minute": round(len(idle) / n / (idle_s / 60), 2),
        "idle_requests_by_kind": {f"{m} {k}": c for (m, k), c in sorted(proxy.count(idle).items())},
        "copy_idle_requests_per_follower_minute": round(len(copy_idle) / n / (idle_s / 60), 2) if dst else None,
        "source_requests_per_step": round(len(steps) / args.steps, 1) if mode != "baseline" else None,
        "source_bytes_per_step": round(sum(r.nbytes for r in steps) / args.steps) if mode != "baseline" else None,
        "latency_p50_s": round(float(np.percentile(latencies, 50)), 3) if latencies else None,
        "latency_p99_s": round(float(np.percentile(latencies, 99)), 3) if latencies else None,
        "applied": len(latencies), "expected_applied": n * args.steps if mode != "baseline" else 0,
        "all_exact": all(exact) if mode != "baseline" else None,
        "errors": errors,
    }
    print(json.dumps(row), flush=True)
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--fleet", type=int, nargs="+", default=[1, 8, 32, 128])
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--cadence-s", type=float, default=3.0)
    ap.add_argument("--idle-s", type=float, default=30.0)
    ap.add_argument("--warmup-s", type=float, default=20.0)
    ap.add_argument("--settle-s", type=float, default=8.0)
    ap.add_argument("--baseline-fleet", type=int, nargs="*", default=[1, 8])
    ap.add_argument("--modes", nargs="+", default=["direct", "node-cache", "mirrored", "pushed"],
                    choices=["direct", "node-cache", "mirrored", "pushed"])
    ap.add_argument("--out", default=str(Path(__file__).parent / "results"))
    args = ap.parse_args()

    from tests.integration.seaweedfs import SeaweedFS

    signal.signal(signal.SIGTERM, signal.default_int_handler)  # `kill`, `timeout`: clean up below, as on Ctrl-C
    work = Path(tempfile.mkdtemp(prefix="deltasync-bench-fleet-"))
    server = None
    rows = []
    try:  # the work folder goes however the run ends, a server that failed to start too
        (work / "weed").mkdir()
        server = SeaweedFS(work / "weed")
        server.start()
        for n in args.baseline_fleet:
            rows.append(run(server, n, "baseline", args, work))
        for n in args.fleet:
            for mode in args.modes:
                rows.append(run(server, n, mode, args, work))
    finally:
        if server is not None:
            server.stop()
        shutil.rmtree(work, ignore_errors=True)
    print("\n| followers | mode | idle requests / follower-minute (source) | (copy) | source requests / step | "
          "source MB / step | publish->applied p50 / p99 | applied | exact |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        mb = "-" if r["source_bytes_per_step"] is None else f"{r['source_bytes_per_step'] / 1e6:.2f}"
        lat = "-" if r["latency_p50_s"] is None else f"{r['latency_p50_s']:.2f} / {r['latency_p99_s']:.2f} s"
        copy = r["copy_idle_requests_per_follower_minute"]
        copy = "-" if copy is None else copy
        print(f"| {r['followers']} | {r['mode']} | {r['idle_requests_per_follower_minute']} | {copy} | "
              f"{r['source_requests_per_step'] if r['source_requests_per_step'] is not None else '-'} | {mb} | {lat} | "
              f"{r['applied']}/{r['expected_applied']} | {r['all_exact'] if r['all_exact'] is not None else '-'} |")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    import datetime as dt

    path = out / f"fleet-{dt.date.today().isoformat()}.json"
    path.write_text(json.dumps({"machine": machine(), "args": vars(args), "rows": rows}, indent=1))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
