"""TRL's ``AsyncGRPOTrainer`` training with ``weight_transfer=DeltasyncWeightTransfer(...)`` against a real vLLM CPU
server running deltasync's engine (one server for the module, about a minute to start).

Real: vLLM's OpenAI server (the deltasync engine, live CPU weights), TRL 1.16.0's trainer and ``train()`` loop
(its callbacks call the weight transfer), its GRPO loss and AdamW steps, and its ``AsyncRolloutWorker``
generating from the server while the weights change under it. Stand-ins, for two GPU-only pieces only
(tests/integration/trl_cpu.py): the FA3 Hub kernel (the same attention in torch) and the peak-FLOPs query.
The reference for the server is a fresh engine loaded from the last step's replayed checkpoint.
"""

from __future__ import annotations

import json
import urllib.request

import pytest
import torch

pytest.importorskip("trl", reason="TRL is not installed (pip install 'deltasync[trl]')")

from deltasync import DeltaPublisher, StreamReader, replay_to_folder
from deltasync.errors import ConfigError
from deltasync.format.checksum import parse_checksum
from rollout_loader.integrations.trl import DeltasyncWeightTransfer
from rollout_loader.vllm import HttpWeightTransfer
from tests.integration.conftest import PROMPTS, engine, generate
from tests.integration.test_vllm_server import vllm_server
from tests.integration.trl_cpu import chat_model, reward_short, run_on_cpu

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

STEPS = 2


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """(server URL, model folder): the server serves the model under its path, the name TRL's rollout worker
    asks for (``get_config_model_id``)."""
    root = tmp_path_factory.mktemp("trl-async")
    model_dir = chat_model(root / "model")
    with vllm_server(model_dir, root / "server.log", served_name=str(model_dir)) as base:
        yield base, model_dir


@pytest.fixture(scope="module")
def trained(served, tmp_path_factory):
    """A real ``AsyncGRPOTrainer.train()`` of STEPS steps: steps numbered by the trainer's optimizer step."""
    from datasets import Dataset
    from transformers import AutoTokenizer
    from trl.experimental.async_grpo import AsyncGRPOConfig, AsyncGRPOTrainer

    base, model_dir = served
    root = tmp_path_factory.mktemp("trl-run")
    url = str(root / "stream")
    with pytest.MonkeyPatch.context() as mp:
        run_on_cpu(mp)
        trainer = None
        # the integration: these two lines (files: so that a replayed step is a folder vLLM loads)
        transfer = DeltasyncWeightTransfer(url, base, files=model_dir, step_fn=lambda: trainer.state.global_step)
        config = AsyncGRPOConfig(
            output_dir=str(root / "trainer"), vllm_server_base_url=base, max_steps=STEPS, weight_sync_steps=1,
            per_device_train_batch_size=4, num_generations=4, max_completion_length=8, learning_rate=1e-3,
            use_cpu=True, report_to=[], save_strategy="no", disable_tqdm=True, logging_steps=1, seed=0,
            queue_maxsize=8,  # a few samples ahead: the rollout worker stops at once (its queue flushes)
        )
        prompts = Dataset.from_dict({"prompt": [[{"role": "user", "content": p}] for p in ("hello", "abc", "xyz")]})
        trainer = AsyncGRPOTrainer(model=str(model_dir), reward_funcs=reward_short, args=config, train_dataset=prompts,
                                   processing_class=AutoTokenizer.from_pretrained(model_dir), weight_transfer=transfer)
        trainer.train()
    return trainer, transfer, url


def _steps(url: str) -> list[int]:
    with StreamReader(url) as reader:
        return reader.steps()


