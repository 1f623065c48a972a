"""TRL's ``GRPOTrainer`` publishing every policy step through ``DeltaSyncCallback`` (the same two lines as a Trainer).

A tiny random Qwen3 with a byte-level tokenizer (built here: nothing is downloaded) learns, with GRPO, to
write longer completions (the reward is the completion's length). The callback publishes the initial policy
as step 0 and each optimizer step as ``state.global_step``; its figures (``deltasync/bytes``, ...) are in the
Trainer's logs next to TRL's ``reward``. Needs ``trl`` (tested with 1.16.0), ``transformers``, ``accelerate``
and ``datasets``.

    python examples/trl_grpo.py --steps 2
"""

from __future__ import annotations

import argparse
import tempfile
import warnings

import torch
from datasets import Dataset
from transformers import AutoTokenizer

from deltasync import StreamReader
from deltasync.integrations.transformers import DeltaSyncCallback
from deltasync.testing import save_model_dir, tiny_qwen3

# deltasync's TRL integration is tested with TRL 1.16.0 and vLLM 0.32.0 (the versions ./run.sh installs); TRL's own
# version check predates vLLM 0.32 and warns once per module that imports vLLM: not a problem here
warnings.filterwarnings("ignore", message="TRL currently supports vLLM versions", category=UserWarning)


def reward_length(completions: list[str], **_: object) -> list[float]:
    """A trivial reward: longer completions are better (enough for the policy to change every step)."""
    return [float(len(c)) for c in completions]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--store", help="stream URL (default: a temporary folder, removed at the end)")
    args = parser.parse_args()
    from trl import GRPOConfig, GRPOTrainer  # (after the warnings filter above)

    with tempfile.TemporaryDirectory(prefix="deltasync-example-") as tmp:
        model = tiny_qwen3(hidden_size=64, layers=1).float()  # fp32 master weights
        save_model_dir(model, f"{tmp}/model", dtype=torch.float32)  # only for its byte-level tokenizer
        tokenizer = AutoTokenizer.from_pretrained(f"{tmp}/model")
        tokenizer.pad_token, tokenizer.eos_token = tokenizer.convert_ids_to_tokens([0, 255])
        url = args.store or f"{tmp}/stream"
        config = GRPOConfig(
            output_dir=f"{tmp}/trainer", max_steps=args.steps, per_device_train_batch_size=4, num_generations=4,
            max_completion_length=8, learning_rate=1e-3, logging_steps=1, save_strategy="no", report_to=[],
            use_cpu=True, disable_tqdm=True, seed=0,
        )
        # the integration: one callback; publisher options (dtype=, storage_options=, anchor_every=) pass through
        callback = DeltaSyncCallback(url, dtype=torch.bfloat16, on_backlog="block")
        trainer = GRPOTrainer(
            model=model, reward_funcs=reward_length, args=config, processing_class=tokenizer,
            train_dataset=Dataset.from_dict({"prompt": ["abc", "hello", "xyz", "def"] * 2}), callbacks=[callback],
        )
        trainer.train()

        logged = [h for h in trainer.state.log_history if "reward" in h and "deltasync/bytes" in h]
        for h in logged:  # the Trainer logs while the step's upload runs: its figures are the newest committed step's
            print(f"step {h['step']}: reward {h['reward']:.2f}; published as step {h['step']}, the newest committed "
                  f"then step {h['deltasync/step']:.0f} ({h['deltasync/bytes']:.0f} bytes)")
        with StreamReader(url) as reader:
            steps, state, first = reader.steps(), reader.state_dict(args.steps), reader.state_dict(0)
        want = {name: t.detach().to(torch.bfloat16) for name, t in model.state_dict().items()}
        exact = steps == list(range(args.steps + 1)) and state.keys() == want.keys() and all(
            torch.equal(state[n].view(torch.int16), t.view(torch.int16)) for n, t in want.items()
        )
        trained = any(not torch.equal(first[n], state[n]) for n in state)  # the policy did change
        print(f"stream {url}: steps {steps}")
        print(f"bit-exact: {'yes' if exact and trained else 'NO'}")
    return 0 if exact and trained and len(logged) == args.steps else 1


if __name__ == "__main__":
    raise SystemExit(main())
