"""DeltaSyncCallback in a real transformers Trainer training an FSDP2 model: 2 ranks under torchrun (gloo, CPU).

accelerate enables FSDP only on accelerators (on CPU, ``TrainingArguments(fsdp=...)`` silently trains DDP),
so the model is sharded the way transformers does it natively: ``from_pretrained(distributed_config=
DistributedConfig(fsdp_size=2))`` applies ``fully_shard`` (every parameter a ``DTensor``) and the Trainer
trains it as it is. The independent reference is the trainer's own full state after every step, gathered by
``get_model_state_dict(full_state_dict=True)`` in a callback that runs after DeltaSyncCallback; the stream is
read back in this process.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("accelerate", reason="transformers' Trainer needs accelerate (pip install accelerate)")
pytest.importorskip("transformers.distributed", reason="needs transformers with from_pretrained(distributed_config=)")

from deltasync import StreamReader
from deltasync.testing import save_model_dir, tiny_qwen3

WORKER = r"""import json, os, sys
import torch
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from transformers import Qwen3ForCausalLM, Trainer, TrainerCallback, TrainingArguments
from transformers.distributed import DistributedConfig

from deltasync.integrations.transformers import DeltaSyncCallback

model_dir, url, out, steps = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
model = Qwen3ForCausalLM.from_pretrained(model_dir, distributed_config=DistributedConfig(fsdp_size=2),
                                         dtype=torch.float32)
rank = int(os.environ["RANK"])


class Tokens(torch.utils.data.Dataset):
    def __init__(self):
        self.ids = torch.randint(0, 512, (16, 16), generator=torch.Generator().manual_seed(0))
    def __len__(self):
        return len(self.ids)
    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


class Reference(TrainerCallback):
    # the full weights after each step (a collective: every rank), saved by rank 0; and every log this rank sees
    def __init__(self):
        self.logs = []
    def save(self, model, step):
        full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        if rank == 0:
            torch.save({k: v.clone() for k, v in full.items()}, os.path.join(out, f"ref-{step}.pt"))
    def on_train_begin(self, args, state, control, model=None, **kw):
        self.save(model, state.global_step)
    def on_step_end(self, args, state, control, model=None, **kw):
        self.save(model, state.global_step)
    def on_log(self, args, state, control, logs=None, **kw):
        self.logs.append(dict(logs or {}))


args = TrainingArguments(output_dir=os.path.join(out, f"trainer-{rank}"), max_steps=steps,
                         per_device_train_batch_size=2, learning_rate=1e-3, logging_steps=1, save_strategy="no",
                         report_to=[], use_cpu=True, disable_tqdm=True, seed=0)
callback, reference = DeltaSyncCallback(url, anchor_every=2), Reference()
trainer = Trainer(model=model, args=args, train_dataset=Tokens(), callbacks=[callback, reference])
trainer.train()
with open(os.path.join(out, f"rank-{rank}.json"), "w") as f:
    json.dump({"mode": callback.mode, "closed": callback.publisher is None,
               "dtensors": sum(type(p).__name__ == "DTensor" for p in model.parameters()),
               "logs": [l for l in reference.logs if "loss" in l]}, f)
"""


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


def test_fsdp2_trainer_publishes_from_every_rank_bit_exactly(tmp_path: Path) -> None:
    save_model_dir(tiny_qwen3(hidden_size=64, layers=2), tmp_path / "model", dtype=torch.float32)
    script, url, out = tmp_path / "worker.py", tmp_path / "stream", tmp_path / "out"
    script.write_text(WORKER)
    out.mkdir()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(Path(__file__).resolve().parent.parent)}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(script),
           str(tmp_path / "model"), str(url), str(out), "3"]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]

    ranks = [json.loads((out / f"rank-{r}.json").read_text()) for r in range(2)]
    for r in ranks:  # really sharded, published per rank, closed at train end
        assert r["mode"] == "sharded" and r["closed"] and r["dtensors"] > 0
    with StreamReader(str(url)) as reader:
        assert reader.steps() == [0, 1, 2, 3]  # the initial weights, then one step per optimizer step
        assert [reader.manifest(s).kind for s in reader.steps()] == ["anchor", "delta", "anchor", "delta"]
        for s in reader.steps():
            m = reader.manifest(s)
            assert m.parts is not None and len(m.parts) == 2, f"step {s}: expected one part per rank"
            ref = torch.load(out / f"ref-{s}.pt")
            got = reader.state_dict(s)
            assert set(got) == set(ref)
            bad = [n for n in ref if got[n].dtype != ref[n].dtype or not torch.equal(_bits(got[n]), _bits(ref[n]))]
            assert not bad, f"step {s}: tensors differ from the trainer's full state: {bad}"
        assert not all(torch.equal(a, b)
                       for a, b in zip(reader.state_dict(0).values(), reader.state_dict(3).values(), strict=True))

        # every rank's training logs carry the newest committed step's figures; the whole step's bytes agree
        for r in ranks:
            assert len(r["logs"]) == 3
            for log in r["logs"]:
                assert log["deltasync/lag_steps"] == 0  # sharded steps commit on the trainer's thread
                m = reader.manifest(int(log["deltasync/step"]))
                assert log["deltasync/bytes"] == m.object_bytes and log["deltasync/anchor"] == (m.kind == "anchor")
                assert 0 < log["deltasync/part_bytes"] <= log["deltasync/bytes"]
