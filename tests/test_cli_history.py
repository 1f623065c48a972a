"""The history commands: replay, push, compare, stats, verify, gc (and their --json, which scripts rely on)."""

import json

import pytest
import safetensors.torch
from typer.testing import CliRunner

from deltasync import StreamReader
from deltasync.engine import write_heartbeat
from deltasync.store import Store
from deltasync_cli import app, main
from tests.conftest import states_equal
from tests.damage import object_path
from tests.test_cli_errors import assert_one_line_error

runner = CliRunner()


def run_json(*args: str) -> dict | list:
    r = runner.invoke(app, [*args, "--json"])
    assert r.exit_code in (0, 1), r.output
    return json.loads(r.stdout)


def run_main(monkeypatch, capsys, *args: str) -> tuple[int, str, str]:
    """The real entry point: one-line errors on stderr, exit codes."""
    monkeypatch.setattr("sys.argv", ["deltasync", *args])
    with pytest.raises(SystemExit) as e:
        main()
    captured = capsys.readouterr()
    return e.value.code, captured.out, captured.err


def test_replay(qwen_stream, tmp_path):
    out = tmp_path / "step7"
    r = runner.invoke(app, ["replay", qwen_stream.url, "--step", "7", "-o", str(out)])
    assert r.exit_code == 0, r.output
    assert "step 7 from anchor 4 + 3 delta(s)" in r.output and "checksums match the manifest" in r.output
    loaded = safetensors.torch.load_file(str(out / "model.safetensors"))
    assert states_equal(loaded, {n: t for n, t in qwen_stream.truth[7].items() if n != "lm_head.weight"})
    d = run_json("replay", qwen_stream.url, "--step", "3", "-o", str(tmp_path / "step3"), "--reread")
    assert list(d) == ["step", "path", "chain", "tensors", "weights_bytes", "model_files", "state_checksum", "seconds"]
    assert d["chain"] == [0, 1, 2, 3]
    assert d["state_checksum"] == StreamReader(qwen_stream.url).manifest(3).state_checksum
    # into the folder one stands in ("-o ." exited 3 with "PosixPath('.') has an empty name")
    here = tmp_path / "here"
    here.mkdir()
    (here / "old.txt").write_text("replaced")
    monkeypatch = pytest.MonkeyPatch()
    with monkeypatch.context() as m:
        m.chdir(here)
        r = runner.invoke(app, ["replay", qwen_stream.url, "--step", "7", "-o", ".", "--overwrite"])
    assert r.exit_code == 0, r.output
    names = {p.name for p in here.iterdir()}
    assert "model.safetensors" in names and "old.txt" not in names  # the folder replaced, with the step in it


def test_replay_errors_are_one_line_and_write_nothing(stream_copy, tmp_path, monkeypatch, capsys):
    out = tmp_path / "out"
    code, _, err = run_main(monkeypatch, capsys, "replay", stream_copy, "--step", "12", "-o", str(out))
    assert code == 2 and err.count("\n") == 1
    assert "StepNotFoundError" in err and "step 12 is not committed (nearest committed: 9; stream holds 0..9)" in err
    code, _, err = run_main(monkeypatch, capsys, "replay", str(tmp_path / "nowhere"), "--step", "1", "-o", str(out))
    assert code == 2 and "no deltasync stream at" in err and "the location does not exist" in err
    object_path(Store(stream_copy), 6).write_bytes(b"x" * 10)
    code, _, err = run_main(monkeypatch, capsys, "replay", stream_copy, "--step", "7", "-o", str(out))
    assert code == 2 and "CorruptObjectError" in err and "step 6" in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["stream"]


def test_push_then_ls(qwen_stream, tmp_path):
    url = str(tmp_path / "imported")
    for step in (0, 5):
        ckpt = tmp_path / f"ckpt{step}.safetensors"
        safetensors.torch.save_file({n: t for n, t in qwen_stream.truth[step].items() if n != "lm_head.weight"},
                                    str(ckpt))
        r = runner.invoke(app, ["push", url, str(ckpt), "--step", str(step)])
        assert r.exit_code == 0, r.output
    assert "pushed" in r.output and "step 5 (delta on step 0)" in r.output
    d = run_json("push", url, str(ckpt), "--step", "6", "--anchor", "--dtype", "bfloat16")
    assert (d["step"], d["kind"], d["base_step"]) == (6, "anchor", None)
    assert set(d) == {"step", "base_step", "kind", "object", "object_bytes", "object_digest", "digest",
                      "state_checksum", "created_unix_s", "stats", "format_version"}
    assert [m["step"] for m in run_json("ls", url)] == [0, 5, 6]


def test_compare_json_is_stable(qwen_stream):
    d = run_json("compare", qwen_stream.url, "5", "9")
    assert list(d) == ["url", "a", "b", "tensors", "layers"]
    keys = ["name", "numel", "changed", "l2_base", "l2_change", "max_abs_change", "density", "rel_l2"]
    assert all(list(t) == keys for t in d["tensors"] + d["layers"])
    assert [t["name"] for t in d["layers"]] == ["model.embed_tokens", "model.layers.0", "model.layers.1", "model.norm"]
    r = runner.invoke(app, ["compare", qwen_stream.url, "5", "9"])
    assert r.exit_code == 0 and "per tensor" in r.output and "per layer" in r.output and "rel L2" in r.output


