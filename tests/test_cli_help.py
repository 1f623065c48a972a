"""Help as users of ``git`` and ``hf`` expect it (issue 31, item 5), rendered at 80 columns through the real entry
point: ``-h`` as ``--help``, every option's text whole (never cut, never broken inside a word, no markup eaten),
``NAME`` metavars instead of ``<bool>`` and ``{url}``, a one-line summary per command, and examples that parse."""

from __future__ import annotations

import re
import shlex

import pytest
from typer.main import get_command

from deltasync_cli import app, main
from deltasync_cli.help import wrap

GROUP = get_command(app)
COMMANDS = GROUP.commands  # type: ignore[attr-defined]


def render(monkeypatch, capsys, *args: str, columns: int = 80) -> str:
    monkeypatch.setenv("COLUMNS", str(columns))
    monkeypatch.setattr("sys.argv", ["deltasync", *args])
    with pytest.raises(SystemExit) as e:
        main()
    captured = capsys.readouterr()
    assert e.value.code == 0 and captured.err == "", captured.err
    return captured.out


def words(text: str) -> str:
    return " ".join(text.split())


@pytest.mark.parametrize("name", sorted(COMMANDS))
def test_a_commands_help_at_80_columns_holds_every_options_text_whole(name, monkeypatch, capsys):
    text = render(monkeypatch, capsys, name, "-h")
    assert text == render(monkeypatch, capsys, name, "--help")
    assert max(len(line) for line in text.splitlines()) <= 80, text
    assert text.startswith(f"Usage: deltasync {name} [OPTIONS]"), text
    flat = words(text)
    command = COMMANDS[name]
    assert words(command.help) in flat  # the description, re-flowed, never cut mid-sentence
    for param in command.params:
        if getattr(param, "help", None):
            assert words(param.help) in flat, (param.name, param.help)  # whole: no ellipsis, no hyphen break
    assert "…" not in text and not re.search(r"<[a-z][a-z\[\]|, ]*>|\{[a-z_]+\}", text), text  # no <bool>, {url}
    examples = text.split("Examples:\n", 1)[1].splitlines()
    assert examples and all(line.startswith("  $ ") for line in examples if line), text


def test_the_list_of_commands_shows_each_summary_whole(monkeypatch, capsys):
    text = render(monkeypatch, capsys, "-h")
    assert text == render(monkeypatch, capsys, "--help")
    assert max(len(line) for line in text.splitlines()) <= 80, text
    listed = text.split("Commands:\n", 1)[1].split("\n\n", 1)[0].splitlines()
    assert [line.split()[0] for line in listed] == list(COMMANDS)  # one line each, in order
    for line in listed:
        name = line.split()[0]
        assert words(line) == f"{name} {COMMANDS[name].short_help}", line
        assert not COMMANDS[name].short_help.endswith("...")
    assert "--log-level LEVEL" in text and "$ deltasync env" in text


def test_markup_in_help_text_is_shown_as_written(monkeypatch, capsys):
    """Rich markup swallowed ``[metrics]``: the help said "Needs deltasync."."""
    assert "Needs deltasync[metrics]." in words(render(monkeypatch, capsys, "follow", "-h"))


def test_flags_and_arguments_read_as_in_other_tools(monkeypatch, capsys):
    text = render(monkeypatch, capsys, "follow", "-h")
    assert "Usage: deltasync follow [OPTIONS] URL\n" in text
    assert "\n  URL  Stream URL" in text
    assert "--prefetch / --no-prefetch " in text and "-S, --storage-option KEY=VALUE" in text
    assert "--until STEP" in text and "--poll-s SECONDS" in text and "[default: 0.25; 0.05 or more]" in words(text)


def test_narrow_terminals_never_break_inside_a_word():
    text = "needs --weight-transfer-config '{\"backend\": \"deltasync\"}' and http://127.0.0.1:8000/events"
    for width in (20, 30, 47):
        lines = wrap(text, width).splitlines()
        assert " ".join(lines) == text
        assert all(len(line) <= width or " " not in line for line in lines)


def _example_args(line: str) -> list[str]:
    """An example's arguments to deltasync: its leading VAR=value assignments and any redirection left out."""
    words_ = shlex.split(line.split(" > ", 1)[0])
    while "=" in words_[0]:
        words_.pop(0)
    assert words_[0] == "deltasync", line
    return words_[1:]


@pytest.mark.parametrize("name", sorted(COMMANDS))
def test_every_example_parses(name):
    """Each example names options the command has, with values of the right kind (files need not exist)."""
    command = COMMANDS[name]
    assert command.examples, f"deltasync {name} has no examples"
    for line in command.examples:
        assert len(line) <= 76, line  # with "  $ ": 80 columns
        args = _example_args(line)
        assert args[0] == name, line
        try:
            command.make_context(name, args[1:])
        except Exception as e:  # noqa: BLE001 - click's errors are typer's own classes here
            assert type(e).__name__ == "BadParameter" and "does not exist" in str(e), (line, e)
