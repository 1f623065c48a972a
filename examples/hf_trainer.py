"""A transformers ``Trainer`` publishing every optimizer step through ``DeltaSyncCallback`` (two lines).

A tiny random Qwen3 (built from a config: nothing is downloaded) trains on random tokens; the callback
publishes the initial weights as step 0 and each optimizer step as ``state.global_step``, in bf16, and adds
its per-step figures (``deltasync/bytes``, ``deltasync/density``, stage seconds, ``deltasync/lag_steps``) to
the Trainer's logs. Needs ``transformers`` and ``accelerate``.

    python examples/hf_trainer.py --steps 10
"""

from __future__ import annotations

import argparse
import tempfile

import torch
from transformers import Qwen3Config, Qwen3ForCausalLM, Trainer, TrainingArguments

from deltasync import StreamReader
from deltasync.integrations.transformers import DeltaSyncCallback


class RandomTokens(torch.utils.data.Dataset):
    def __init__(self, n: int, seq_len: int = 32, vocab: int = 512) -> None:
        self.ids = torch.randint(0, vocab, (n, seq_len), generator=torch.Generator().manual_seed(0))

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--store", help="stream URL (default: a temporary folder, removed at the end)")
    args = parser.parse_args()
    torch.manual_seed(0)
    config = Qwen3Config(vocab_size=512, hidden_size=128, intermediate_size=384, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, head_dim=64)
    model = Qwen3ForCausalLM(config)  # fp32 master weights

    with tempfile.TemporaryDirectory(prefix="deltasync-example-") as tmp:
        url = args.store or f"{tmp}/stream"
        training = TrainingArguments(
            output_dir=f"{tmp}/trainer", max_steps=args.steps, per_device_train_batch_size=4, learning_rate=1e-4,
            logging_steps=max(1, args.steps // 5), save_strategy="no", report_to=[], use_cpu=True, disable_tqdm=True,
        )
        # the integration: one callback (publisher options such as dtype= or storage_options= pass through)
        callback = DeltaSyncCallback(url, dtype=torch.bfloat16, anchor_every=10)
        trainer = Trainer(model=model, args=training, train_dataset=RandomTokens(4 * args.steps), callbacks=[callback])
        trainer.train()  # the Trainer prints each log; the callback's figures are in it

        logged = [h for h in trainer.state.log_history if "deltasync/bytes" in h]
        print(f"deltasync figures in {len(logged)} of the Trainer's logs, e.g. "
              f"{sorted(k for k in logged[-1] if k.startswith('deltasync/'))}")
        with StreamReader(url) as reader:
            last = reader.steps()[-1]
            state = reader.state_dict(last)
        want = {name: t.detach().to(torch.bfloat16) for name, t in model.state_dict().items()}
        exact = last == args.steps and state.keys() == want.keys() and all(
            torch.equal(state[name].view(torch.int16), t.view(torch.int16)) for name, t in want.items()
        )
        print(f"stream {url}: steps 0..{last}")
        print(f"bit-exact: {'yes' if exact else 'NO'}")
    return 0 if exact and logged else 1


if __name__ == "__main__":
    raise SystemExit(main())
