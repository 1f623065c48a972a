"""A vLLM engine follows a sharded stream: two torchrun ranks (gloo, CPU) publish a Qwen3 checkpoint's weights
as DTensors sharded on dim 0, each rank its own part of every step; the deltasync weight-transfer engine reads
the multi-part steps unchanged, verified. The reference: rank 0's full tensors (``full_tensor()``) at the last
step, checksummed here."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from deltasync import StreamReader
from deltasync.engine import tensor_checksum
from tests.integration.conftest import build_checkpoint

pytestmark = pytest.mark.vllm

STEPS = 3

TRAINER = r"""import sys
import torch
import torch.distributed as dist
from safetensors.torch import load_file
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

from deltasync import DeltaPublisher

model_dir, url, out, steps = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
dist.init_process_group("gloo")
mesh = init_device_mesh("cpu", (dist.get_world_size(),))
full = load_file(f"{model_dir}/model.safetensors")
state = {n: distribute_tensor(t, mesh, [Shard(0)]) for n, t in full.items()}
with DeltaPublisher(url, state, anchor_every=100) as pub:
    for step in range(steps + 1):
        if step:
            g = torch.Generator().manual_seed(step)
            for t in state.values():  # ~3% of each rank's elements change, as an optimizer step would
                local = t.to_local().view(-1)
                if local.numel():
                    idx = torch.randint(0, local.numel(), (max(1, local.numel() // 32),), generator=g)
                    local[idx] = (local[idx].float() * 1.01 + 1e-3).to(local.dtype)
        pub.publish(step)
final = {n: t.full_tensor() for n, t in state.items()}
if dist.get_rank() == 0:
    torch.save(final, out)
dist.destroy_process_group()
"""

ENGINE = textwrap.dedent(
    """
    import json, sys
    from rollout_loader.vllm import start_engine

    if __name__ == "__main__":
        model, url, out = sys.argv[1:4]
        llm = start_engine(model, in_process=True, dtype="bfloat16", enforce_eager=True,
                           max_model_len=512, seed=0)
        llm.init_weight_transfer_engine({"init_info": {"url": url, "verify": "incremental"}})
        llm.start_weight_update()
        llm.update_weights({"update_info": {"step": "latest"}})
        engine = llm.llm_engine.model_executor.driver_worker.worker.weight_transfer_engine
        llm.finish_weight_update(weight_version=str(engine.held_step))
        sums = engine._state.checksums()
        json.dump({"version": llm.get_weight_version(), "checksums": {n: str(v) for n, v in sums.items()}},
                  open(out, "w"))
    """
)


def test_engine_follows_a_sharded_stream(tmp_path):
    model_dir = tmp_path / "model"
    build_checkpoint(model_dir, tie=False)
    url = str(tmp_path / "stream")
    final = tmp_path / "final.pt"
    script = tmp_path / "trainer.py"
    script.write_text(TRAINER)
    root = str(Path(__file__).resolve().parents[2])
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": root}
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                        str(script), str(model_dir), url, str(final), str(STEPS)],
                       env=env, capture_output=True, text=True, timeout=300, check=False)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    with StreamReader(url) as reader:
        assert reader.steps() == list(range(STEPS + 1))
        assert all(reader.manifest(s).is_multipart and len(reader.manifest(s).objects) == 2  # one part per rank
                   for s in reader.steps())

    result = tmp_path / "engine.json"
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "DELTASYNC_CPU_LIVE_WEIGHTS": "1", "PYTHONPATH": root}
    r = subprocess.run([sys.executable, "-c", ENGINE, str(model_dir), url, str(result)],
                       capture_output=True, text=True, timeout=400, check=False, env=env)
    assert r.returncode == 0, r.stderr[-4000:]
    got = json.loads(result.read_text())
    assert got["version"] == str(STEPS)
    want = {n: tensor_checksum(t) for n, t in torch.load(final).items()}
    assert {n: int(v) for n, v in got["checksums"].items()} == want
