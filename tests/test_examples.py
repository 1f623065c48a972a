"""Every example in examples/ runs as written (tiny sizes, a subprocess each) and says what it checked; and a new
user's first contact with the CLI: ``deltasync --version``, and ``--help`` without importing torch."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.integration.seaweedfs import s3_server  # noqa: F401 - fixture

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"


def run_example(name: str, *args: str, timeout_s: float = 300) -> list[str]:
    """Run ``examples/name`` as a user would; its output lines. It must exit 0 (its own check passed) and print no
    Python warning: an example that alarms (FSDP2's "can produce wrong gradients", TRL's "vLLM 0.32 unsupported"
    five times) teaches users to ignore warnings (issue 31, item 7). vLLM's own deprecation notices on import (vLLM
    0.32 on torch 2.13) are vLLM's, not the example's, and are left to vLLM."""
    # this tree's packages first: a script's own folder leads sys.path, where an install may name another clone
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    proc = subprocess.run([sys.executable, str(EXAMPLES / name), *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, check=False, timeout=timeout_s)
    assert proc.returncode == 0, f"{name} exited {proc.returncode}:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    warned = [line for line in proc.stderr.splitlines()
              if re.search(r"\b[A-Z]\w*Warning: ", line) and "/site-packages/vllm/" not in line]
    assert not warned, f"{name} warned:\n" + "\n".join(warned)
    return proc.stdout.splitlines()


def test_every_example_is_in_the_readme():
    readme = (EXAMPLES / "README.md").read_text()
    scripts = sorted(p.name for p in EXAMPLES.glob("*.py"))
    assert scripts and all(f"({name})" in readme for name in scripts)


def test_plain_pytorch():
    lines = run_example("plain_pytorch.py", "--steps", "3")
    assert lines[0].startswith("step   0: anchor")
    assert any(line.startswith("step   2: delta") for line in lines)
    assert any(line.startswith(("3 of 3 steps committed", "2 of 3 steps committed, 1 coalesced")) for line in lines)
    assert lines[-1] == "bit-exact: yes"


@pytest.mark.skipif(importlib.util.find_spec("accelerate") is None, reason="transformers' Trainer needs accelerate")
def test_hf_trainer():
    lines = run_example("hf_trainer.py", "--steps", "2")
    assert any(line.startswith("deltasync figures in ") and "'deltasync/bytes'" in line for line in lines)
    assert "steps 0..2" in lines[-2]
    assert lines[-1] == "bit-exact: yes"


def test_fsdp2_torchrun():
    """Two FSDP2 ranks under torchrun (started by the example itself), every rank publishing its shard."""
    lines = run_example("fsdp2_torchrun.py", "--steps", "2")
    assert [line.split(":")[0] for line in lines if line.startswith("step ")] == ["step   1", "step   2"]
    assert lines[-2].endswith(": steps 0..2, 2 parts per step (one per rank)")
    assert lines[-1] == "bit-exact: yes"


@pytest.mark.skipif(importlib.util.find_spec("trl") is None, reason="TRL is not installed (pip install trl==1.16.0)")
def test_trl_grpo():
    lines = run_example("trl_grpo.py", "--steps", "2")
    assert [line.split(":")[0] for line in lines if line.startswith("step ")] == ["step 1", "step 2"]
    # each step says what it published, and which step was the newest committed when the Trainer logged
    assert [line.split(";")[1].split(",")[0] for line in lines if line.startswith("step ")] == [
        " published as step 1", " published as step 2"]
    assert lines[-2].endswith(": steps [0, 1, 2]")
    assert lines[-1] == "bit-exact: yes"


def test_debug_divergence_finds_the_planted_bug(tmp_path):
    plot = tmp_path / "density.png"
    args = ["--steps", "6", "--bug-step", "4", "--bad-layer", "1"]
    if importlib.util.find_spec("matplotlib") is not None:
        args += ["--plot", str(plot)]
    lines = run_example("debug_divergence.py", *args)
    assert lines[-1] == "divergence: step 4, layer layers.1"
    assert any(line.startswith("compare 3 -> 4, tensors of layers.1") for line in lines)
    if "--plot" in args:
        assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_debug_divergence_plot_without_matplotlib_fails_at_the_start(tmp_path):
    """``--plot`` without matplotlib died with a traceback after the whole run: now one line before it starts."""
    code = ("import runpy, sys; sys.modules['matplotlib'] = None; sys.argv = sys.argv[1:]; "
            "runpy.run_path(sys.argv[0], run_name='__main__')")
    proc = subprocess.run([sys.executable, "-c", code, str(EXAMPLES / "debug_divergence.py"), "--steps", "6",
                           "--plot", str(tmp_path / "p.png")], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and proc.stdout == "", proc.stdout + proc.stderr
    assert proc.stderr.strip().splitlines()[-1].endswith("--plot: plotting needs matplotlib (import of matplotlib "
                                                         "halted; None in sys.modules): pip install 'deltasync[plot]'")
    assert "Traceback" not in proc.stderr


def test_storage_config_local():
    lines = run_example("storage_config.py", "--steps", "2")
    assert lines[-2] == "bit-exact: yes"
    assert lines[-1].startswith("removed ")


def test_store_contract_fsspec():
    """A backend deltasync knows nothing about (an fsspec filesystem written in the example) runs every test of the
    shipped store contract; the race test is skipped (the generic fsspec transport promises no atomic create)."""
    from deltasync.testing.store_contract import StoreContract

    lines = run_example("store_contract_fsspec.py")
    contract = sorted(name for name in dir(StoreContract) if name.startswith("test_"))
    summary = next(line for line in lines if re.fullmatch(r"\d+ passed, 1 skipped in .*", line))
    assert int(summary.split()[0]) == len(contract) - 1
    assert lines[-1] == "store contract on kvstore://: passed"


@pytest.mark.s3
def test_storage_config_on_s3(s3_server):  # noqa: F811
    """The S3-compatible settings the example documents (endpoint_url, key, secret) against a real server."""
    import s3fs

    s3fs.S3FileSystem(skip_instance_cache=True, **s3_server.storage_options).mkdirs("deltasync-examples", exist_ok=True)
    lines = run_example("storage_config.py", "s3://deltasync-examples/runs", "-S", f"endpoint_url={s3_server.endpoint}",
                        "-S", "key=deltasync", "-S", "secret=deltasync", "--steps", "2")
    assert lines[0].endswith(": committed steps [0, 1]") and lines[0].startswith("s3://deltasync-examples/runs/example-")
    assert lines[-2] == "bit-exact: yes"
    fs = s3fs.S3FileSystem(skip_instance_cache=True, **s3_server.storage_options)  # every object key, no listing cache
    prefix = lines[0].removeprefix("s3://deltasync-examples/").split(":")[0]
    left = fs.call_s3("list_objects_v2", Bucket="deltasync-examples", Prefix=prefix).get("Contents", [])
    assert [o["Key"] for o in left] == [], f"the example left objects under {prefix}"


@pytest.mark.vllm
def test_vllm_offline_follow():
    lines = run_example("vllm_offline_follow.py", "--steps", "2", timeout_s=600)
    assert any(line.startswith("step 2: engine applied [2], now at step 2") for line in lines)
    assert lines[-1] == "bit-exact: yes"


@pytest.mark.vllm
@pytest.mark.outside_ci  # a server start (~1.5 min): CI follows a real server in test_vllm_engine.py instead
def test_vllm_server_sync():
    """A real vLLM server kept in sync by ``deltasync follow --server``; every rollout names its step."""
    lines = run_example("vllm_server_sync.py", "--steps", "2", timeout_s=900)
    rollouts = [line for line in lines if line.startswith("step ") and "/weight_info says" in line]
    assert [line.split(":")[0] for line in rollouts] == ["step 0", "step 1", "step 2"]
    for step, line in enumerate(rollouts):
        assert f"sampled by weight versions [('{step}', 0, 8)]" in line
    assert any(line.startswith("step 2 live in http://127.0.0.1:") for line in lines)  # the follower's own line
    assert lines[-1] == "every rollout tied to its step, server verified at step 2: yes"


@pytest.mark.vllm
@pytest.mark.outside_ci  # Ray and three engines (~1.5 min): CI runs the same fleet in integration/test_vllm_ray.py
@pytest.mark.skipif(importlib.util.find_spec("ray") is None, reason="Ray is not installed")
def test_ray_fleet():
    lines = run_example("ray_fleet.py", "--steps", "2", timeout_s=900)
    assert "step 2: applied [2] in both actors, weight versions ['2', '2']" in lines
    assert "each actor holds the trainer's bf16 weights at step 2: [True, True]" in lines
    assert lines[-1] == "bit-exact: yes"


@pytest.mark.vllm
@pytest.mark.outside_ci  # a server start (~1 min): CI runs the same training in tests/integration/test_trl_async.py
@pytest.mark.skipif(importlib.util.find_spec("trl") is None, reason="TRL is not installed (pip install trl==1.16.0)")
def test_trl_async_grpo():
    """TRL's AsyncGRPOTrainer with DeltasyncWeightTransfer against a real vLLM server it starts itself."""
    lines = run_example("trl_async_grpo.py", "--steps", "2", timeout_s=900)
    assert [line.split(":")[0] for line in lines if line.startswith("step ")] == ["step 1", "step 2"]
    assert lines[-2].startswith("syncs: steps [0, 1, 2]; stream ") and lines[-2].endswith(
        ": steps [0, 1, 2]; server holds step 2")
    assert lines[-1] == "server bit-exact with the trainer at step 2: yes"


