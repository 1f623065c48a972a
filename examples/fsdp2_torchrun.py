"""FSDP2 (``fully_shard``) under torchrun: every rank publishes its own shard, nothing is gathered to publish.

Each rank builds the same small model, shards it with ``fully_shard`` (every parameter a ``DTensor`` holding
this rank's rows), trains with AdamW and calls ``pub.publish(step)``: each rank diffs and uploads its own
shard as one part of the step, rank 0 commits the step's manifest. At the end rank 0 reads the stream back
and compares it bit for bit with the model's full state (``get_model_state_dict(full_state_dict=True)``,
gathered only for this check).

    torchrun --nproc_per_node 2 examples/fsdp2_torchrun.py --steps 6
    python examples/fsdp2_torchrun.py --steps 6      # starts torchrun itself (2 ranks)

CPU (gloo) here; on GPUs the same code runs with nccl (the publisher's own metadata group is always gloo).
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from deltasync import DeltaPublisher, StreamReader


class Block(torch.nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = torch.nn.LayerNorm(width)
        self.up = torch.nn.Linear(width, 4 * width)
        self.down = torch.nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.nn.functional.gelu(self.up(self.norm(x))))


class TinyLM(torch.nn.Module):
    def __init__(self, vocab: int = 512, width: int = 64, layers: int = 2) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, width)
        self.blocks = torch.nn.ModuleList(Block(width) for _ in range(layers))
        self.head = torch.nn.Linear(width, vocab)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """Logits, one row per token (batch and time flattened). The head runs on rows: a Linear on a 3-D input
        returns a view, and FSDP2 warns that an in-place op on a view returned by a sharded module could produce
        wrong gradients (none happens here; the warning alarmed users of this example)."""
        x = self.embed(ids)
        for block in self.blocks:
            x = block(x)
        return self.head(x.flatten(0, 1))


def launch_torchrun(nproc: int) -> int:
    """Started with plain python: run this script under torchrun instead (what the docstring's first line does)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", *sys.argv]
    return subprocess.call(cmd, env={**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")})


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--nproc", type=int, default=2, help="ranks, when started without torchrun")
    parser.add_argument("--store", help="stream URL (default: a temporary folder, removed at the end)")
    args = parser.parse_args()
    if "RANK" not in os.environ:
        return launch_torchrun(args.nproc)

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))
    tmp = [tempfile.mkdtemp(prefix="deltasync-example-") if rank == 0 else None]
    dist.broadcast_object_list(tmp, src=0)  # every rank publishes to the same stream
    url = args.store or f"{tmp[0]}/stream"
    try:
        torch.manual_seed(0)  # the same initial weights on every rank, before sharding
        model = TinyLM()
        for block in model.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

        # the integration: one publisher per rank, publish(step) on every rank after each optimizer step
        with DeltaPublisher(url, model, dtype=torch.bfloat16, anchor_every=4) as pub:
            pub.publish(0)  # the initial weights
            for step in range(1, args.steps + 1):
                ids = torch.randint(0, 512, (4, 32), generator=torch.Generator().manual_seed(1000 * step + rank))
                loss = torch.nn.functional.cross_entropy(model(ids[:, :-1]), ids[:, 1:].flatten())
                loss.backward()
                opt.step()
                opt.zero_grad()
                pub.publish(step)
                if rank == 0:
                    print(f"step {step:3d}: loss {loss.item():.3f}, published from {world} ranks")

        full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        exact = True
        if rank == 0:
            with StreamReader(url) as reader:
                last, state = reader.steps()[-1], reader.state_dict(args.steps)
                parts = len(reader.manifest(last).parts or ())
            want = {name: t.to(torch.bfloat16) for name, t in full.items()}
            exact = last == args.steps and state.keys() == want.keys() and all(
                torch.equal(state[n].view(torch.int16), t.view(torch.int16)) for n, t in want.items()
            )
            print(f"stream {url}: steps 0..{last}, {parts} parts per step (one per rank)")
            print(f"bit-exact: {'yes' if exact else 'NO'}")
        verdict = [exact]
        dist.broadcast_object_list(verdict, src=0)  # every rank exits with rank 0's verdict
        return 0 if verdict[0] else 1
    finally:
        dist.barrier()
        if rank == 0:
            shutil.rmtree(tmp[0], ignore_errors=True)
        dist.destroy_process_group()


if __name__ == "__main__":
    raise SystemExit(main())
