"""The ``deltasync`` command line: diff/patch checkpoints like files, inspect streams, run the demo."""

from __future__ import annotations

import json
import logging
import sys
import tempfile
from pathlib import Path
from typing import Annotated, Any, Optional

import typer
from rich.console import Console
from rich.table import Table

from .errors import DeltaSyncError

app = typer.Typer(
    help="Ship only what changed: sparse bit-exact weight deltas from an RL trainer to inference engines.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
)
out = Console()
err = Console(stderr=True)

StorageOpt = Annotated[
    Optional[list[str]],
    typer.Option("--storage-option", "-S", help="fsspec storage option KEY=VALUE (JSON values allowed); repeatable."),
]


def _storage_options(pairs: list[str] | None) -> dict[str, Any]:
    opts: dict[str, Any] = {}
    for pair in pairs or []:
        key, sep, value = pair.partition("=")
        if not sep:
            raise typer.BadParameter(f"expected KEY=VALUE, got {pair!r}")
        try:
            opts[key] = json.loads(value)
        except json.JSONDecodeError:
            opts[key] = value
    return opts


def _load_safetensors(path: Path) -> dict:
    import safetensors.torch

    from .errors import FormatError

    try:
        return safetensors.torch.load_file(str(path))
    except Exception as e:  # safetensors raises several types for unreadable files
        raise FormatError(f"{path}: not a readable safetensors file ({e})") from None


@app.command()
def diff(
    base: Annotated[Path, typer.Argument(help="Base checkpoint (.safetensors).", exists=True, dir_okay=False)],
    target: Annotated[Path, typer.Argument(help="Target checkpoint (.safetensors).", exists=True, dir_okay=False)],
    output: Annotated[Path, typer.Option("-o", "--output", help="Delta file to write.")],
    base_step: Annotated[int, typer.Option(help="Step number recorded for the base.")] = 0,
    step: Annotated[Optional[int], typer.Option(help="Step number recorded for the target (default base+1).")] = None,
) -> None:
    """Write the delta that turns BASE into TARGET (like Unix diff, but bit-exact and compact)."""
    from .diff import Snapshot
    from .publisher import snapshot_headers, write_step

    snap = Snapshot(_load_safetensors(base))
    changes = [c for c in snap.diff(_load_safetensors(target)) if c.changed]
    header = write_step(
        output,
        kind="delta",
        step=base_step + 1 if step is None else step,
        base_step=base_step,
        headers=snapshot_headers(snap),
        changes=changes,
    )
    size = output.stat().st_size
    out.print(
        f"{output}: {header.changed} of {header.numel} elements changed ({header.changed / max(header.numel, 1):.2%}) "
        f"in {sum(1 for c in changes)} tensors, {size} bytes"
    )


@app.command()
def patch(
    base: Annotated[Path, typer.Argument(help="Base checkpoint (.safetensors).", exists=True, dir_okay=False)],
    delta: Annotated[Path, typer.Argument(help="Delta file made by `deltasync diff` or a stream.", exists=True)],
    output: Annotated[Path, typer.Option("-o", "--output", help="Checkpoint to write.")],
) -> None:
    """Apply DELTA to BASE and write the result; fails (writing nothing) unless every checksum matches."""
    import safetensors.torch

    from .apply import Replica
    from .format import StepObject

    obj = StepObject(delta, where=str(delta))
    tensors = _load_safetensors(base)
    for alias, name in obj.header.aliases.items():
        if name in tensors:
            tensors.setdefault(alias, tensors[name])
    rep = Replica.from_tensors(tensors, step=obj.header.base_step)
    rep.apply(obj, verify="full")
    with tempfile.NamedTemporaryFile(dir=output.parent or ".", suffix=".tmp", delete=False) as tmp:
        pass
    safetensors.torch.save_file(
        {n: t for n, t in tensors.items() if n not in obj.header.aliases}, tmp.name, metadata={"format": "pt"}
    )
    Path(tmp.name).replace(output)
    out.print(f"{output}: step {obj.header.step}, {obj.header.changed} elements patched, checksums verified")


@app.command("ls")
def ls_(
    url: Annotated[str, typer.Argument(help="Stream URL (local path, s3://, hf://buckets/..., memory://).")],
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON.")] = False,
    storage_option: StorageOpt = None,
) -> None:
    """List the committed steps of a stream."""
    from .store import Store

    store = Store(url, storage_options=_storage_options(storage_option))
    manifests = [store.manifest(s) for s in store.steps()]
    if as_json:
        print(json.dumps([m.__dict__ for m in manifests], indent=1))
        return
    table = Table(title=f"{url}: {len(manifests)} committed steps")
    for col in ("step", "kind", "base", "bytes", "density", "coalesced"):
        table.add_column(col, justify="right")
    for m in manifests:
        table.add_row(
            str(m.step),
            m.kind,
            "-" if m.base_step is None else str(m.base_step),
            f"{m.object_bytes:,}",
            f"{m.stats.get('density', 1.0):.2%}",
            ",".join(map(str, m.stats.get("coalesced_steps", []))) or "-",
        )
    out.print(table)


