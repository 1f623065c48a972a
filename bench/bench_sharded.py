"""Sharded publish benchmark: every rank publishes its own shard vs gather-then-publish on rank 0.

    .venv/bin/python bench/bench_sharded.py [--worlds 2 4] [--hidden 2048 --layers 8] [--steps 5] [--density 0.02]

A bf16 MLP (``layers`` square ``hidden`` x ``hidden`` linears) is sharded with FSDP2 ``fully_shard`` on a
CPU gloo mesh (torchrun, one process per rank). Each step changes ``density`` of every shard's elements
(same seed in both modes), then:
  sharded   every rank calls ``DeltaPublisher.publish(step)`` (its own part; rank 0 commits);
  gather    ``get_model_state_dict(full_state_dict=True, cpu_offload=True)`` on every rank, then rank 0
            publishes the full state with a single-writer ``DeltaPublisher`` and waits for the commit.
Reported per rank: mean seconds per delta step (the rank's whole share, upload included), the growth of
its peak RSS over the run (the snapshot and the gathered copies), and the bytes it sent to other ranks
(sharded: the pickled metadata of the publisher's collectives; gather: its shard of every gather).
Prints a table and writes bench/results/sharded-<date>.json.
"""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench._common import machine, write_results  # noqa: E402


def rank_main(mode: str, url: str, out: str, hidden: int, layers: int, steps: int, density: float) -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from deltasync import DeltaPublisher

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(0)
    layers_ = [torch.nn.Linear(hidden, hidden, bias=False) for _ in range(layers)]
    model = torch.nn.Sequential(*layers_).to(torch.bfloat16)
    for m in model:
        fully_shard(m, mesh=mesh)
    fully_shard(model, mesh=mesh)
    model_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    pub = None
    if mode == "sharded":
        pub = DeltaPublisher(url, model, anchor_every=10**6, lease_s=600)
    elif rank == 0:
        pub = DeltaPublisher(url, lambda: full, anchor_every=10**6, lease_s=600, on_backlog="block", sharded=False)
    full: dict[str, torch.Tensor] = {}
    gen = torch.Generator().manual_seed(rank)
    times, sent = [], 0
    for step in range(steps + 1):  # step 0: the anchor
        with torch.no_grad():
            for p in model.parameters():
                local = p.to_local().view(-1)
                idx = torch.randint(0, local.numel(), (max(1, int(density * local.numel())),), generator=gen)
                local[idx] += local[idx].abs().clamp_min(1e-3) * 0.01
        dist.barrier()
        t0 = time.perf_counter()
        if mode == "sharded":
            pub.publish(step)
        else:
            full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
            sent += model_bytes // world  # this rank's shard of every tensor went to rank 0
            if pub is not None:
                pub.publish(step)
                pub.flush()
            del full
        times.append(time.perf_counter() - t0)
    if mode == "sharded":
        sent = pub._sharded.group.sent_bytes
    if pub is not None:
        pub.close()
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - rss0
    result = {"rank": rank, "world": world, "mode": mode, "anchor_s": times[0],
              "delta_s": sum(times[1:]) / max(1, steps),
              "peak_rss_growth_bytes": rss, "sent_bytes": sent, "model_bytes": model_bytes}
    Path(out, f"{mode}-{world}-{rank}.json").write_text(json.dumps(result))
    dist.destroy_process_group()


def main() -> None:
    import argparse

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--worlds", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--density", type=float, default=0.02)
    ap.add_argument("--out", default=str(Path(__file__).parent / "results"))
    args = ap.parse_args()
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench-sharded-") as tmp:
        for world in args.worlds:
            for mode in ("sharded", "gather"):
                url = str(Path(tmp) / f"{mode}-{world}")
                cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={world}",
                       __file__,
                       "--rank-main", mode, url, tmp, str(args.hidden), str(args.layers), str(args.steps),
                       str(args.density)]
                env = {**os.environ, "OMP_NUM_THREADS": "1"}
                subprocess.run(cmd, check=True, env=env, stdout=subprocess.DEVNULL)
                rows += [json.loads(Path(tmp, f"{mode}-{world}-{r}.json").read_text()) for r in range(world)]
    print(f"machine: {machine()}")
    print(f"{'world':>5} {'mode':>8} {'rank':>4} {'anchor s':>9} {'delta s':>8} {'peak RSS +MB':>12} {'sent MB':>9} "
          f"{'model MB':>9}")
    for r in rows:
        print(f"{r['world']:>5} {r['mode']:>8} {r['rank']:>4} {r['anchor_s']:>9.3f} {r['delta_s']:>8.3f} "
              f"{r['peak_rss_growth_bytes'] / 1e6:>12.1f} {r['sent_bytes'] / 1e6:>9.3f} {r['model_bytes'] / 1e6:>9.1f}")
    write_results(args, "sharded", {"rows": rows})


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--rank-main":
        mode, url, out, hidden, layers, steps, density = sys.argv[2:9]
        rank_main(mode, url, out, int(hidden), int(layers), int(steps), float(density))
    else:
        main()
