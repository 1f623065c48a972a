"""Help as users of ``git`` and ``hf`` expect it: plain text wrapped at word boundaries (never inside a word, an
option name or a URL), ``NAME`` and ``--option VALUE`` instead of types, ``-h`` beside ``--help``, and each command's
help ending with examples that run as written.

typer's own help renders through rich markup, which swallowed ``[metrics]`` in ``deltasync[metrics]``, cut option
text with an ellipsis at 80 columns, and showed ``<bool>`` and ``{url}``; the command class here formats with
click's plain formatter instead (``rich_markup_mode=None``) and writes the parameter lines itself.
"""

from __future__ import annotations

import textwrap
from collections.abc import Iterable, Sequence
from typing import Any

import typer
from typer.core import TyperCommand, TyperGroup

__all__ = ["Command", "Group", "wrap"]


def wrap(text: str, width: int, initial_indent: str = "", subsequent_indent: str = "") -> str:
    """``text`` wrapped to ``width`` at spaces only: paragraphs (split by blank lines) are re-flowed, a paragraph
    that starts with a ``\\b`` line is kept as written (click's convention), and no word is ever split: not at a
    hyphen (``--weight-transfer-config``), not where it is longer than the line (a URL overflows instead)."""
    wrapper = textwrap.TextWrapper(width=max(width, 20), initial_indent=initial_indent,
                                   subsequent_indent=subsequent_indent, break_on_hyphens=False,
                                   break_long_words=False)
    out = []
    for paragraph in textwrap.dedent(text).strip("\n").split("\n\n"):
        lines = paragraph.splitlines()
        if lines and lines[0].strip() == "\b":
            out.append("\n".join(subsequent_indent + line for line in lines[1:]))
        else:
            out.append(wrapper.fill(" ".join(line.strip() for line in lines)))
        wrapper.initial_indent = subsequent_indent
    return "\n\n".join(out)


# typer 0.29 carries a click of its own (typer._click): its classes are reached through typer's public ones, and
# parameters are read by their attributes, which both clicks share
_BaseFormatter: Any = typer.Context.formatter_class


class HelpFormatter(_BaseFormatter):
    """click's formatter with :func:`wrap`: words stay whole."""

    def write_text(self, text: str) -> None:
        indent = " " * self.current_indent
        self.write(wrap(text, self.width, indent, indent) + "\n")

    def write_dl(self, rows: Iterable[tuple[str, str]], col_max: int = 30, col_spacing: int = 2) -> None:
        rows = list(rows)
        first_col = min(max((len(first) for first, _ in rows), default=0), col_max) + col_spacing
        indent = " " * self.current_indent
        for first, second in rows:
            self.write(f"{indent}{first}")
            if not second:
                self.write("\n")
                continue
            if len(first) <= first_col - col_spacing:
                self.write(" " * (first_col - len(first)))
            else:  # a long term: its text starts on the next line, in the column
                self.write("\n" + " " * (first_col + self.current_indent))
            lines = wrap(second, self.width - first_col - self.current_indent).splitlines()
            self.write("\n".join([lines[0], *(" " * (first_col + self.current_indent) + line if line else ""
                                              for line in lines[1:])]) + "\n")


class Context(typer.Context):
    formatter_class = HelpFormatter


def _is_argument(param: Any) -> bool:
    return getattr(param, "param_type_name", None) == "argument"


def _choices(param: Any) -> Sequence[Any] | None:
    for holder in (getattr(param, "type", None), getattr(param, "type_descriptor", None)):
        choices = getattr(holder, "choices", None)
        if choices:
            return list(choices)
    return None


def _metavar(param: Any) -> str:
    """``URL``, ``STEP``, ``KEY=VALUE``: the metavar a parameter was given, else its name in capitals (a choice:
    its values, ``[a|b|c]``)."""
    if param.metavar:
        return str(param.metavar)
    choices = _choices(param)
    if choices:
        return "[" + "|".join(str(getattr(c, "value", c)) for c in choices) + "]"
    return str(param.name or "value").upper()