def test_stats_and_plot(qwen_stream, tmp_path):
    d = run_json("stats", qwen_stream.url)
    assert list(d) == ["url", "summary", "steps"]
    assert list(d["summary"]) == ["steps", "anchors", "deltas", "first_step", "last_step", "total_bytes",
                                  "compression_ratio", "delta", "anchor"]
    assert list(d["steps"][0]) == ["step", "kind", "base_step", "object_bytes", "full_bytes", "numel", "changed",
                                   "density",
                                   "capture_s", "encode_s", "coalesced_steps", "created_unix_s"]
    png = tmp_path / "s.png"
    r = runner.invoke(app, ["stats", qwen_stream.url, "--plot", str(png), "--from", "2"])
    assert r.exit_code == 0, r.output
    assert "8 steps 2..9 (2 anchors, 6 deltas)" in r.output and png.read_bytes()[:4] == b"\x89PNG"


def test_verify_exit_codes(stream_copy, monkeypatch, capsys):
    code, out, _ = run_main(monkeypatch, capsys, "verify", stream_copy)
    assert code == 0 and "steps 0..9 verified (10 steps)" in out
    Store(stream_copy).delete("steps/000000000002/manifest.json")
    code, out, _ = run_main(monkeypatch, capsys, "verify", stream_copy)
    assert code == 1 and out.splitlines() == [
        f"step 3: chain: {stream_copy}: step 3 is a delta on step 2, which is not committed (its folder holds objects "
        "but no manifest.json)"
    ]
    d = run_json("verify", stream_copy, "--all")
    assert list(d) == ["url", "first", "last", "verified", "problems", "origin_checked", "head", "ok"]
    assert [(p["step"], p["kind"]) for p in d["problems"]] == [(3, "chain")]
    assert d["verified"] == [0, 1, 4, 5, 6, 7, 8, 9] and d["ok"] is False
    code, _, _ = run_main(monkeypatch, capsys, "verify", stream_copy, "--from", "4")
    assert code == 0


def test_gc(stream_copy):
    d = run_json("gc", stream_copy, "--keep-last", "3", "--dry-run")
    assert list(d) == ["keep", "delete", "leftovers", "freed_bytes", "live_consumers", "stale_consumers", "unreadable",
                       "catchups", "dry_run"]
    assert d["delete"] == [3, 2, 1, 0] and d["dry_run"] is True
    assert d["keep"][0] == {"step": 4, "reason": "in the chain of step 7"}
    assert StreamReader(stream_copy).steps() == list(range(10))
    r = runner.invoke(app, ["gc", stream_copy, "--keep-last", "3", "--keep-anchor-every", "100", "--yes"])
    assert r.exit_code == 0, r.output
    assert "deleted 3 steps" in r.output and "first anchor of steps 0.." in r.output
    assert StreamReader(stream_copy).steps() == [0, 4, 5, 6, 7, 8, 9]


def test_gc_on_a_terminal_asks_first(stream_copy, monkeypatch):
    """A person at a terminal sees the plan and is asked; no deletes without yes (scripts are not asked)."""
    import deltasync_cli.history as history

    monkeypatch.setattr(history, "_on_terminal", lambda: True)
    r = runner.invoke(app, ["gc", stream_copy, "--keep-last", "3"], input="n\n")
    assert r.exit_code == 0 and "delete 4 steps" in r.output and "nothing deleted" in r.output, r.output
    assert StreamReader(stream_copy).steps() == list(range(10))
    r = runner.invoke(app, ["gc", stream_copy, "--keep-last", "3"], input="y\n")
    assert r.exit_code == 0 and "deleted 4 steps" in r.output, r.output
    assert StreamReader(stream_copy).steps() == [4, 5, 6, 7, 8, 9]
    r = runner.invoke(app, ["gc", stream_copy, "--keep-last", "1", "--yes"])  # --yes: not asked
    assert r.exit_code == 0 and "[y/N]" not in r.output and "deleted" in r.output, r.output


@pytest.mark.parametrize("json_", [False, True], ids=["table", "json"])
def test_gc_off_a_terminal_deletes_only_with_yes(stream_copy, monkeypatch, capsys, json_):
    """(issue 31, item 8) Off a terminal (a script, a cron job, a pipe) there is nobody to ask: gc deleted without
    being told to. Now it refuses, in one line naming --yes and --dry-run, and deletes nothing."""
    code, _, err = run_main(monkeypatch, capsys, "gc", stream_copy, "--keep-last", "3", *(["--json"] if json_ else []))
    assert_one_line_error(code, err, "--yes", "--dry-run", "4 steps")
    assert StreamReader(stream_copy).steps() == list(range(10))


def test_help_lists_the_history_commands():
    r = runner.invoke(app, ["--help"])
    for cmd in ("replay", "push", "compare", "stats", "verify", "gc"):
        assert cmd in r.output


@pytest.mark.parametrize("args, needle", [
    (["--keep-last", "3", "--consumer-max-age-s", "nan"],
     "consumer_max_age_s must be a number of seconds, 0 or more, got nan"),
    (["--keep-last", "3", "--consumer-max-age-s", "-5"], "got -5.0"),
    (["--keep-last", "0"], "keep_last must be a whole number of steps, at least 1, got 0"),
    (["--keep-last", "-2"], "got -2"),
    (["--keep-last", "3", "--keep-anchor-every", "0"],
     "keep_anchor_every must be a whole number of steps, at least 1, got 0"),
])
def test_gc_numbers_that_make_no_sense_are_one_line_and_delete_nothing(stream_copy, monkeypatch, capsys, args, needle):
    """(issue 19, item 8) NaN compares false with every age: every live consumer would look stale."""
    write_heartbeat(Store(stream_copy), "live", 2)
    code, _, err = run_main(monkeypatch, capsys, "gc", stream_copy, *args)
    assert_one_line_error(code, err, "ConfigError", needle)
    assert StreamReader(stream_copy).steps() == list(range(10))
