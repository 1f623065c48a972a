"""Small streams for the history, maintenance, stats and CLI tests: a tied Qwen3 model trained with AdamW."""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from pathlib import Path

import torch

from deltasync import DeltaPublisher


@dataclass
class QwenStream:
    url: str
    model_dir: Path  # config, tokenizer (and the step-0 weights) as the trainer saved them
    model: torch.nn.Module  # the trainer's model after the last step (fp32)
    truth: dict[int, dict[str, torch.Tensor]] = field(default_factory=dict)  # step -> published bf16 weights
    params: dict[int, dict[str, torch.Tensor]] = field(default_factory=dict)  # step -> fp32 master weights

    def model_at(self, step: int) -> torch.nn.Module:
        """The trainer's model at ``step``, its weights at the published precision (bf16 values, fp32 math)."""
        m = copy.deepcopy(self.model)
        m.load_state_dict(self.params[step])
        with torch.no_grad():
            for p in m.parameters():
                p.copy_(p.bfloat16().float())
        return m.eval()


def make_qwen_stream(root: Path, *, steps: int = 10, anchor_every: int = 4) -> QwenStream:
    from deltasync.testing import save_model_dir, tiny_qwen3

    model = tiny_qwen3(hidden_size=64, layers=2, vocab_size=300, tie=True).float()
    model_dir = save_model_dir(model, root / "model")
    opt = torch.optim.AdamW(model.parameters(), lr=2e-5, weight_decay=0.0)
    gen = torch.Generator().manual_seed(0)
    out = QwenStream(url=str(root / "stream"), model_dir=model_dir, model=model)
    with DeltaPublisher(out.url, model, dtype=torch.bfloat16, anchor_every=anchor_every, on_backlog="block",
                        files=model_dir) as pub:
        for s in range(steps):
            tokens = torch.randint(0, 300, (2, 17), generator=gen)
            model(input_ids=tokens[:, :-1], labels=tokens[:, 1:]).loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            out.truth[s] = {n: t.detach().to(torch.bfloat16).clone() for n, t in model.state_dict().items()}
            out.params[s] = {n: t.detach().clone() for n, t in model.state_dict().items()}
            pub.publish(s)
    model.eval()
    return out
