"""The ``deltasync`` command line: diff/patch checkpoints like files, inspect, replay and maintain streams, run the
demo.

Exit status: 0 done; 1 ``verify`` found a problem; 2 an error caused by input, configuration or environment (one
line on stderr: the error's type, what was expected, what arrived, and where); 3 an unexpected error, i.e. a
bug (one line too; ``DELTASYNC_DEBUG=1`` prints the traceback, for any error); 130 interrupted by Ctrl-C (SIGINT),
143 ended by SIGTERM (``kill``, a scheduler, ``docker stop``): 128 plus the signal's number, as a shell reports it.
A command stopped by a signal cleans up (downloads, spools, scratch folders) and never exits 0, so
``deltasync follow URL --server S --until 10 && start_eval`` does not start the evaluation after a kill.
"""

from __future__ import annotations

import logging
import os
import signal
import sys

import typer

# Importing these registers the commands (stream first, so that help lists its commands first). None of them
# imports torch or deltasync at import time: `deltasync --help` and `--version` answer at once.
import deltasync_cli.stream  # noqa: F401
from deltasync_cli import environment, fingerprint, follow, history, keys  # noqa: F401
from deltasync_cli.app import app, one_line

__all__ = ["app", "main"]


EXIT_USER_ERROR = 2  # input, configuration or environment: the user can fix it
EXIT_BUG = 3  # an unexpected exception: a bug in deltasync
EXIT_SIGINT = 128 + signal.SIGINT  # 130: Ctrl-C
EXIT_SIGTERM = 128 + signal.SIGTERM  # 143: kill, a scheduler, docker stop
DEBUG_ENV = "DELTASYNC_DEBUG"


def main() -> None:
    """Run the CLI. Every failure a user can cause is one line on stderr and exit status 2, never a traceback:
    ``DeltaSyncError``s, ``OSError``s (a disk, a permission) and usage errors (an unknown option, a bad value).
    Anything else is a bug: one line, exit 3. ``DELTASYNC_DEBUG=1`` adds the traceback."""
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    # stdout is the command's answer (`--json` is piped into programs); vLLM, which some commands start in this
    # process, logs to stdout unless told otherwise when it is first imported. A user's own choice wins.
    os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")
    for handler in logging.getLogger().handlers:  # log lines quote stores and peers: shown inert
        if type(handler) is logging.StreamHandler and not isinstance(handler.formatter, _InertFormatter):
            handler.setFormatter(_InertFormatter(handler.formatter))
    global _signalled
    _signalled = None
    previous = signal.getsignal(signal.SIGTERM)
    if previous is signal.SIG_DFL:  # `kill`, a scheduler, `docker stop`: as Ctrl-C, so that downloads, spools and
        signal.signal(signal.SIGTERM, _interrupted)  # scratch folders are removed (restored at the end)
    try:
        code = _run()
    finally:
        if previous is signal.SIG_DFL:
            signal.signal(signal.SIGTERM, previous)
    sys.exit(code)


def _run() -> int:
    """The command's exit status; user errors and bugs exit here (``_fail``) with their one line."""
    try:
        # errors come back here instead of being printed by click/typer; the program is "deltasync" however started
        code = app(standalone_mode=False, prog_name="deltasync")
    except typer.Exit as e:
        code = e.exit_code
    except KeyboardInterrupt:  # (typer turns one inside a command into exit 130; one outside it lands here)
        code = EXIT_SIGINT
    except OSError as e:
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
    except Exception as e:  # noqa: BLE001 - a DeltaSyncError (imported only now: it imports torch), or a bug
        if _is_deltasync_error(e):
            _fail(f"{type(e).__name__}: {e}", EXIT_USER_ERROR)
        hint = "" if _debug() else f"; rerun with {DEBUG_ENV}=1 for the traceback"
        _fail(f"internal error (a bug in deltasync, please report it): {type(e).__name__}: {e}{hint}", EXIT_BUG)
    code = code if isinstance(code, int) else 0
    if code == EXIT_SIGINT and _signalled == signal.SIGTERM:
        code = EXIT_SIGTERM  # the interrupt was a SIGTERM turned into KeyboardInterrupt (cleanup is the same)
    return code


_signalled: int | None = None  # the signal _interrupted turned into KeyboardInterrupt


def _interrupted(signum: int, frame: object) -> None:
    global _signalled
    _signalled = signum
    raise KeyboardInterrupt


def _is_deltasync_error(e: BaseException) -> bool:
    """Whether ``e`` is one of deltasync's errors (input, configuration, environment), without importing deltasync
    before an error needs it."""
    errors = sys.modules.get("deltasync.errors")
    return errors is not None and isinstance(e, errors.DeltaSyncError)


def _debug() -> bool:
    return os.environ.get(DEBUG_ENV, "") not in ("", "0")


def _fail(message: str, code: int) -> None:
    """Print ``error: message`` as exactly one line on stderr (after the traceback with DELTASYNC_DEBUG=1), exit."""
    if _debug():
        import traceback

        from deltasync.secrets import redact

        sys.stderr.write(redact(traceback.format_exc()))  # the causes quote backends: no secret in them either
    from deltasync.secrets import redact

    typer.echo(f"error: {one_line(redact(message))}", err=True)
    sys.exit(code)


class _InertFormatter(logging.Formatter):
    """A formatter whose lines show control characters inert (``deltasync_cli.app.inert``) and no secret
    (``deltasync.secrets.redact``): log messages quote what stores, peers and event feeds sent, and what backends
    said of their settings."""

    def __init__(self, inner: logging.Formatter | None) -> None:
        super().__init__()
        self._inner = inner or logging.Formatter()

    def format(self, record: logging.LogRecord) -> str:
        from deltasync.secrets import redact
        from deltasync_cli.app import inert

        return inert(redact(self._inner.format(record)))


if __name__ == "__main__":
    main()
