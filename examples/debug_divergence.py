"""Debugging a divergence: find the step and the layer whose change density jumped, from the stream alone.

The training below has a planted bug: from ``--bug-step`` on, one layer's learning rate is 100x too large (a
broken scheduler, say). The stream records how many bits of each tensor changed at each step, so no rerun is
needed to find it:

1. ``stream_stats``: the change density of every step (from the manifests) shows *when* (it rises);
2. ``layer_density``: the density of every layer at every step (from the step headers) shows *where*;
3. ``compare``: the two steps around the jump, tensor by tensor (relative L2, largest change) shows *how much*;
4. ``plot_stats`` (``--plot FILE.png``, needs matplotlib) draws it as a heat map, as ``deltasync stats --plot`` does.

    python examples/debug_divergence.py --steps 12 --bug-step 7 --plot density.png
"""

from __future__ import annotations

import argparse
import itertools
import tempfile

import torch
from torch import nn

from deltasync import DeltaPublisher, compare, stream_stats
from deltasync.errors import MissingDependencyError
from deltasync.history import layer_density, need_matplotlib, plot_stats


class Model(nn.Module):
    def __init__(self, width: int = 64, depth: int = 4) -> None:
        super().__init__()
        self.embed = nn.Embedding(256, width)
        self.layers = nn.ModuleList(nn.Sequential(nn.Linear(width, width), nn.GELU()) for _ in range(depth))
        self.head = nn.Linear(width, 256)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        for layer in self.layers:
            h = h + layer(h)
        return self.head(h)


def train(url: str, steps: int, bug_step: int, bad_layer: int, lr: float = 2e-5) -> None:
    torch.manual_seed(0)
    model = Model()
    groups = [{"params": list(m.parameters()), "lr": lr} for m in (model.embed, *model.layers, model.head)]
    opt = torch.optim.AdamW(groups)
    with DeltaPublisher(url, model, dtype=torch.bfloat16, anchor_every=steps + 1, on_backlog="block") as pub:
        for step in range(steps):
            if step == bug_step:
                opt.param_groups[1 + bad_layer]["lr"] = lr * 100  # the bug
            tokens = torch.randint(0, 256, (8, 33))
            loss = nn.functional.cross_entropy(model(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten())
            loss.backward()
            opt.step()
            opt.zero_grad()
            pub.publish(step)


def find_jump(url: str) -> tuple[int, str]:
    """The delta step whose change density rose most over the delta before it, and the layer whose density
    rose most at that step."""
    stats = stream_stats(url)
    deltas = [s for s in stats.steps if s.kind == "delta"]
    for row in deltas:
        print(f"step {row.step:3d}: density {row.density:7.2%}")
    prev, row = max(itertools.pairwise(deltas), key=lambda pair: pair[1].density / max(pair[0].density, 1e-9))
    grid = layer_density(url, [prev.step, row.step])
    ratio = {layer: (d[1] or 0.0) / max(d[0] or 0.0, 1e-9) for layer, d in zip(grid.layers, grid.density, strict=True)}
    layer = max(ratio, key=ratio.get)
    print(f"step {row.step}: density {prev.density:.2%} -> {row.density:.2%}; per layer, x times the step before:")
    for name, r in sorted(ratio.items(), key=lambda kv: -kv[1]):
        print(f"  {name:12s} x{r:6.1f}")
    comparison = compare(url, prev.step, row.step)  # rebuilds both steps: bits, relative L2, largest change
    print(f"compare {prev.step} -> {row.step}, tensors of {layer}:")
    for d in comparison.tensors:
        if d.name.startswith(layer + "."):
            print(f"  {d.name:22s} changed {d.density:7.2%}  rel L2 {d.rel_l2:.2e}  max |change| "
                  f"{d.max_abs_change:.2e}")
    return row.step, layer


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--bug-step", type=int, default=None, help="first step with the bug (default: 2/3 of the way)")
    parser.add_argument("--bad-layer", type=int, default=2, choices=range(4))
    parser.add_argument("--plot", help="also draw density per layer and step to this PNG (needs matplotlib)")
    args = parser.parse_args()
    bug_step = args.bug_step if args.bug_step is not None else max(3, 2 * args.steps // 3)
    if not 3 <= bug_step < args.steps:
        parser.error(f"--bug-step must be in 3..{args.steps - 1} (deltas before it set the baseline), got {bug_step}")
    if args.plot:
        try:  # at the start, not after the whole run
            need_matplotlib()
        except MissingDependencyError as e:
            parser.error(f"--plot: {e}")
    with tempfile.TemporaryDirectory(prefix="deltasync-example-") as tmp:
        url = f"{tmp}/stream"
        train(url, args.steps, bug_step, args.bad_layer)
        step, layer = find_jump(url)
        if args.plot:
            plot_stats(stream_stats(url), layer_density(url), args.plot)
            print(f"wrote {args.plot}")
    print(f"divergence: step {step}, layer {layer}")
    return 0 if (step, layer) == (bug_step, f"layers.{args.bad_layer}") else 1


if __name__ == "__main__":
    raise SystemExit(main())
