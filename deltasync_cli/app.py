"""The typer app every command module registers with, and helpers the commands share."""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console

app = typer.Typer(
    help="Ship only what changed: sparse bit-exact weight deltas from an RL trainer to inference engines.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
)
out = Console()
err = Console(stderr=True)


def one_line(text: str) -> str:
    """``text`` as one line that a terminal shows as it is: runs of white space as one space, every other control or
    format character (ESC, BEL, C1 codes, bidirectional overrides) as its escape (``\\x1b``). Errors carry words of
    servers and stores (an HTTP body, a relayed engine error): they must not drive the terminal they are shown on."""
    return " ".join("".join(c if c.isprintable() or c.isspace() else ascii(c)[1:-1] for c in text).split())


def _print_version(value: bool) -> None:
    if value:
        from importlib.metadata import PackageNotFoundError, version

        try:
            number = version("deltasync")
        except PackageNotFoundError:  # run from a source tree that was never installed
            number = "unknown (not installed)"
        typer.echo(f"deltasync {number}")
        raise typer.Exit()


@app.callback()
def _options(
    version: Annotated[bool, typer.Option("--version", callback=_print_version, is_eager=True,
                                          help="Print the version and exit.")] = False,
) -> None:
    # commands import torch and deltasync inside their bodies: `--help` and `--version` answer at once
    pass

StorageOpt = Annotated[
    list[str] | None,
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


TRUSTED_KEYS_ENV = "DELTASYNC_TRUSTED_KEYS"
TrustedKeyOpt = Annotated[
    list[Path] | None,
    typer.Option("--trusted-key", help=f"Public key (from `deltasync keygen`) that must have signed every step; "
                                       f"repeatable. Default: ${TRUSTED_KEYS_ENV} (paths separated by ':')."),
]


def _trusted(keys: list[Path] | None) -> list[str] | None:
    """The trusted key files: the flags, else the environment variable, else None (origin unchecked)."""
    import os

    if keys:
        return [str(k) for k in keys]
    env = os.environ.get(TRUSTED_KEYS_ENV)
    return [k for k in env.split(os.pathsep) if k] or None if env else None


def _reader(url: str, storage_option: list[str] | None, trusted_key: list[Path] | None = None) -> Any:
    """A ``StreamReader`` for a command; open it in a ``with`` block, so that its downloads are removed
    when the command ends, fails or is interrupted (Ctrl-C). With trusted keys, only signed steps are read."""
    from deltasync.reader import StreamReader

    return StreamReader(url, storage_options=_storage_options(storage_option), trusted_keys=_trusted(trusted_key))


def _load_safetensors(path: Path) -> dict:
    import safetensors.torch

    from deltasync.errors import FormatError

    try:
        return safetensors.torch.load_file(str(path))
    except Exception as e:  # noqa: BLE001 - safetensors raises several types for unreadable files
        raise FormatError(f"{path}: not a readable safetensors file ({e})") from None



JsonOpt = Annotated[bool, typer.Option("--json", help="Print JSON (stable keys) instead of tables.")]


@contextmanager
def _progress() -> Iterator[Any]:
    """A progress callback drawing rich bars on stderr when it is a terminal; None (quiet) otherwise."""
    if not err.is_terminal:
        yield None
        return
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    with Progress(TextColumn("{task.description}"), BarColumn(), TextColumn("{task.fields[count]}"),
                  TimeElapsedColumn(), console=err, transient=True) as bar:
        tasks: dict[str, Any] = {}

        def update(what: str, done: int, total: int) -> None:
            # a download counts bytes (store_objects.py reports them), everything else counts items
            count = f"{done / 1e6:,.1f}/{total / 1e6:,.1f} MB" if what.startswith("download") else f"{done}/{total}"
            if what not in tasks:
                tasks[what] = bar.add_task(what, total=total, count=count)
            bar.update(tasks[what], completed=done, total=total, count=count)
            if done >= total and what.startswith("download"):  # one bar per download while it runs
                bar.remove_task(tasks.pop(what))

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

    from deltasync.engine import DTYPES

    if name is None:
        return None
    dtype = DTYPES.get(name.upper()) or getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise typer.BadParameter(f"unknown dtype {name!r} (e.g. bfloat16, float16, float32, BF16)")
    return dtype


