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
    assert [(m["step"], m["kind"], m["base_step"]) for m in rows] == [(0, "anchor", None), (1, "delta", 0), (2, "delta", 1)]
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
