import json

import pytest
import safetensors.torch
from typer.testing import CliRunner

from deltasync import DeltaPublisher
from deltasync_cli import app, main
from tests.conftest import perturb, states_equal
from tests.test_publisher import train

runner = CliRunner()


@pytest.fixture
def checkpoints(tmp_path, small_state, gen):
    base, target = tmp_path / "base.safetensors", tmp_path / "target.safetensors"
    safetensors.torch.save_file(small_state, str(base))
    new = {k: perturb(v, 0.05, gen) for k, v in small_state.items()}
    safetensors.torch.save_file(new, str(target))
    return base, target, new


def test_diff_then_patch_is_bit_exact(tmp_path, checkpoints):
    base, target, new = checkpoints
    delta, out = tmp_path / "d.safetensors", tmp_path / "out.safetensors"
    r = runner.invoke(app, ["diff", str(base), str(target), "-o", str(delta)])
    assert r.exit_code == 0, r.output
    assert "elements changed" in r.output and delta.stat().st_size < target.stat().st_size
    r = runner.invoke(app, ["patch", str(base), str(delta), "-o", str(out)])
    assert r.exit_code == 0, r.output
    assert states_equal(safetensors.torch.load_file(str(out)), new)


def test_patch_onto_the_wrong_base_writes_nothing(tmp_path, checkpoints, monkeypatch, capsys):
    base, target, _ = checkpoints
    delta, out = tmp_path / "d.safetensors", tmp_path / "out.safetensors"
    runner.invoke(app, ["diff", str(base), str(target), "-o", str(delta)])
    monkeypatch.setattr("sys.argv", ["deltasync", "patch", str(target), str(delta), "-o", str(out)])
    with pytest.raises(SystemExit) as e:
        main()
    assert e.value.code == 2
    assert "ChecksumMismatchError" in capsys.readouterr().err
    assert not out.exists()


def test_ls_and_show(tmp_path, small_state, gen):
    with DeltaPublisher(str(tmp_path), small_state, on_backlog="block") as pub:
        for s in range(3):
            train(small_state, gen)
            pub.publish(s)
    r = runner.invoke(app, ["ls", str(tmp_path), "--json"])
    rows = json.loads(r.output)
    assert [(m["step"], m["kind"], m["base_step"]) for m in rows] == [(0, "anchor", None), (1, "delta", 0),
                                                                      (2, "delta", 1)]
    r = runner.invoke(app, ["ls", str(tmp_path)])
    assert "committed" in r.output and r.output.count("delta") == 2
    r = runner.invoke(app, ["show", str(tmp_path), "2", "--json"])
    shown = json.loads(r.output)
    assert shown["manifest"]["step"] == 2 and set(shown["tensors"]) == set(small_state)
    r = runner.invoke(app, ["show", str(tmp_path), "2"])
    assert "embed.weight" in r.output


def test_missing_step_is_a_one_line_error(tmp_path, small_state, monkeypatch, capsys):
    with DeltaPublisher(str(tmp_path), small_state) as pub:
        pub.publish(0)
    monkeypatch.setattr("sys.argv", ["deltasync", "show", str(tmp_path), "9"])
    with pytest.raises(SystemExit) as e:
        main()
    assert e.value.code == 2
    assert "step 9 is not committed (nearest committed: 0" in capsys.readouterr().err


def test_help_explains_every_command():
    r = runner.invoke(app, ["--help"])
    for cmd in ("diff", "patch", "ls", "show", "demo"):
        assert cmd in r.output


def test_patch_writes_its_output_with_the_umask_s_mode(tmp_path):
    """(issue 19, item 12) The output was made as a temporary file (0600) and kept that mode."""
    import os
    import stat
    import subprocess
    import sys

    import safetensors.torch
    import torch

    base, target = tmp_path / "base.safetensors", tmp_path / "target.safetensors"
    g = torch.Generator().manual_seed(0)
    w = torch.randn(64, 64, generator=g).bfloat16()
    safetensors.torch.save_file({"w": w}, base)
    w2 = w.clone()
    w2.view(-1)[:7] += 1
    safetensors.torch.save_file({"w": w2}, target)
    code = ("import os, sys; os.umask(0o022); from deltasync_cli import main; "
            "sys.argv = ['deltasync'] + sys.argv[1:]; main()")
    for args in (["diff", str(base), str(target), "-o", str(tmp_path / "d")],
                 ["patch", str(base), str(tmp_path / "d"), "-o", str(tmp_path / "out.safetensors")]):
        r = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=120)
        assert r.returncode == 0, r.stderr
    assert stat.S_IMODE(os.stat(tmp_path / "out.safetensors").st_mode) == 0o644
    assert sorted(p.name for p in tmp_path.iterdir()) == ["base.safetensors", "d", "out.safetensors",
                                                          "target.safetensors"]