@app.command()
def show(
    url: Annotated[str, typer.Argument(help="Stream URL.")],
    step: Annotated[int, typer.Argument(help="Step number.")],
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON.")] = False,
    storage_option: StorageOpt = None,
) -> None:
    """Show one step: its manifest and, per tensor, how many elements changed."""
    from .reader import StreamReader

    reader = StreamReader(url, storage_options=_storage_options(storage_option))
    m = reader.manifest(step)
    with reader.open(step) as obj:
        h = obj.header
    tensors = {n: {"dtype": t.dtype, "shape": list(t.shape), "changed": t.changed, "checksum": t.checksum} for n, t in h.tensors.items()}
    if as_json:
        print(json.dumps({"manifest": m.__dict__, "aliases": h.aliases, "tensors": tensors}, indent=1))
        return
    out.print(f"step {m.step} ({m.kind}{'' if m.base_step is None else f' on step {m.base_step}'}), {m.object_bytes:,} bytes")
    out.print(f"state checksum {m.state_checksum}")
    table = Table()
    for col in ("tensor", "dtype", "shape", "changed", "density", "checksum"):
        table.add_column(col)
    for n, t in h.tensors.items():
        table.add_row(n, t.dtype, "x".join(map(str, t.shape)), f"{t.changed:,}", f"{t.changed / max(t.numel, 1):.2%}", t.checksum)
    out.print(table)


@app.command()
def follow(
    url: Annotated[str, typer.Argument(help="Stream URL.")],
    server: Annotated[str, typer.Option(help="Base URL of a vLLM OpenAI server started with "
                                        "--worker-extension-cls rollout_loader.worker.DeltaWorkerExtension "
                                        "and VLLM_SERVER_DEV_MODE=1.")],
    until: Annotated[Optional[int], typer.Option(help="Exit once the engine holds this step (default: follow forever).")] = None,
    engine_step: Annotated[Optional[int], typer.Option(help="The step the engine already holds, if it was started from one.")] = None,
    verify: Annotated[str, typer.Option(help="Checksums after each step: 'changed' tensors or 'all'.")] = "changed",
    mode: Annotated[str, typer.Option(help="Worker mode: auto, live or reload.")] = "auto",
    poll_s: Annotated[float, typer.Option(help="Seconds between polls of the store.")] = 0.1,
    timeout_s: Annotated[float, typer.Option(help="With --until: give up after this long.")] = 600.0,
    storage_option: StorageOpt = None,
) -> None:
    """Keep a running vLLM server at the newest step of a stream (prints one line per step)."""
    import time

    from rollout_loader import Follower
    from rollout_loader.vllm import VllmTarget

    target = VllmTarget(server, step=engine_step, mode=mode, verify=verify)  # type: ignore[arg-type]

    def report(step: int) -> None:
        out.print(f"step {step} live in {server} (generation paused {target.pauses_s[-1] * 1e3:.1f} ms, checksums match)")

    follower = Follower(url, target, poll_s=poll_s, on_step=report, storage_options=_storage_options(storage_option))
    if until is not None:
        follower.reader.wait_for(until, timeout_s=timeout_s)
        follower.sync(until)
        return
    follower.start()
    try:
        while True:
            time.sleep(1.0)
            if follower.last_error:
                err.print(f"[yellow]retrying:[/yellow] {follower.last_error}")
    except KeyboardInterrupt:
        follower.stop()


@app.command()
def demo(
    store: Annotated[Optional[str], typer.Option(help="Stream URL (default: a new local folder).")] = None,
    steps: Annotated[int, typer.Option(help="Training steps.")] = 30,
    lr: Annotated[float, typer.Option(help="AdamW learning rate (RL-like).")] = 1e-6,
    hidden_size: Annotated[int, typer.Option(help="Model width (multiple of 64).")] = 256,
    layers: Annotated[int, typer.Option(help="Transformer layers.")] = 4,
    engine: Annotated[str, typer.Option(help="Who follows: 'vllm' (a real engine) or 'torch' (a state dict).")] = "vllm",
    storage_option: StorageOpt = None,
) -> None:
    """Train a small Qwen3-shaped model, publish every step, follow it, and prove the weights match."""
    from .demo import DemoConfig, run_demo

    run_demo(
        store,
        DemoConfig(steps=steps, lr=lr, hidden_size=hidden_size, layers=layers, engine=engine),
        storage_options=_storage_options(storage_option),
        echo=out.print,
    )


def main() -> None:
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    try:
        app()
    except DeltaSyncError as e:
        typer.echo(f"error: {type(e).__name__}: {e}", err=True)  # one line, never wrapped
        sys.exit(2)


if __name__ == "__main__":
    main()