# --- first contact with the command line ---


def test_version_prints_the_installed_version():
    proc = subprocess.run([sys.executable, "-m", "deltasync_cli", "--version"], capture_output=True, text=True,
                          timeout=60, check=False)
    assert proc.returncode == 0 and proc.stdout == f"deltasync {importlib.metadata.version('deltasync')}\n"
    # python -m deltasync is the same command; the package says its version too
    proc = subprocess.run([sys.executable, "-m", "deltasync", "--version"], capture_output=True, text=True, timeout=60,
                          check=False)
    assert proc.returncode == 0 and proc.stdout == f"deltasync {importlib.metadata.version('deltasync')}\n"
    import deltasync

    assert deltasync.__version__ == importlib.metadata.version("deltasync")


def test_help_imports_neither_torch_nor_deltasync():
    """``deltasync --help`` must answer at once: the CLI imports torch and the library only inside commands."""
    code = (
        "import sys\n"
        "sys.argv = ['deltasync', '--help']\n"
        "import deltasync_cli\n"
        "try:\n"
        "    deltasync_cli.main()\n"
        "except SystemExit as e:\n"
        "    assert e.code == 0, e.code\n"
        "print(sorted(m for m in ('torch', 'deltasync', 'numpy', 'rollout_loader') if m in sys.modules))\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=False)
    assert proc.returncode == 0, proc.stderr
    assert "replay" in proc.stdout and "Usage" in proc.stdout
    assert proc.stdout.splitlines()[-1] == "[]"
