"""The typer app every command module registers with, and helpers the commands share."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Annotated, Any, Literal

import typer
from rich.console import Console

from deltasync_cli.help import Command, Group

app = typer.Typer(
    help="Ship only what changed: sparse bit-exact weight deltas from an RL trainer to inference engines.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
    rich_markup_mode=None,  # plain help (deltasync_cli/help.py): rich markup ate "[metrics]" and cut words
    cls=Group,
    context_settings={"help_option_names": ["-h", "--help"]},
)
out = Console()
err = Console(stderr=True)


def command(name: str | None = None, *, summary: str, examples: Sequence[str]) -> Callable[[Any], Any]:
    """Register a command: ``summary`` is its line in ``deltasync -h`` (whole, never cut short: keep it under 60
    characters), ``examples`` the command lines its help ends with (each runs as written, 76 characters at most:
    tests/test_cli_help.py checks both)."""
    cls = type("Command", (Command,), {"examples": tuple(examples)})
    return app.command(name, cls=cls, short_help=summary)


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


LOG_LEVEL_ENV = "DELTASYNC_LOG_LEVEL"
LogLevel = Literal["debug", "info", "warning", "error"]


@app.callback()
def _options(
    version: Annotated[bool, typer.Option("--version", callback=_print_version, is_eager=True,
                                          help="Print the version and exit.")] = False,
    log_level: Annotated[LogLevel, typer.Option(
        "--log-level", envvar=LOG_LEVEL_ENV, case_sensitive=False, metavar="LEVEL",
       help=f"What the log shows on stderr: debug, info, warning or error (also ${LOG_LEVEL_ENV}); info adds each "
             "retry and recovery, debug every store request.")] = "warning",
) -> None:
    # commands import torch and deltasync inside their bodies: `--help` and `--version` answer at once
    import logging

    logging.getLogger().setLevel(log_level.upper())

StorageOpt = Annotated[
    list[str] | None,
    typer.Option("--storage-option", "-S", metavar="KEY=VALUE",
                                           help="fsspec storage option KEY=VALUE (JSON values allowed); repeatable."),
]


def _location(url: str, pairs: list[str] | None) -> Any:
    """Where ``url`` is, with the ``-S KEY=VALUE`` options (JSON values where they parse): the one value a command
    hands on (deltasync.store.location.StoreLocation)."""
    from deltasync.store.location import StoreLocation

    return StoreLocation.of(url, _option_pairs(pairs))


def _option_pairs(pairs: list[str] | None) -> dict[str, Any]:
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
REVOKED_KEYS_ENV = "DELTASYNC_REVOKED_KEYS"
STREAM_ID_ENV = "DELTASYNC_STREAM_ID"
MAX_AGE_ENV = "DELTASYNC_MAX_AGE_S"
TrustedKeyOpt = Annotated[
    list[Path] | None,
    typer.Option("--trusted-key", metavar="PATH",
                                  help=f"Public key (from `deltasync keygen`) that must have signed every step; "
                                       f"repeatable. Default: ${TRUSTED_KEYS_ENV} (paths separated by ':'). Needs "
                                       "--stream-id."),
]
RevokedKeyOpt = Annotated[
    list[Path] | None,
    typer.Option("--revoked-key", metavar="PATH",
                                  help=f"Public key trusted for nothing, nor any key it endorsed (a leaked key); "
                                       f"repeatable. Default: ${REVOKED_KEYS_ENV} (paths separated by ':')."),
]
StreamIdOpt = Annotated[
    str | None,
    typer.Option("--stream-id", metavar="ID",
                                help=f"The stream the trusted keys sign for (what the trainer logs, or its "
                                     f"stream_id option); never read from the store. Default: ${STREAM_ID_ENV}."),
]
MaxAgeOpt = Annotated[
    float | None,
    typer.Option("--max-age-s", metavar="SECONDS",
                                help=f"Refuse a stream whose newest signed head is older than this (a frozen or "
                                     f"held-back stream). Default: ${MAX_AGE_ENV}, else not required."),
]


def _env_list(name: str) -> list[str] | None:
    """A ':'-separated list of paths from the environment: None when unset; set but empty, or with an empty entry
    (a template that did not expand), is a ``ConfigError``: trust settings fail closed."""
    import os

    from deltasync.errors import ConfigError

    raw = os.environ.get(name)
    if raw is None:
        return None
    entries = raw.split(os.pathsep)
    if not raw.strip() or any(not e.strip() for e in entries):
        raise ConfigError(f"{name} is set to {raw[:200]!r}: expected one or more key files separated by "
                          f"{os.pathsep!r}, with no empty entry (unset it to check nothing)")
    return entries


def _trust(trusted_key: list[Path] | None, revoked_key: list[Path] | None = None, stream_id: str | None = None,
           max_age_s: float | None = None) -> Any:
    """The trust setting (a ``TrustedKeys``) from the flags, else the environment; None when neither names a
    trusted key (origin unchecked). Anything set but unusable is a ``ConfigError``, never unchecked."""
    import os

    from deltasync.errors import ConfigError
    from deltasync.trust import TrustedKeys

    keys = [str(k) for k in trusted_key] if trusted_key else _env_list(TRUSTED_KEYS_ENV)
    revoked = [str(k) for k in revoked_key] if revoked_key else _env_list(REVOKED_KEYS_ENV)
    flags = [name for name, value in (("--revoked-key", revoked_key), ("--stream-id", stream_id),
                                      ("--max-age-s", max_age_s)) if value is not None and value != []]
    if keys is None:
        if flags:
            raise ConfigError(f"{', '.join(flags)} given without --trusted-key (or ${TRUSTED_KEYS_ENV}): nothing "
                              "would be checked")
        return None
    if stream_id is None:
        stream_id = os.environ.get(STREAM_ID_ENV)
    if max_age_s is None and os.environ.get(MAX_AGE_ENV) is not None:
        raw = os.environ[MAX_AGE_ENV]
        try:
            max_age_s = float(raw)
        except ValueError:
            raise ConfigError(f"{MAX_AGE_ENV}: expected seconds, got {raw[:100]!r}") from None
    return TrustedKeys.load(keys, revoked or (), stream_id=stream_id, max_age_s=max_age_s)


def _reader(url: str, storage_option: list[str] | None, trust: Any = None) -> Any:
    """A ``StreamReader`` for a command; open it in a ``with`` block, so that its downloads are removed
    when the command ends, fails or is interrupted (Ctrl-C). With a trust setting, only signed steps are read."""
    from deltasync.follow.reader import StreamReader

    return StreamReader(_location(url, storage_option), trusted_keys=trust)


def _load_safetensors(path: Path) -> dict:
    import safetensors.torch

    from deltasync.errors import FormatError

    try:
        return safetensors.torch.load_file(str(path))
    except Exception as e:  # noqa: BLE001 - safetensors raises several types for unreadable files
        raise FormatError(f"{path}: not a readable safetensors file ({e})") from None



JsonOpt = Annotated[bool, typer.Option("--json", help="Print JSON (stable keys) instead of tables.")]


def inert(text: object) -> str:
    """``text`` (anything read from a store, a peer or an error) as a terminal shows it inert: every control
    character (escape sequences such as an OSC 52 clipboard write or a screen clear, bells, carriage returns),
    every invisible formatting character (bidirectional overrides, zero-width marks) and line or paragraph
    separator written as a visible escape (``\\x1b``, ``\\u202e``); tabs and newlines of our own are kept."""
    import unicodedata

    out = []
    for ch in str(text):
        if ch in "\n\t" or unicodedata.category(ch) not in ("Cc", "Cf", "Zl", "Zp", "Cs", "Co", "Cn"):
            out.append(ch)
        else:
            code = ord(ch)
            out.append(f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}" if code < 0x10000 else f"\\U{code:08x}")
    return "".join(out)


def inert_line(text: object) -> str:
    """``inert(text)`` kept to one line: its line breaks and tabs shown as escapes too, for text from outside inside a
    line of our own (a note under a table), where a break would start a line that seems to be ours."""
    return inert(text).replace("\n", "\\x0a").replace("\t", "\\x09")


def shown(text: object) -> str:
    """``inert(text)`` for a place that reads rich markup (a table cell, ``print`` with markup): its square
    brackets escaped too, so that ``[link=...]`` or ``[red]`` from a store is shown as written, never rendered."""
    from rich.markup import escape

    return escape(inert(text).replace("\n", "\\x0a"))


def fit_names(names: Sequence[str], other_columns: Sequence[Sequence[str]], width: int | None = None) -> list[str]:
    """``names`` (tensor names, consumer ids; from a store: shown inert, markup escaped, as ``shown`` does) as
    table cells, broken into lines that fit the first column of a table whose other
    columns hold ``other_columns`` (each: its header, then its cells) on a terminal ``width`` wide (default: this
    one's): a name wraps after a ``.`` (``model.layers.0.`` / ``self_attn.q_proj.weight``), never inside a part;
    only a part longer than the column breaks at ``_`` or ``-``, and only one longer still is cut. rich wraps at
    spaces only, and folding cut names mid-word (``model.layers.0.sel`` / ``f_attn...``)."""
    import re

    width = out.width if width is None else width
    others = sum(max((len(c) for c in column), default=0) for column in other_columns)
    # rich's default box: a border and a space each side of every cell (3 per column, and 1 closing border)
    room = max(12, width - others - 3 * (len(other_columns) + 1) - 1 - 1)  # (-1: a column of slack)

    def pieces(name: str) -> list[str]:
        out: list[str] = []
        for part in re.findall(r"[^.]+\.?|\.", name):
            if len(part) <= room:
                out.append(part)
                continue
            for sub in re.findall(r"[^_-]+[_-]?|[_-]", part):
                out += [sub[i:i + room] for i in range(0, len(sub), room)]
        return out

    from rich.markup import escape

    fitted = []
    for name in names:
        lines = [""]
        for piece in pieces(inert(name).replace("\n", "\\x0a")):  # shown inert, as ``shown`` shows it
            if lines[-1] and len(lines[-1]) + len(piece) > room:
                lines.append("")
            lines[-1] += piece
        fitted.append("\n".join(escape(line) for line in lines))
    return fitted


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
            # a download counts bytes (deltasync/store/objects.py reports them), everything else counts items
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


