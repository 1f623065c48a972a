"""S3 benchmark: publish-to-consumer latency and transfer throughput through a real S3 server.

    .venv/bin/python bench/bench_s3.py [--steps 20] [--hidden 768 --layers 12]

Starts SeaweedFS on loopback, trains a Qwen3-shaped model (>= 100M parameters, AdamW, lr 1e-6) and
publishes every step to s3:// while a Follower in the same process applies each step as it lands.
Reports, per step and as p50/p95: publish() returning -> step applied and verified in the consumer.
Then, on the same objects, the transfer stage (deltasync's upload of an object and its checked
download) against plain s3fs put_file/get_file of the same bytes, in the same run.
Prints a table and writes bench/results/s3-<date>.json.
"""

from __future__ import annotations

import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench._common import Training, machine, parser, write_results  # noqa: E402
from deltasync import DeltaPublisher, StreamReader
from deltasync.store import Store, step_dir  # noqa: E402
from rollout_loader import Follower, PollPolicy, StateDictTarget  # noqa: E402
from tests.integration.seaweedfs import SeaweedFS  # noqa: E402


def pct(xs: list[float], q: float) -> float:
    return float(np.percentile(np.asarray(xs), q))


def main() -> None:
    args = parser(__doc__, steps=20).parse_args()

    work = Path(tempfile.mkdtemp(prefix="deltasync-bench-s3-"))
    server = SeaweedFS(work)
    server.start()
    try:
        run(args, server, work)
    finally:
        server.stop(crash=True)
        shutil.rmtree(work, ignore_errors=True)


def run(args, server: SeaweedFS, work: Path) -> None:
    opts = server.storage_options
    url = server.new_url()
    train = Training(args)
    model = train.model
    numel = sum(p.numel() for p in model.parameters())
    print(f"model: {numel / 1e6:.1f}M parameters; S3: SeaweedFS on loopback; machine: {machine()}")

    live: dict[int, float] = {}
    follower = Follower(url, StateDictTarget(), policy=PollPolicy(fast_s=0.02), storage_options=opts,
                        on_step=lambda s: live.setdefault(s, time.perf_counter()))
    published: dict[int, float] = {}
    with DeltaPublisher(url, model, dtype=torch.bfloat16, anchor_every=1000, storage_options=opts) as pub:
        follower.start()
        for step in range(args.steps + 1):
            train.step()
            follower.wait_for(step - 1, timeout_s=120) if step else None  # one step in flight, as in RL
            pub.publish(step)
            published[step] = time.perf_counter()
        pub.flush()
        follower.wait_for(args.steps, timeout_s=120)
        follower.close()
    metrics = {m.step: m for m in pub.metrics}
    lat = {s: live[s] - published[s] for s in range(1, args.steps + 1)}
    print(f"latency publish()->applied in consumer: p50 {pct(list(lat.values()), 50) * 1e3:.0f} ms, "
          f"p95 {pct(list(lat.values()), 95) * 1e3:.0f} ms")

    # transfer stage vs plain s3fs on the same objects, same run
    import s3fs

    fs = s3fs.S3FileSystem(skip_instance_cache=True, **opts)
    store = Store(url, storage_options=opts)
    reader = StreamReader(url, storage_options=opts, cache_dir=work / "cache")
    rows = []
    for step in range(1, args.steps + 1):
        m = store.manifest(step)
        obj = work / f"obj-{step}"
        fs.get_file(store.path(step_dir(step), m.object), str(obj))
        plain_key = f"{url[len('s3://'):]}/plain/{step}"
        t0 = time.perf_counter()
        fs.put_file(str(obj), plain_key)
        t1 = time.perf_counter()
        fs.get_file(plain_key, str(work / "plain-get"))
        t2 = time.perf_counter()
        spool = work / "spool"
        shutil.copyfile(obj, spool)
        t3 = time.perf_counter()
        store.transport.put(f"again/{step}/{m.object}", spool)  # deltasync's upload stage
        t4 = time.perf_counter()
        reader.store.fetch_object(m)  # deltasync's download stage: download + size + digest check
        t5 = time.perf_counter()
        rows.append({
            "step": step,
            "object_bytes": m.object_bytes,
            "density": m.stats.density,
            "latency_s": lat[step],
            "capture_s": metrics[step].capture_s,
            "encode_s": metrics[step].encode_s,
            "commit_s": metrics[step].upload_s,
            "plain_put_s": t1 - t0,
            "plain_get_s": t2 - t1,
            "deltasync_put_s": t4 - t3,
            "deltasync_get_s": t5 - t4,
        })
    nbytes = sum(r["object_bytes"] for r in rows)

    def tput(key: str) -> float:
        return nbytes / sum(r[key] for r in rows) / 1e6

    from rich.console import Console
    from rich.table import Table

    t = Table(title=f"S3 (SeaweedFS, loopback): {numel / 1e6:.0f}M params, {len(rows)} delta steps, "
              f"mean object {nbytes / len(rows) / 1e6:.2f} MB, mean density "
              f"{np.mean([r['density'] for r in rows]):.2%}")
    for col in ("measure", "p50", "p95", "mean"):
        t.add_column(col, justify="right")
    for key, label in (("latency_s", "publish -> consumer applied (ms)"),
                       ("capture_s", "capture on trainer thread (ms)"),
                       ("encode_s", "encode (ms)"), ("commit_s", "commit: lease check + upload + manifest (ms)")):
        xs = [r[key] for r in rows]
        t.add_row(label, f"{pct(xs, 50) * 1e3:.0f}", f"{pct(xs, 95) * 1e3:.0f}", f"{np.mean(xs) * 1e3:.0f}")
    Console(width=120).print(t)
    t2 = Table(title="transfer stage vs plain s3fs, same objects, same run")
    for col in ("direction", "plain s3fs MB/s", "deltasync MB/s", "ratio (target >= 0.8)"):
        t2.add_column(col, justify="right")
    for d, plain, ours in (("upload", "plain_put_s", "deltasync_put_s"),
                           ("download (+digest check)", "plain_get_s", "deltasync_get_s")):
        t2.add_row(d, f"{tput(plain):.0f}", f"{tput(ours):.0f}", f"{tput(ours) / tput(plain):.2f}")
    Console(width=120).print(t2)
    write_results(args, "s3", {"numel": numel, "rows": rows})


if __name__ == "__main__":
    main()
