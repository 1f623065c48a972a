"""The ``deltasync`` command line: diff/patch checkpoints like files, inspect, replay and maintain streams, run the demo.

Exit status: 0 done; 1 ``verify`` found a problem; 2 an error caused by input, configuration or environment (one
line on stderr: the error's type, what was expected, what arrived, and where); 3 an unexpected error, i.e. a
bug (one line too; ``DELTASYNC_DEBUG=1`` prints the traceback, for any error); 130 interrupted (Ctrl-C).
"""

from __future__ import annotations

import json
import logging
import os
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Annotated, Any, Literal, Optional

import typer
from rich.console import Console
from rich.table import Table

from .errors import DeltaSyncError, StepNotFoundError

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


def _reader(url: str, storage_option: list[str] | None) -> Any:
    """A ``StreamReader`` for a command; open it in a ``with`` block, so that its downloads are removed
    when the command ends, fails or is interrupted (Ctrl-C)."""
    from .reader import StreamReader

    return StreamReader(url, storage_options=_storage_options(storage_option))


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

    with Store(url, storage_options=_storage_options(storage_option)) as store:
        manifests = [store.manifest(s) for s in store.steps()]
        if not manifests:
            store.require_stream()  # "no stream at this URL" is an error; "a stream with no steps yet" is not
    if as_json:
        print(json.dumps([m.to_dict() for m in manifests], indent=1))
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
            f"{m.stats.density:.2%}",
            ",".join(map(str, m.stats.coalesced_steps)) or "-",
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

    with StreamReader(url, storage_options=_storage_options(storage_option)) as reader:
        try:
            m = reader.manifest(step)
        except StepNotFoundError:
            reader.store.require_stream()
            raise
        with reader.open(step) as obj:
            h = obj.header
    tensors = {n: {"dtype": t.dtype, "shape": list(t.shape), "changed": t.changed, "checksum": t.checksum} for n, t in h.tensors.items()}
    if as_json:
        print(json.dumps({"manifest": m.to_dict(), "aliases": h.aliases, "tensors": tensors}, indent=1))
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
    verify: Annotated[Literal["incremental", "changed", "all"], typer.Option(
        help="Checksums after each delta: 'incremental' (from the patched elements), the 'changed' tensors, or 'all'.")] = "changed",
    mode: Annotated[Literal["auto", "live", "reload"], typer.Option(help="Worker mode: auto, live or reload.")] = "auto",
    poll_s: Annotated[float, typer.Option(min=0.0, help="Seconds between polls of the store.")] = 0.1,
    timeout_s: Annotated[float, typer.Option(min=0.0, help="With --until: give up after this long.")] = 600.0,
    storage_option: StorageOpt = None,
) -> None:
    """Keep a running vLLM server at the newest step of a stream (prints one line per step).

    Before anything is paused: the options are checked, the server is asked whether it is set up for deltasync
    (the flags above), and the URL must hold a stream. Needs no vLLM package here (only on the server).
    """
    import time

    from rich.markup import escape

    from rollout_loader import Follower
    from rollout_loader.vllm import VllmTarget

    target = VllmTarget(server, step=engine_step, mode=mode, verify=verify)

    def report(step: int) -> None:
        out.print(f"step {step} live in {server} (generation paused {target.pauses_s[-1] * 1e3:.1f} ms, checksums match)")

    follower = Follower(url, target, poll_s=poll_s, on_step=report, storage_options=_storage_options(storage_option))
    try:  # close() stops the thread and removes the downloads, however the command ends (Ctrl-C too)
        follower.reader.store.require_stream()
        if until is not None:
            follower.wait_for(until, timeout_s=timeout_s)  # retries like the thread; raises what stopped it
            return
        follower.start()
        shown: str | None = None
        while follower.running:
            time.sleep(1.0)
            error = follower.last_error
            if error is not None and str(error) != shown:  # once per distinct error
                shown = str(error)
                err.print(f"[yellow]retrying:[/yellow] {escape(shown)}")
            elif error is None:
                shown = None
        if follower.stopped_by is not None:  # a permanent error stopped the thread: one line, exit 2
            raise follower.stopped_by
    except KeyboardInterrupt:
        pass
    finally:
        follower.close()


