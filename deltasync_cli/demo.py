"""``deltasync demo``: train a small Qwen3-shaped model, publish every step, follow it, prove exactness.

The model trains in fp32 (master weights) with AdamW at an RL-like learning rate on the Python standard
library's own source, bytes as tokens; each step is published as bf16, as an inference engine would
serve it. A follower in another thread applies the stream; each row checks that the follower's weights
have the checksums of the trainer's weights computed independently from the trainer's model.

With ``transport="nixl"`` the trainer and the consumer run in separate processes and step objects travel over
NIXL (the store keeps history): see :mod:`deltasync_cli.demo_nixl`.
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path

import torch

from deltasync.format.checksum import format_checksum, state_checksum
from deltasync.publish.publisher import DeltaPublisher
from deltasync.store.location import StoreLocation
from deltasync.store.scratch import ScratchFolder
from deltasync.testing import save_model_dir, stdlib_corpus, tiny_qwen3
from deltasync_cli.demo_config import DemoConfig, bf16_checksums

log = logging.getLogger(__name__)


def run_demo(
    url: str | None = None, config: DemoConfig | None = None, *, storage_options: dict | None = None, echo=print
) -> list[dict]:
    """Run the demo; returns one row per step. ``echo`` prints (the library itself never prints).

    Without ``url`` the stream lives in a temporary folder, removed at the end with the engine's model folder
    (pass a URL to keep the stream).
    """
    config = DemoConfig() if config is None else config
    scratch = ScratchFolder("demo")
    try:
        # the store as one value, made here: the given URL, else a folder of the demo's own (removed at the end)
        where = StoreLocation.of(url if url is not None else str(scratch.path / "stream"), storage_options)
        if config.transport == "nixl":
            from deltasync_cli.demo_nixl import run_demo_nixl

            return run_demo_nixl(where, config, scratch.path, temporary=url is None, echo=echo)
        return _run_demo(where, config, scratch.path, temporary=url is None, echo=echo)
    finally:
        scratch.remove()


def _run_demo(where: StoreLocation, config: DemoConfig, workdir: Path, *, temporary: bool, echo) -> list[dict]:
    from rollout_loader import Follower, StateDictTarget

    torch.manual_seed(config.seed)
    model = tiny_qwen3(hidden_size=config.hidden_size, layers=config.layers, seed=config.seed).float()
    opt = torch.optim.AdamW(model.parameters(), lr=config.lr, weight_decay=0.0)
    data = stdlib_corpus(seed=config.seed) % model.config.vocab_size
    nparams = sum(p.numel() for p in model.parameters())
    echo(f"model: Qwen3-shaped, {nparams / 1e6:.1f}M parameters, trained in fp32, published as bf16")
    echo(f"store: {where.shown}" + (" (temporary: removed at the end; --store DIR keeps it)" if temporary else ""))

    live_at: dict[int, float] = {}
    paused: dict[int, float] = {}
    llm = None
    if config.engine == "vllm":
        from rollout_loader.vllm import VllmTarget, start_engine

        model_dir = save_model_dir(model, workdir / "model-step0")
        echo("starting a vLLM engine on the initial weights (in-process, CPU)...")
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
        os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
        llm = start_engine(str(model_dir), in_process=True, dtype="bfloat16", enforce_eager=True, max_model_len=256)
        target: VllmTarget | StateDictTarget = VllmTarget(llm, verify="all")  # every tensor's checksum, every step
    else:
        target = StateDictTarget(verify="full")

    def on_step(s: int) -> None:
        live_at.setdefault(s, time.perf_counter())
        if not isinstance(target, StateDictTarget):  # the vLLM engine's
            paused[s] = target.pauses_s[-1]

    follower = Follower(where, target, on_step=on_step)
    trainer_sums: dict[int, str] = {}
    published_at: dict[int, float] = {}
    rows: list[dict] = []
    who = "vLLM engine" if llm is not None else "follower"
    table = _RowTable(engine=llm is not None, echo=echo)
    gen = torch.Generator().manual_seed(config.seed)
    with DeltaPublisher(
        where,
        model,
        dtype=torch.bfloat16,
        anchor_every=config.anchor_every,
        on_backlog="block",
    ) as pub:

        def print_ready(final: bool = False) -> None:
            """Rows as they happen: a step's row once it is committed and live (or passed for a newer anchor)."""
            metrics = {m.step: m for m in pub.metrics}
            while len(rows) < config.steps:
                step = len(rows)
                m = metrics.get(step)
                decided = step in live_at or any(s > step for s in live_at)
                if m is None or not (decided or final):
                    return
                committed = pub.store.manifest(step).state_checksum == trainer_sums[step]
                # a follower goes to the newest step: when that is an anchor, the steps before it are never live
                skipped = step not in live_at and any(s > step for s in live_at)
                exact = None if skipped and committed else step in live_at and committed
                lag = (live_at[step] - published_at[step]) * 1e3 if step in live_at else float("nan")
                rows.append({
                    **m.to_dict(),
                    "live_after_publish_ms": lag,
                    "engine_paused_ms": paused[step] * 1e3 if step in paused else None,
                    "exact": exact,  # None: skipped for a newer anchor (its committed checksums are the trainer's)
                })
                table.row(m, lag, paused.get(step), exact)

        table.header(f"deltasync demo: trainer -> store -> {who}")
        follower.start()
        for step in range(config.steps):
            starts = torch.randint(0, data.numel() - config.seq_len - 1, (config.batch_size,), generator=gen)
            batch = torch.stack([data[s : s + config.seq_len + 1] for s in starts])
            loss = model(input_ids=batch[:, :-1], labels=batch[:, 1:]).loss
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            trainer_sums[step] = state_checksum(bf16_checksums(model))
            pub.publish(step)
            published_at[step] = time.perf_counter()
            print_ready()
        pub.flush()
        follower.wait_for(config.steps - 1, timeout_s=120)  # a hang guard: the steps arrive in seconds
        follower.close()
        print_ready(final=True)
    if follower.last_error:
        echo(f"follower error: {follower.last_error}")

    # the follower verified every step against the manifests (checksums after each step); here the last
    # state is compared again with the trainer's own, independently computed checksums
    if isinstance(target, StateDictTarget):
        assert target.replica is not None  # it applied the steps
        final = state_checksum({n: format_checksum(c) for n, c in target.replica.checksums.items()})
    else:
        held = target.status()["checksums"]  # the engine's own bits, every tensor checksummed again
        final = state_checksum({n: format_checksum(held[n]) for n in held})
    ok = all(r["exact"] is not False for r in rows) and rows[-1]["exact"] and final == trainer_sums[config.steps - 1]
    deltas = [r for r in rows if r["kind"] == "delta"]
    if deltas:
        mean_bytes = sum(r["object_bytes"] for r in deltas) / len(deltas)
        echo(
            f"deltas: mean {mean_bytes / 1e6:.2f} MB = {mean_bytes / deltas[0]['full_bytes']:.1%} of a full "
            f"bf16 checkpoint, mean density {sum(r['density'] for r in deltas) / len(deltas):.2%}"
        )
    echo(f"{who} weights at step {target.step}: {final[:16]}…  trainer: {trainer_sums[config.steps - 1][:16]}…")
    n_skipped = sum(r["exact"] is None for r in rows)
    echo(("BIT-EXACT: every step verified" + (f" ({n_skipped} skipped: the {who} went straight to a newer anchor)"
                                              if n_skipped else "")) if ok else "MISMATCH: see the table")
    if not ok:
        raise SystemExit(1)
    return rows


