"""DeltaSyncCallback in a real transformers Trainer (and TRL's GRPOTrainer) on a tiny Qwen3 on CPU: the stream
holds the model's exact bits after the last step, the metrics reach the Trainer's logs, an FSDP2 model publishes
per rank and FSDP1 is refused."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

pytest.importorskip("accelerate", reason="transformers' Trainer needs accelerate (pip install accelerate)")

from transformers import Trainer, TrainerCallback, TrainingArguments

from deltasync import StreamReader
from deltasync.errors import ConfigError
from deltasync.integrations.transformers import DeltaSyncCallback
from deltasync.testing import tiny_qwen3

INT_VIEW = {2: torch.int16, 4: torch.int32}


class TokenData(torch.utils.data.Dataset):
    """Random token sequences, labels = inputs (a causal LM loss)."""

    def __init__(self, n: int = 16, seq_len: int = 16, vocab: int = 512) -> None:
        g = torch.Generator().manual_seed(0)
        self.ids = torch.randint(0, vocab, (n, seq_len), generator=g)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


class Recorder(TrainerCallback):
    """Keeps a copy of every ``logs`` dict it is shown (as a reporting callback would send it)."""

    def __init__(self) -> None:
        self.logs: list[dict] = []

    def on_log(self, args, state, control, logs=None, **kwargs):
        self.logs.append(dict(logs or {}))


class Committed(TrainerCallback):
    """Waits, at the end of each step (after the DeltaSyncCallback captured it), until the step is committed."""

    def __init__(self, callback: DeltaSyncCallback) -> None:
        self.callback = callback

    def on_step_end(self, args, state, control, **kwargs):
        self.callback.publisher.flush()


def training_args(tmp_path, steps: int, **kw) -> TrainingArguments:
    return TrainingArguments(
        output_dir=str(tmp_path / "out"), max_steps=steps, per_device_train_batch_size=4, learning_rate=1e-3,
        logging_steps=1, save_strategy="no", report_to=[], use_cpu=True, disable_tqdm=True, seed=0, **kw,
    )


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().view(INT_VIEW[t.element_size()])


def assert_bit_exact(state: dict[str, torch.Tensor], model: torch.nn.Module, dtype: torch.dtype) -> None:
    want = {k: v.detach().to(dtype) for k, v in model.state_dict().items()}
    assert set(state) == set(want)
    for name, t in want.items():
        assert state[name].dtype == dtype and torch.equal(bits(state[name]), bits(t)), name


@pytest.mark.parametrize("dtype", [None, torch.bfloat16], ids=["fp32", "bf16"])
def test_trainer_publishes_every_step_bit_exactly(tmp_path, dtype):
    model = tiny_qwen3(hidden_size=64, layers=1).float()
    url = str(tmp_path / "stream")
    callback = DeltaSyncCallback(url, anchor_every=3, on_backlog="block", **({"dtype": dtype} if dtype else {}))
    recorder = Recorder()
    trainer = Trainer(model=model, args=training_args(tmp_path, 4), train_dataset=TokenData(),
                      callbacks=[callback, recorder])
    trainer.train()
    assert callback.publisher is None  # closed at train end

    with StreamReader(url) as reader:
        assert reader.steps() == [0, 1, 2, 3, 4]  # the initial weights, then one step per optimizer step
        assert [reader.manifest(s).kind for s in reader.steps()] == ["anchor", "delta", "delta", "anchor", "delta"]
        assert_bit_exact(reader.state_dict(4), model, dtype or torch.float32)

    # every training log carries the lag; from the first commit on (by the last log at the latest: the backlog
    # holds at most max_pending (2) captured steps plus the one uploading), the newest committed step's numbers
    train_logs = [log for log in recorder.logs if "loss" in log]
    assert len(train_logs) == 4
    numbered = [log for log in train_logs if "deltasync/step" in log]
    assert numbered and numbered == train_logs[len(train_logs) - len(numbered):], train_logs
    for log in train_logs:
        assert all(isinstance(v, (int, float)) for k, v in log.items() if k.startswith("deltasync/"))
        # captured, not yet committed: at most max_pending (2) queued plus the one being uploaded
        assert 0 <= log["deltasync/lag_steps"] <= 3
    for log in numbered:
        assert {"deltasync/step", "deltasync/bytes", "deltasync/capture_s", "deltasync/encode_s",
                "deltasync/upload_s", "deltasync/lag_steps"} <= set(log) and log["deltasync/bytes"] > 0
        assert ("deltasync/density" in log) == (log["deltasync/anchor"] == 0)  # a delta's change density
    with StreamReader(url) as reader:  # the numbers are those of the step they name
        for log in numbered:
            m = reader.manifest(log["deltasync/step"])
            assert log["deltasync/bytes"] == m.object_bytes and log["deltasync/anchor"] == (m.kind == "anchor")
            if m.kind == "delta":
                assert log["deltasync/density"] == pytest.approx(m.stats.density)
    # and the Trainer's own history (saved in its checkpoints) has them too
    history = [h for h in trainer.state.log_history if "loss" in h]
    assert [h.get("deltasync/step") for h in history] == [log.get("deltasync/step") for log in train_logs]


def test_attach_puts_metrics_ahead_of_reporting_callbacks(tmp_path):
    """The Trainer puts the callbacks it is given after its reporters: attach() puts this one first."""
    model = tiny_qwen3(hidden_size=64, layers=1).float()
    reporter = Recorder()  # stands for W&B or TensorBoard: registered before user callbacks
    trainer = Trainer(model=model, args=training_args(tmp_path, 2), train_dataset=TokenData(), callbacks=[reporter])
    callback = DeltaSyncCallback(str(tmp_path / "stream"), on_backlog="block")
    assert callback.attach(trainer) is trainer
    # each step committed before its log (publishing is asynchronous: on a fresh install the first upload
    # waits for the kernels to compile, and a log would come before any commit whatever the order)
    trainer.add_callback(Committed(callback))
    trainer.train()
    assert [("deltasync/bytes" in log) for log in reporter.logs if "loss" in log] == [True, True]


def test_resumed_run_does_not_republish_and_a_stream_ahead_is_refused(tmp_path):
    url = str(tmp_path / "stream")
    model = tiny_qwen3(hidden_size=64, layers=1).float()
    Trainer(model=model, args=training_args(tmp_path, 2), train_dataset=TokenData(),
            callbacks=[DeltaSyncCallback(url, on_backlog="block")]).train()
    # a second train() starts from global step 0 while the stream holds step 2: nothing is replaced
    trainer = Trainer(model=model, args=training_args(tmp_path, 2), train_dataset=TokenData(),
                      callbacks=[cb := DeltaSyncCallback(url)])
    with pytest.raises(ConfigError, match=r"already holds step 2, after the Trainer's step 0"):
        trainer.train()
    assert cb.publisher is None
    with StreamReader(url) as reader:
        assert reader.steps() == [0, 1, 2]


def _state(*, zero: bool, step: int = 0):
    return type("State", (), {"is_world_process_zero": zero, "global_step": step})()


class _Args:
    """What the callback reads of TrainingArguments, for the cases a CPU Trainer cannot set up itself."""

    fsdp = ""
    deepspeed = None


def test_fsdp1_is_refused_on_every_rank_before_anything_is_created(tmp_path):
    """A real FSDP1 module (gloo, world size 1): flat parameters, no DTensor state dict to publish per rank."""
    import torch.distributed as dist
    from torch.distributed.fsdp import FullyShardedDataParallel

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    try:
        model = FullyShardedDataParallel(tiny_qwen3(hidden_size=64, layers=1).float(), device_id=torch.device("cpu"))
        for zero in (True, False):  # every rank refuses alike (none waits in a collective for the others)
            with pytest.raises(ConfigError,
                               match=r"FSDP1 \(a FullyShardedDataParallel module\).*no DTensor state dict.*FSDP2"):
                DeltaSyncCallback(str(tmp_path / "stream")).on_train_begin(_Args(), _state(zero=zero), None,
                                                                           model=model)
    finally:
        dist.destroy_process_group()
    assert not (tmp_path / "stream").exists()


def test_fsdp_asked_for_but_not_applied_publishes_from_rank_zero(tmp_path):
    """accelerate trains DDP where FSDP is unavailable (CPU): every rank holds the full weights, rank 0 publishes."""
    model = tiny_qwen3(hidden_size=64, layers=1).float()
    args = _Args()
    args.fsdp = "full_shard"
    other = DeltaSyncCallback(str(tmp_path / "stream"))
    other.on_train_begin(args, _state(zero=False), None, model=model)
    assert other.mode == "single" and other.publisher is None and not (tmp_path / "stream").exists()
    callback = DeltaSyncCallback(str(tmp_path / "stream"))
    callback.on_train_begin(args, _state(zero=True), None, model=model)
    callback.on_train_end(args, _state(zero=True), None)
    with StreamReader(str(tmp_path / "stream")) as reader:
        assert reader.steps() == [0]
        assert_bit_exact(reader.state_dict(0), model, torch.float32)


def test_fully_sharded_model_publishes_its_shards(tmp_path):
    """A real FSDP2 model (fully_shard, gloo, world size 1) is recognised from the model alone and published
    per rank: the hooks a Trainer calls, around AdamW steps (2 ranks under torchrun: test_integrations_fsdp2.py)."""
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
    )
    from torch.distributed.fsdp import fully_shard

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    try:
        model = tiny_qwen3(hidden_size=64, layers=1).float()
        fully_shard(model)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        callback = DeltaSyncCallback(str(tmp_path / "stream"), dtype=torch.bfloat16)
        callback.on_train_begin(_Args(), _state(zero=True), None, model=model)
        assert callback.mode == "sharded"
        for step in (1, 2):
            ids = torch.randint(0, 512, (2, 8), generator=torch.Generator().manual_seed(step))
            model(input_ids=ids).logits.square().mean().backward()
            opt.step()
            opt.zero_grad()
            callback.on_step_end(_Args(), _state(zero=True, step=step), None)
        logs: dict = {}
        callback.on_log(_Args(), type("State", (), {"global_step": 2, "log_history": []})(), None, logs=logs)
        full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        callback.on_train_end(_Args(), _state(zero=True, step=2), None)
    finally:
        dist.destroy_process_group()
    assert callback.publisher is None
    assert logs["deltasync/step"] == 2 and logs["deltasync/lag_steps"] == 0 and logs["deltasync/bytes"] > 0
    with StreamReader(str(tmp_path / "stream")) as reader:
        assert reader.steps() == [0, 1, 2] and reader.manifest(2).parts is not None
        got = reader.state_dict(2)
        assert set(got) == set(full)
        for name, t in full.items():
            assert got[name].dtype == torch.bfloat16 and torch.equal(bits(got[name]), bits(t.to(torch.bfloat16))), name


def test_trl_grpo_trainer_publishes_bit_exactly(tmp_path):
    """TRL's GRPOTrainer (a Trainer subclass: generation, a reward, a policy step) with the callback, 2 steps."""
    pytest.importorskip("trl", reason="TRL is not installed (pip install trl; tested with trl 1.16.0)")
    from datasets import Dataset
    from transformers import AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    from deltasync.testing import save_model_dir

    model = tiny_qwen3(hidden_size=64, layers=1).float()
    save_model_dir(model, tmp_path / "model", dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "model")  # byte-level: token ids are byte values
    tokenizer.pad_token, tokenizer.eos_token = tokenizer.convert_ids_to_tokens([0, 255])
    args = GRPOConfig(
        output_dir=str(tmp_path / "out"), max_steps=2, per_device_train_batch_size=4, num_generations=4,
        max_completion_length=8, learning_rate=1e-3, logging_steps=1, save_strategy="no", report_to=[],
        use_cpu=True, disable_tqdm=True, seed=0,
    )
    url = str(tmp_path / "stream")
    recorder = Recorder()
    trainer = GRPOTrainer(
        model=model, reward_funcs=lambda completions, **_: [float(len(c)) for c in completions], args=args,
        train_dataset=Dataset.from_dict({"prompt": ["abc", "hello", "xyz", "def"] * 2}), processing_class=tokenizer,
        callbacks=[DeltaSyncCallback(url, on_backlog="block"), recorder],
    )
    trainer.train()
    with StreamReader(url) as reader:
        assert reader.steps() == [0, 1, 2]
        assert_bit_exact(reader.state_dict(2), model, torch.float32)
        assert not all(torch.equal(a, b)
                       for a, b in zip(reader.state_dict(0).values(), reader.state_dict(2).values(), strict=True))
    train_logs = [log for log in recorder.logs if "reward" in log]
    assert len(train_logs) == 2 and all("deltasync/bytes" in log for log in train_logs)


def test_importing_deltasync_does_not_import_transformers():
    code = "import sys, deltasync, deltasync.integrations; print('transformers' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout == "False\n"