@app.command()
def demo(
    store: Annotated[Optional[str], typer.Option(help="Stream URL (default: a new local folder).")] = None,
    steps: Annotated[int, typer.Option(help="Training steps.")] = 30,
    lr: Annotated[float, typer.Option(help="AdamW learning rate (RL-like).")] = 1e-6,
    hidden_size: Annotated[int, typer.Option(help="Model width (multiple of 64).")] = 256,
    layers: Annotated[int, typer.Option(help="Transformer layers.")] = 4,
    engine: Annotated[Literal["vllm", "torch"], typer.Option(
        help="Who follows: 'vllm' (a real engine) or 'torch' (a state dict).")] = "vllm",
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


# --- history: replay, push, compare, stats, verify, gc ---

JsonOpt = Annotated[bool, typer.Option("--json", help="Print JSON (stable keys) instead of tables.")]


@contextmanager
def _progress() -> Iterator[Any]:
    """A progress callback drawing rich bars on stderr when it is a terminal; None (quiet) otherwise."""
    if not err.is_terminal:
        yield None
        return
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  console=err, transient=True) as bar:
        tasks: dict[str, Any] = {}

        def update(what: str, done: int, total: int) -> None:
            if what not in tasks:
                tasks[what] = bar.add_task(what, total=total)
            bar.update(tasks[what], completed=done, total=total)

        yield update


def _print_json(data: Any) -> None:
    print(json.dumps(data, indent=1))


def _mb(n: float | None) -> str:
    return "-" if n is None else f"{n / 1e6:,.2f} MB"


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{x:.2%}"


def _num(x: float | None) -> str:
    return "-" if x is None else f"{x:.3g}"


def _dtype(name: str | None) -> Any:
    import torch

    from ._bits import DTYPES

    if name is None:
        return None
    dtype = DTYPES.get(name.upper()) or getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise typer.BadParameter(f"unknown dtype {name!r} (e.g. bfloat16, float16, float32, BF16)")
    return dtype


@app.command()
def replay(
    url: Annotated[str, typer.Argument(help="Stream URL.")],
    step: Annotated[int, typer.Option("--step", help="Step to replay.")],
    output: Annotated[Path, typer.Option("-o", "--output", help="Checkpoint folder to write (absent or empty).")],
    overwrite: Annotated[bool, typer.Option(help="Replace an existing folder.")] = False,
    reread: Annotated[bool, typer.Option("--reread", help="Also read the written file back and checksum it.")] = False,
    as_json: JsonOpt = False,
    storage_option: StorageOpt = None,
) -> None:
    """Write the exact weights of a step as a checkpoint folder that transformers and vLLM load as it is.

    Written beside the folder and renamed into place only after every checksum matched the step's manifest.
    """
    from .history import replay_to_folder

    with _reader(url, storage_option) as reader, _progress() as progress:
        r = replay_to_folder(reader, step, output, overwrite=overwrite, reread=reread, progress=progress)
    if as_json:
        _print_json(r.to_dict())
        return
    out.print(f"{r.path}: step {r.step} from anchor {r.chain[0]} + {len(r.chain) - 1} delta(s), {r.tensors} tensors, "
              f"{_mb(r.weights_bytes)} of weights + {len(r.model_files)} model files in {r.seconds:.2f}s; "
              f"checksums match the manifest (state {r.state_checksum[:16]}…)", soft_wrap=True, markup=False)
    if not r.model_files:
        out.print("note: the stream holds no model files (config, tokenizer): publish with files=... or push a folder", soft_wrap=True, markup=False)


@app.command()
def push(
    url: Annotated[str, typer.Argument(help="Stream URL.")],
    checkpoint: Annotated[Path, typer.Argument(help="A .safetensors file or a checkpoint folder.", exists=True)],
    step: Annotated[int, typer.Option("--step", help="Step number to publish it as (after the latest).")],
    anchor: Annotated[bool, typer.Option(help="Publish a full anchor instead of a delta.")] = False,
    dtype: Annotated[Optional[str], typer.Option(help="Publish floating tensors in this dtype (e.g. bfloat16).")] = None,
    files: Annotated[Optional[Path], typer.Option(help="Folder of model files to store (default: the checkpoint folder's).")] = None,
    take_over: Annotated[bool, typer.Option(help="Take the stream over from a publisher that holds it.")] = False,
    as_json: JsonOpt = False,
    storage_option: StorageOpt = None,
) -> None:
    """Publish a safetensors checkpoint as a step: a delta on the latest step (an anchor on an empty stream)."""
    from .history import push_checkpoint
    from .store import Store

    with Store(url, storage_options=_storage_options(storage_option)) as store:
        m = push_checkpoint(store, step, checkpoint, anchor=anchor, dtype=_dtype(dtype), files=files, take_over=take_over)
    if as_json:
        _print_json(m.to_dict())
        return
    on = "" if m.base_step is None else f" on step {m.base_step}"
    out.print(f"{url}: pushed {checkpoint} as step {m.step} ({m.kind}{on}), {_mb(m.object_bytes)}, "
              f"{m.stats.changed:,} of {m.stats.numel:,} elements ({_pct(m.stats.density)})", soft_wrap=True, markup=False)


