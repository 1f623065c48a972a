"""End to end: a trainer publishes, a real vLLM engine follows, and ends bit-identical to the trainer."""

from __future__ import annotations

import pytest
import torch

from deltasync import DeltaPublisher, StreamReader
from deltasync.format.checksum import parse_checksum
from deltasync.errors import BaseStepMismatchError, ChecksumMismatchError
from rollout_loader import Follower
from rollout_loader.vllm import VllmTarget
from rollout_loader.worker import engine_checksums
from tests.integration.conftest import build_checkpoint, engine, generate, save_like

pytestmark = pytest.mark.vllm


def train_and_publish(model_dir, url, steps: int, *, lr: float = 3e-4) -> dict[int, dict[str, torch.Tensor]]:
    """Train the checkpoint's model (fp32 master weights) and publish every step as bf16."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32)
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    g = torch.Generator().manual_seed(0)
    states = {}
    with DeltaPublisher(url, model, dtype=torch.bfloat16, anchor_every=4, on_backlog="block") as pub:
        for step in range(steps):
            if step:
                batch = torch.randint(0, model.config.vocab_size, (2, 33), generator=g)
                model(input_ids=batch[:, :-1], labels=batch[:, 1:]).loss.backward()
                opt.step()
                opt.zero_grad()
            pub.publish(step)
            states[step] = {k: v.detach().to(torch.bfloat16).clone() for k, v in model.state_dict().items()}
    return states


@pytest.mark.parametrize("tie", [False, True], ids=["untied", "tied"])
def test_engine_follows_training_bit_exactly(tmp_path, tie):
    model_dir = tmp_path / "model"
    build_checkpoint(model_dir, tie=tie)
    url = str(tmp_path / "stream")
    steps = 6
    states = train_and_publish(model_dir, url, steps)
    reader = StreamReader(url)
    last = steps - 1

    with engine(model_dir, "bfloat16", live=True) as llm:
        target = VllmTarget(llm, verify="all")
        follower = Follower(reader, target)
        before = generate(llm)
        assert follower.sync(2) == [0, 1, 2]  # the anchor, then deltas in place
        assert follower.sync() == [4, 5]  # the chain to 5 starts at the anchor 4: loaded through vLLM's reload path
        assert target.step == last
        with reader.open(last) as obj:
            want = {n: parse_checksum(t.checksum) for n, t in obj.header.tensors.items()}
        assert engine_checksums(llm) == want  # the engine holds exactly the trainer's bits
        followed = generate(llm)

        # a delta on another base is refused, and nothing changes
        with reader.open(3) as obj, pytest.raises(BaseStepMismatchError, match="engine holds step 5"):
            target.apply(obj)
        assert engine_checksums(llm) == want and target.step == last

    # a fresh engine loaded from the trainer's own weights at the last step gives the same greedy tokens,
    # for a prompt longer than one KV block too (proves the prefix cache was dropped after each update)
    trained = {k: v for k, v in states[last].items() if not (tie and k == "lm_head.weight")}
    with engine(save_like(model_dir, tmp_path / "trained", trained), "bfloat16", live=True) as fresh:
        assert generate(fresh) == followed
    assert followed != before


def test_damaged_step_rolls_back_and_refuses_to_serve_a_false_step(tmp_path):
    model_dir = tmp_path / "model"
    build_checkpoint(model_dir, tie=False)
    url = str(tmp_path / "stream")
    train_and_publish(model_dir, url, 3)
    reader = StreamReader(url)
    with engine(model_dir, "bfloat16", live=True) as llm:
        target = VllmTarget(llm)  # verify="incremental"
        Follower(reader, target).sync(1)
        held = engine_checksums(llm)  # a full recomputation agrees with the incrementally verified step
        with reader.open(1) as obj:
            assert held == {n: parse_checksum(t.checksum) for n, t in obj.header.tensors.items()}
        tokens = generate(llm)
        with reader.open(2) as obj:
            # the trainer's checksum for one changed tensor is made wrong: the apply cannot verify
            name = next(n for n, t in obj.header.tensors.items() if t.changed)
            t = obj.header.tensors[name]
            obj.header.tensors[name] = type(t)(**{**t.__dict__, "checksum": "0x0123456789abcdef"})
            with pytest.raises(ChecksumMismatchError, match="rolled back to step 1"):
                target.apply(obj)
        assert target.step == 1
        assert engine_checksums(llm) == held and generate(llm) == tokens


def test_deltas_fetched_into_memory_reach_the_workers(tmp_path):
    """From a remote store small deltas come into memory, not files; the worker-extension path, which hands
    workers a path, writes them to a temporary file for the call and removes it."""
    import os
    import tempfile
    import uuid

    model_dir = tmp_path / "model"
    build_checkpoint(model_dir, tie=False)
    url = f"memory://deltasync-vllm-{uuid.uuid4().hex[:8]}"  # not local: deltas are read into memory
    train_and_publish(model_dir, url, 3)
    with StreamReader(url) as reader, engine(model_dir, "bfloat16", live=True) as llm:
        with reader.open(1) as obj:
            assert obj.path is None and obj.buffer is not None
        target = VllmTarget(llm)
        assert Follower(reader, target).sync() == [0, 1, 2]
        with reader.open(2) as obj:
            want = {n: parse_checksum(t.checksum) for n, t in obj.header.tensors.items()}
        assert engine_checksums(llm) == want
    assert not [p for p in os.listdir(tempfile.gettempdir()) if p.startswith("deltasync-object-")]