class _RowTable:
    """The demo's table, a row printed as each step goes live (a rich table would print only at the end: a minute
    and more of silence on CPU), in aligned columns that fit 120 characters."""

    COLUMNS = ("step", "kind", "density", "size", "vs full", "B/changed", "diff ms", "encode ms", "commit ms",
               "live +ms")

    def __init__(self, *, engine: bool, echo) -> None:
        self.columns = self.COLUMNS + (("paused ms", "exact") if engine else ("exact",))
        self.widths = [max(len(c), 7) for c in self.columns]
        self.engine = engine
        self.echo = echo

    def _line(self, cells: list[str]) -> str:
        return "  ".join(cell.rjust(width) for cell, width in zip(cells, self.widths, strict=True))

    def header(self, title: str) -> None:
        self.echo(title)
        self.echo(self._line(list(self.columns)))

    def row(self, m, lag_ms: float, paused_s: float | None, exact: bool | None) -> None:
        cells = [
            str(m.step),
            m.kind,
            f"{m.density:.2%}" if m.kind == "delta" else "full",
            f"{m.object_bytes / 1e6:.2f} MB",
            f"{m.object_bytes / m.full_bytes:.1%}",
            f"{m.bytes_per_changed:.2f}" if m.kind == "delta" else "-",
            f"{m.capture_s * 1e3:.1f}",
            f"{m.encode_s * 1e3:.1f}",
            f"{(m.write_s + m.upload_s) * 1e3:.1f}",
            f"{lag_ms:.0f}" if lag_ms == lag_ms else "-",
            *([f"{paused_s * 1e3:.1f}" if paused_s is not None else "-"] if self.engine else []),
            "yes" if exact else "skipped" if exact is None else "NO",
        ]
        self.echo(self._line(cells))
