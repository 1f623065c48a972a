"""A plain PyTorch training loop that publishes after every optimizer step; a reader then checks the bits.

The model trains in fp32 (master weights) and is published as bf16, the weights an inference engine serves.
Each step publishes only the elements whose bf16 bits changed. When uploads fall behind the trainer, the
publisher coalesces steps (the next committed step carries their changes; nothing is lost) instead of
stalling training: the output says how many steps were committed and which were coalesced.

    python examples/plain_pytorch.py                         # 20 steps into a temporary folder, removed after
    python examples/plain_pytorch.py --steps 5 --store /tmp/my-stream
"""

from __future__ import annotations

import argparse
import tempfile

import torch
from torch import nn

from deltasync import DeltaPublisher, StreamReader


def train_and_publish(url: str, steps: int) -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(256, 64), nn.Linear(64, 128), nn.GELU(), nn.Linear(128, 256))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    with DeltaPublisher(url, model, dtype=torch.bfloat16, anchor_every=10) as pub:
        for step in range(steps):
            tokens = torch.randint(0, 256, (8, 33))
            logits = model(tokens[:, :-1])
            loss = nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
            loss.backward()
            opt.step()
            opt.zero_grad()
            pub.publish(step)  # returns once the change is captured; encoding and upload run in the background
    # leaving the `with` block committed what was captured; coalesced steps are inside the next committed one
    for m in pub.metrics:
        what = "full anchor" if m.kind == "anchor" else f"{m.density:6.2%} of elements changed"
        also = f", carries steps {list(m.coalesced_steps)}" if m.coalesced_steps else ""
        print(f"step {m.step:3d}: {m.kind:6s} {m.object_bytes / 1e3:8.1f} kB  ({what}{also})")
    coalesced = steps - len(pub.metrics)
    print(f"{len(pub.metrics)} of {steps} steps committed" + (f", {coalesced} coalesced into the next (uploads were "
          "behind the trainer; DeltaPublisher(on_backlog='block') commits every step instead)" if coalesced else ""))
    return model


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--store", help="stream URL (default: a temporary folder, removed at the end)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="deltasync-example-") as tmp:
        url = args.store or f"{tmp}/stream"
        model = train_and_publish(url, args.steps)
        last = args.steps - 1
        with StreamReader(url) as reader:  # a consumer anywhere: the exact weights of any committed step
            state = reader.state_dict(last)
        want = {name: t.detach().to(torch.bfloat16) for name, t in model.state_dict().items()}
        exact = state.keys() == want.keys() and all(
            torch.equal(state[name].view(torch.int16), t.view(torch.int16)) for name, t in want.items()
        )
        print(f"step {last} read back from {url}: {len(state)} tensors")
        print(f"bit-exact: {'yes' if exact else 'NO'}")
    return 0 if exact else 1


if __name__ == "__main__":
    raise SystemExit(main())