@app.command("compare")
def compare_(
    url: Annotated[str, typer.Argument(help="Stream URL.")],
    a: Annotated[int, typer.Argument(help="First step.")],
    b: Annotated[int, typer.Argument(help="Second step.")],
    as_json: JsonOpt = False,
    storage_option: StorageOpt = None,
) -> None:
    """Per tensor and per layer: elements changed between two steps, relative L2 change, largest change."""
    from .history import compare

    with _reader(url, storage_option) as reader, _progress() as progress:
        c = compare(reader, a, b, progress=progress)
    if as_json:
        _print_json(c.to_dict())
        return
    for title, rows in ((f"step {a} -> {b}, per tensor", c.tensors), (f"step {a} -> {b}, per layer", c.layers)):
        table = Table(title=title)
        for col in ("name", "elements", "changed", "density", "rel L2", "max |change|"):
            table.add_column(col, justify="left" if col == "name" else "right")
        for d in rows:
            table.add_row(d.name, f"{d.numel:,}", f"{d.changed:,}", _pct(d.density), _num(d.rel_l2), _num(d.max_abs_change))
        out.print(table)


@app.command()
def stats(
    url: Annotated[str, typer.Argument(help="Stream URL.")],
    first: Annotated[Optional[int], typer.Option("--from", help="First step.")] = None,
    last: Annotated[Optional[int], typer.Option("--to", help="Last step.")] = None,
    plot: Annotated[Optional[Path], typer.Option(help="Draw change density per layer and bytes per step to this PNG.")] = None,
    as_json: JsonOpt = False,
    storage_option: StorageOpt = None,
) -> None:
    """Density, bytes, compression and stage timings over a stream (from manifests); --plot draws a heat map."""
    from .stats import layer_density, plot_stats, stream_stats

    with _reader(url, storage_option) as reader:
        s = stream_stats(reader, first=first, last=last)
        density = None
        if plot is not None:
            with _progress() as progress:
                density = layer_density(reader, [r.step for r in s.steps], progress=progress)
            try:
                plot_stats(s, density, plot)
            except ImportError as e:
                raise typer.BadParameter(str(e)) from None
    if as_json:
        _print_json({**s.to_dict(), **({"layer_density": density.to_dict()} if density else {})})
        return
    sm = s.summary()
    out.print(f"{url}: {sm['steps']} steps {sm['first_step']}..{sm['last_step']} ({sm['anchors']} anchors, {sm['deltas']} deltas), "
              f"{_mb(sm['total_bytes'])} stored; as full checkpoints: {_num(sm['compression_ratio'])}x more", soft_wrap=True, markup=False)
    table = Table(title="over the stream")
    for col in ("", "min", "median", "mean", "max"):
        table.add_column(col, justify="left" if not col else "right")
    for kind in ("delta", "anchor"):
        for key, fmt in (("density", _pct), ("capture_s", _num), ("encode_s", _num)):
            spread = sm[kind].get(key)
            if spread:
                table.add_row(f"{kind} {key}", *(fmt(spread[k]) for k in ("min", "median", "mean", "max")))
    table.add_row("delta bytes", "", "", _mb(sm["delta"]["mean_bytes"]), "")
    table.add_row("delta share of full", "", "", _pct(sm["delta"]["mean_share_of_full"]), "")
    out.print(table)
    if plot is not None:
        out.print(f"wrote {plot}", soft_wrap=True, markup=False)


@app.command("verify")
def verify_(
    url: Annotated[str, typer.Argument(help="Stream URL.")],
    first: Annotated[Optional[int], typer.Option("--from", help="First step.")] = None,
    last: Annotated[Optional[int], typer.Option("--to", help="Last step.")] = None,
    all_problems: Annotated[bool, typer.Option("--all", help="List every problem, not only the first.")] = False,
    as_json: JsonOpt = False,
    storage_option: StorageOpt = None,
) -> None:
    """Check every committed step by replaying it: objects, headers, chains and checksums. Exit 1 on a problem."""
    from .maintenance import verify

    with _reader(url, storage_option) as reader, _progress() as progress:
        report = verify(reader, first=first, last=last, all_problems=all_problems, progress=progress)
    if as_json:
        _print_json(report.to_dict())
    elif report.ok:
        out.print(f"{url}: steps {report.first}..{report.last} verified ({len(report.verified)} steps): objects, headers, "
                  f"chains and checksums (by replaying every tensor) all match", soft_wrap=True, markup=False)
    else:
        for p in report.problems:
            out.print(f"step {p.step}: {p.kind}: {p.message}", soft_wrap=True, markup=False)
    if not report.ok:
        raise typer.Exit(1)


