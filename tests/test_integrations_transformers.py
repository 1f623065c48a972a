"""DeltaSyncCallback in a real transformers Trainer (and TRL's GRPOTrainer) on a tiny Qwen3 on CPU: the stream
holds the model's exact bits after the last step, the metrics reach the Trainer's logs, sharding is refused."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

pytest.importorskip("accelerate", reason="transformers' Trainer needs accelerate (pip install accelerate)")

from transformers import Trainer, TrainerCallback, TrainingArguments

from deltasync import ConfigError, StreamReader
from deltasync.integrations.transformers import DeltaSyncCallback
from deltasync_cli.demo import tiny_qwen3

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

    # every training log carries the newest committed step's numbers, for the callbacks after this one
    train_logs = [log for log in recorder.logs if "loss" in log]
    assert len(train_logs) == 4
    for log in train_logs:
        assert {"deltasync/step", "deltasync/bytes", "deltasync/capture_s", "deltasync/encode_s",
                "deltasync/upload_s", "deltasync/lag_steps"} <= set(log)
        assert all(isinstance(v, (int, float)) for k, v in log.items() if k.startswith("deltasync/"))
        assert 0 <= log["deltasync/lag_steps"] <= 2 and log["deltasync/bytes"] > 0
        assert ("deltasync/density" in log) == (log["deltasync/anchor"] == 0)  # a delta's change density
    with StreamReader(url) as reader:  # the numbers are those of the step they name
        for log in train_logs:
            m = reader.manifest(log["deltasync/step"])
            assert log["deltasync/bytes"] == m.object_bytes and log["deltasync/anchor"] == (m.kind == "anchor")
            if m.kind == "delta":
                assert log["deltasync/density"] == pytest.approx(m.stats.density)
    # and the Trainer's own history (saved in its checkpoints) has them too
    history = [h for h in trainer.state.log_history if "loss" in h]
    assert [h["deltasync/step"] for h in history] == [log["deltasync/step"] for log in train_logs]


def test_attach_puts_metrics_ahead_of_reporting_callbacks(tmp_path):
    """The Trainer puts the callbacks it is given after its reporters: attach() puts this one first."""
    model = tiny_qwen3(hidden_size=64, layers=1).float()
    reporter = Recorder()  # stands for W&B or TensorBoard: registered before user callbacks
    trainer = Trainer(model=model, args=training_args(tmp_path, 2), train_dataset=TokenData(), callbacks=[reporter])
    callback = DeltaSyncCallback(str(tmp_path / "stream"), on_backlog="block")
    assert callback.attach(trainer) is trainer
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


def test_sharded_training_is_refused_on_every_rank(tmp_path):
    model = tiny_qwen3(hidden_size=64, layers=1).float()

    class Args:
        fsdp = "full_shard"

    callback = DeltaSyncCallback(str(tmp_path / "stream"))
    state = type("State", (), {"is_world_process_zero": False, "global_step": 0})()
    with pytest.raises(ConfigError, match=r"sharded \(TrainingArguments.fsdp='full_shard'\).*issue 11"):
        callback.on_train_begin(Args(), state, None, model=model)
    assert not (tmp_path / "stream").exists()  # refused before anything was created


def test_fully_sharded_model_is_refused(tmp_path):
    """A real FSDP2 model (gloo, world size 1) is recognised from the model alone."""
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    try:
        model = tiny_qwen3(hidden_size=64, layers=1).float()
        fully_shard(model)
        state = type("State", (), {"is_world_process_zero": True, "global_step": 0})()
        with pytest.raises(ConfigError, match="no rank holds the full weights"):
            DeltaSyncCallback(str(tmp_path / "stream")).on_train_begin(object(), state, None, model=model)
    finally:
        dist.destroy_process_group()
    assert not (tmp_path / "stream").exists()


def test_trl_grpo_trainer_publishes_bit_exactly(tmp_path):
    """TRL's GRPOTrainer (a Trainer subclass: generation, a reward, a policy step) with the callback, 2 steps."""
    pytest.importorskip("trl", reason="TRL is not installed (pip install trl; tested with trl 1.16.0)")
    from datasets import Dataset
    from transformers import AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    from deltasync_cli.demo import save_model_dir

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
        assert not all(torch.equal(a, b) for a, b in zip(reader.state_dict(0).values(), reader.state_dict(2).values()))
    train_logs = [log for log in recorder.logs if "reward" in log]
    assert len(train_logs) == 2 and all("deltasync/bytes" in log for log in train_logs)


def test_importing_deltasync_does_not_import_transformers():
    code = "import sys, deltasync, deltasync.integrations; print('transformers' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout == "False\n"