def _served_tokens(base: str, model: str, prompts: list[str], max_tokens: int = 12) -> list[list[int]]:
    body = {"model": model, "prompt": prompts, "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True,
            "return_token_ids": True}
    req = urllib.request.Request(f"{base}/v1/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        choices = sorted(json.loads(r.read())["choices"], key=lambda c: c["index"])
    return [list(c["token_ids"]) for c in choices]


def test_every_sync_of_a_real_training_run_is_a_step_the_server_applies(served, trained, tmp_path):
    base, model_dir = served
    trainer, transfer, url = trained
    # TRL's own calls: the cold sync at train begin, then one per optimizer step; train end released the stream
    assert transfer.steps == [0, 1, 2] and trainer.model_version == STEPS + 1
    assert transfer.publisher is None
    DeltaPublisher(url, None).close()  # the lease is free: a new writer needs no take_over
    assert all(h["grad_norm"] > 0 for h in trainer.state.log_history if "grad_norm" in h)  # real GRPO steps

    with StreamReader(url) as reader:
        assert reader.steps() == [0, 1, 2]
        first, last = reader.state_dict(0), reader.state_dict(STEPS)
        with reader.open(STEPS) as obj:
            want = {n: parse_checksum(t.checksum) for n, t in obj.header.tensors.items()}
    # the stream holds the trainer's fp32 weights as the server's bf16, bit for bit, and training moved them
    mine = {n: p.detach().to(torch.bfloat16) for n, p in trainer.model.named_parameters()}
    assert last.keys() == mine.keys()
    assert all(torch.equal(last[n].view(torch.int16), t.view(torch.int16)) for n, t in mine.items())
    assert any(not torch.equal(first[n], last[n]) for n in last)

    status = HttpWeightTransfer(base).status()  # the server's engine, every tensor checksummed again
    assert status["held_step"] == STEPS and status["checksums"] == want
    served_tokens = _served_tokens(base, str(model_dir), PROMPTS)  # the long prompt proves the prefix cache reset
    replayed = replay_to_folder(url, STEPS, tmp_path / "replayed").path
    with engine(replayed, "bfloat16", live=True) as fresh:
        assert generate(fresh) == served_tokens


def test_a_restarted_trainer_goes_on_from_the_stream_and_the_server(served, trained):
    """A new trainer process on the same stream and server, its transfer called as TRL calls it
    (``_TrainBeginCallback``, ``_sync_weight_merged``, the train loop's ``finally``)."""
    base, _ = served
    trainer, _, url = trained

    def sync(transfer: DeltasyncWeightTransfer) -> None:
        transfer.init_weight_transfer()
        transfer.pause()
        transfer.send_weights(trainer._streaming_iter())  # TRL's own generator of (name, tensor)
        transfer.resume()

    # numbered by the trainer's step: the resumed checkpoint's step is in the stream already, so the cold sync
    # publishes nothing (the trainer's weights proved to be that step's) and the server, which holds it, is left
    resumed = DeltasyncWeightTransfer(url, base, step_fn=lambda: STEPS)
    sync(resumed)
    resumed.destroy()
    assert resumed.steps == [STEPS] and _steps(url) == [0, 1, 2]

    # the stream's step but other weights (a checkpoint of another run): refused, nothing published
    other = DeltasyncWeightTransfer(url, base, step_fn=lambda: STEPS)
    with pytest.raises(ConfigError, match=r"holds step 2, the trainer's step, but not its weights \(1 tensors differ: "
                                          r"\['model.norm.weight'\]\)"):
        other.send_weights((n, t + 1 if n == "model.norm.weight" else t) for n, t in trainer._streaming_iter())
    other.destroy()
    assert other.steps == [] and _steps(url) == [0, 1, 2]

    # a checkpoint older than the stream's newest step: refused, nothing published, every tensor still read
    older = DeltasyncWeightTransfer(url, base, step_fn=lambda: 1)
    read = []
    with pytest.raises(ConfigError, match="already holds step 2, after the trainer's step 1"):
        older.send_weights((read.append(n) or (n, t)) for n, t in trainer._streaming_iter())
    older.destroy()
    assert len(read) == len(list(trainer._streaming_iter()))

    # counted by syncs: the next step after the stream's newest, an anchor (a new writer), applied by the server
    counted = DeltasyncWeightTransfer(url, base)
    sync(counted)
    counted.destroy()
    assert counted.steps == [STEPS + 1] and _steps(url) == [0, 1, 2, 3]
    assert HttpWeightTransfer(base).held_step() == STEPS + 1


def test_a_dtype_other_than_the_servers_is_refused_before_anything_is_published(served, tmp_path):
    base, _ = served
    transfer = DeltasyncWeightTransfer(str(tmp_path / "stream"), base, dtype=torch.float32)
    with pytest.raises(ConfigError, match=r"dtype is torch.float32 but the server .* serves torch.bfloat16"):
        transfer.init_weight_transfer()
    assert transfer.publisher is None and not (tmp_path / "stream").exists()