@app.command("gc")
def gc_(
    url: Annotated[str, typer.Argument(help="Stream URL.")],
    keep_last: Annotated[int, typer.Option(help="Keep the last K steps (and what they need).")],
    keep_anchor_every: Annotated[Optional[int], typer.Option(help="Also keep the first anchor of every M steps.")] = None,
    consumer_max_age_s: Annotated[float, typer.Option(help="Respect consumer heartbeats at most this old.")] = 3600.0,
    dry_run: Annotated[bool, typer.Option(help="Show the plan, delete nothing.")] = False,
    as_json: JsonOpt = False,
    storage_option: StorageOpt = None,
) -> None:
    """Delete steps that no retained step, and no live consumer, needs (never an anchor a kept delta builds on)."""
    from .maintenance import collect_garbage

    with _progress() as progress:
        plan = collect_garbage(url, keep_last=keep_last, keep_anchor_every=keep_anchor_every, consumer_max_age_s=consumer_max_age_s,
                  dry_run=dry_run, storage_options=_storage_options(storage_option), progress=progress)
    if as_json:
        _print_json({**plan.to_dict(), "dry_run": dry_run})
        return
    rows = sorted([(s, "keep", why) for s, why in plan.keep.items()] + [(s, "delete", "") for s in plan.delete])
    table = Table(title=f"{url}: garbage collection{' (dry run)' if dry_run else ''}")
    for col in ("steps", "action", "why"):
        table.add_column(col)
    for first, last, action, why in _runs(rows):
        table.add_row(str(first) if first == last else f"{first}..{last}", action, why)
    out.print(table)
    for c in plan.live_consumers:
        out.print(f"live consumer {c.consumer_id} at step {c.step}", soft_wrap=True, markup=False)
    verb = "would delete" if dry_run else "deleted"
    out.print(f"{verb} {len(plan.delete)} steps ({_mb(plan.freed_bytes)}) and {len(plan.leftovers)} uncommitted folders; "
              f"kept {len(plan.keep)} steps", soft_wrap=True, markup=False)


def _runs(rows: list[tuple[int, str, str]]) -> Iterator[tuple[int, int, str, str]]:
    """Consecutive rows with the same action and reason, as (first, last, action, reason)."""
    start = None
    for i, (s, action, why) in enumerate(rows):
        if start is None:
            start = i
        if i + 1 == len(rows) or rows[i + 1][1:] != (action, why):
            yield rows[start][0], s, action, why
            start = None


EXIT_USER_ERROR = 2  # input, configuration or environment: the user can fix it
EXIT_BUG = 3  # an unexpected exception: a bug in deltasync
DEBUG_ENV = "DELTASYNC_DEBUG"


def main() -> None:
    """Run the CLI. Every failure a user can cause is one line on stderr and exit status 2, never a traceback:
    ``DeltaSyncError``s, ``OSError``s (a disk, a permission) and usage errors (an unknown option, a bad value).
    Anything else is a bug: one line, exit 3. ``DELTASYNC_DEBUG=1`` adds the traceback."""
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    try:
        code = app(standalone_mode=False)  # errors come back here instead of being printed by click/typer
    except typer.Exit as e:
        code = e.exit_code
    except (DeltaSyncError, OSError) as e:
        if isinstance(e, BrokenPipeError):  # `deltasync ls URL | head`: not an error worth a word
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
            sys.exit(1)
        _fail(f"{type(e).__name__}: {e}", EXIT_USER_ERROR)
    except typer.TyperException as e:  # click's usage errors: an unknown option, a bad value, a missing argument
        ctx = getattr(e, "ctx", None)
        if type(e).__name__ == "NoArgsIsHelpError":
            e.show()  # type: ignore[attr-defined]  # no arguments at all: the help is the answer
            sys.exit(e.exit_code)
        where = f" (see '{ctx.command_path} --help')" if ctx is not None else ""
        _fail(f"{e.format_message()}{where}", e.exit_code)
    except typer.Abort:
        _fail("aborted", 1)
    except Exception as e:  # noqa: BLE001 - the last resort: a bug, said in one line
        hint = "" if _debug() else f"; rerun with {DEBUG_ENV}=1 for the traceback"
        _fail(f"internal error (a bug in deltasync, please report it): {type(e).__name__}: {e}{hint}", EXIT_BUG)
    sys.exit(code if isinstance(code, int) else 0)


def _debug() -> bool:
    return os.environ.get(DEBUG_ENV, "") not in ("", "0")


def _fail(message: str, code: int) -> None:
    """Print ``error: message`` as exactly one line on stderr (after the traceback with DELTASYNC_DEBUG=1), exit."""
    if _debug():
        import traceback

        traceback.print_exc()
    typer.echo(f"error: {' '.join(message.split())}", err=True)
    sys.exit(code)


if __name__ == "__main__":
    main()