def _extras(param: Any, ctx: Any) -> list[str]:
    """What click adds after an option's help: its default, its range, whether it is required."""
    extra = []
    if not _is_argument(param) and param.show_default is not False:
        default = param.get_default(ctx, call=False)
        if default not in (None, False, (), []):
            if param.is_flag and param.secondary_opts:  # --prefetch / --no-prefetch: name the one that is on
                default = (param.opts if default else param.secondary_opts)[0]
            extra.append(f"default: {getattr(default, 'value', default)}")
    holder = param if hasattr(param, "min") else getattr(param, "type", None)
    low, high = getattr(holder, "min", None), getattr(holder, "max", None)
    if low is not None or high is not None:
        extra.append(f"{low} or more" if high is None else f"at most {high}" if low is None else f"{low} to {high}")
    if param.required:
        extra.append("required")
    return extra


def _record(param: Any, ctx: Any) -> tuple[str, str] | None:
    """One line of the Arguments or Options table: ``-S, --storage-option KEY=VALUE`` and its text."""
    if getattr(param, "hidden", False):
        return None
    if _is_argument(param):
        term = _metavar(param) + ("..." if param.nargs != 1 else "")
    else:
        term = ", ".join(sorted(param.opts, key=lambda o: (len(o) > 2, o)))
        if param.secondary_opts:
            term += " / " + ", ".join(param.secondary_opts)
        if not param.is_flag and not param.count:
            term += " " + _metavar(param)
    text = getattr(param, "help", None) or ""
    extra = _extras(param, ctx)
    if extra:
        text = f"{text} [{'; '.join(extra)}]" if text else f"[{'; '.join(extra)}]"
    return term, text


class _Examples:
    """Help that ends with examples (``examples``: command lines without the leading ``$``), written as they are,
    one per line, and a pointer to the documentation."""

    examples: Sequence[str] = ()

    def format_epilog(self, ctx: Any, formatter: Any) -> None:
        if self.examples:
            formatter.write_paragraph()
            formatter.write_heading("Examples")
            with formatter.indentation():
                for line in self.examples:
                    formatter.write(" " * formatter.current_indent + f"$ {line}\n")


class Command(_Examples, TyperCommand):
    """A deltasync command: plain help with ``NAME`` metavars, whole words, and examples."""

    context_class = Context

    def collect_usage_pieces(self, ctx: Any) -> list[str]:
        pieces = [self.options_metavar] if self.options_metavar else []
        for param in self.get_params(ctx):
            if _is_argument(param):
                name = _metavar(param) + ("..." if param.nargs != 1 else "")
                pieces.append(name if param.required else f"[{name}]")
        return pieces

    def format_options(self, ctx: Any, formatter: Any) -> None:
        for title, arguments in (("Arguments", True), ("Options", False)):
            params = [p for p in self.get_params(ctx) if _is_argument(p) == arguments]
            rows = [r for p in params if (r := _record(p, ctx)) is not None]
            if rows:
                with formatter.section(title):
                    formatter.write_dl(rows)


class Group(_Examples, TyperGroup):
    """The ``deltasync`` group: commands listed in the order they were registered, each with its one-line
    summary (never cut short), then examples."""

    context_class = Context
    examples = (
        "deltasync demo --steps 8",
        "deltasync ls s3://bucket/run-7 -S endpoint_url=http://127.0.0.1:8333",
        "deltasync follow s3://bucket/run-7 --server http://127.0.0.1:8000",
        "deltasync env",
    )

    def format_options(self, ctx: Any, formatter: Any) -> None:
        rows = [r for p in self.get_params(ctx) if (r := _record(p, ctx)) is not None]
        with formatter.section("Options"):
            formatter.write_dl(rows)
        self.format_commands(ctx, formatter)

    def format_commands(self, ctx: Any, formatter: Any) -> None:
        rows = []
        for name in self.list_commands(ctx):
            cmd = self.get_command(ctx, name)
            if cmd is not None and not cmd.hidden:
                rows.append((name, cmd.short_help or cmd.get_short_help_str(limit=1000)))
        with formatter.section("Commands"):
            formatter.write_dl(rows)

    def format_epilog(self, ctx: Any, formatter: Any) -> None:
        super().format_epilog(ctx, formatter)
        formatter.write_paragraph()
        formatter.write_text(f"'{ctx.command_path} COMMAND -h' shows a command's options and examples; README.md "
                             "(Command line, Troubleshooting) and docs/ tell the rest.")