def test_follow_with_a_consumer_id_shows_in_status_and_gc_keeps_its_step(tmp_path, small_state, gen, monkeypatch,
                                                                         capsys):
    """(issue 31, item 4) A server kept in sync by ``deltasync follow`` reported nothing: it never showed in
    ``deltasync status``, and ``gc`` could not protect its step. With ``--consumer-id`` (or
    ``$DELTASYNC_CONSUMER_ID``) it reports from the start, and the step it reached when it exits."""
    from tests.test_vllm_client import fake_server

    url = str(tmp_path / "stream")
    with DeltaPublisher(url, small_state, on_backlog="block", anchor_every=2) as pub:
        for s in range(4):
            train(small_state, gen)
            pub.publish(s)

    def run(*args: str) -> tuple[int, str]:
        monkeypatch.setattr("sys.argv", ["deltasync", *args])
        with pytest.raises(SystemExit) as e:
            main()
        captured = capsys.readouterr()
        return e.value.code, captured.out + captured.err

    with fake_server() as (fake, server):
        code, out = run("follow", url, "--server", server, "--until", "3", "--consumer-id", "gpu-7")
        assert code == 0, out
        assert f"following {url} into {server}: it holds no step yet" in out and "as consumer gpu-7" in out
        assert fake.version == "3"
        monkeypatch.setenv("DELTASYNC_CONSUMER_ID", "gpu-8")  # the same, from the environment
        code, out = run("follow", url, "--server", server, "--until", "3")
        assert code == 0 and "it holds step 3" in out, out
    code, out = run("status", url, "--json")
    consumers = {c["consumer_id"]: c for c in json.loads(out)["consumers"]}
    assert code == 0 and set(consumers) == {"gpu-7", "gpu-8"}, out
    assert consumers["gpu-7"]["step"] == 3 and consumers["gpu-7"]["lag_steps"] == 0
    assert consumers["gpu-7"]["weight_version"] == "3"
    code, out = run("status", url)
    assert code == 0 and "gpu-7" in out and "live" in out
    code, out = run("gc", url, "--keep-last", "1", "--dry-run")
    assert code == 0 and "live consumer gpu-7 at step 3" in out, out


def _first_column(table: str) -> list[str]:
    """The first cells of a rich table's rows, each cell's lines joined (a row goes on while its other cells are
    empty)."""
    cells: list[str] = []
    for line in table.splitlines():
        parts = line.split("│")
        if len(parts) < 3:
            continue
        first, rest = parts[1].strip(), "".join(parts[2:]).strip()
        if rest or not cells:
            cells.append(first)
        else:
            cells[-1] += first
    return cells


def test_tables_at_80_columns_keep_names_whole(qwen_stream, tmp_path, monkeypatch, capsys):
    """(issue 31, item 8) At 80 columns ``show``, ``compare`` and ``status`` cut tensor names mid-word
    (``model.layers.0.sel`` / ``f_attn...``): a name now wraps between its dotted parts; ``ls`` shows sizes in MB as
    the other commands do, and when each step was committed."""
    from deltasync.engine import write_heartbeat
    from deltasync.store import Store

    monkeypatch.setenv("COLUMNS", "80")

    def run(*args: str) -> str:
        monkeypatch.setattr("sys.argv", ["deltasync", *args])
        with pytest.raises(SystemExit) as e:
            main()
        captured = capsys.readouterr()
        assert e.value.code == 0, captured.err
        assert "--json" in args or max(len(line) for line in captured.out.splitlines()) <= 80, captured.out
        return captured.out

    names = list(json.loads(run("show", qwen_stream.url, "5", "--json"))["tensors"])
    assert max(map(len, names)) > 30  # long enough to wrap at 80 columns
    shown = _first_column(run("show", qwen_stream.url, "5"))
    assert sorted(shown) == sorted(names)  # (the header row is drawn with other lines)
    table = run("compare", qwen_stream.url, "1", "5").split("per layer")[0]
    assert sorted(_first_column(table)) == sorted(names)
    for line in run("show", qwen_stream.url, "5").splitlines():  # a wrapped name breaks after a dot (or, in a part
        cell = line.split("│")[1].strip() if line.count("│") > 2 else ""  # longer than the column, a _)
        assert not cell or cell.endswith((".", "_")) or any(n.endswith(cell) for n in names), line

    url = str(tmp_path / "stream")
    import shutil

    shutil.copytree(qwen_stream.url, url)
    consumer = "rollout-worker-eu-west-1.gpu-node-0042.vllm-replica-7"
    with Store(url) as store:
        write_heartbeat(store, consumer, 9, newest_step=9, weight_version="9")
    assert _first_column(run("status", url)) == [consumer]

    listed = run("ls", url)
    assert "0.0" in listed and " MB " in listed and "committed" in listed and "bytes" not in listed
