"""The README's Python code blocks run as written: each in a fresh interpreter, in an empty folder, with a
temporary folder of its own in which no deltasync folder may remain (the README promises nothing is left behind)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FENCE = re.compile(r"^```python\n(.*?)^```", re.S | re.M)


def blocks(path: Path) -> list[tuple[int, str]]:
    """(line number, code) of every ```python block."""
    text = path.read_text()
    return [(text.count("\n", 0, m.start()) + 1, m.group(1)) for m in FENCE.finditer(text)]


def _params() -> list:
    out = []
    for line, code in blocks(ROOT / "README.md"):
        marks = [pytest.mark.vllm] if "rollout_loader.vllm" in code else []
        out.append(pytest.param(code, id=f"README.md:{line}", marks=marks))
    return out


def test_the_readme_has_python_blocks():
    assert len(blocks(ROOT / "README.md")) >= 2


@pytest.mark.parametrize("code", _params())
def test_readme_block_runs_as_written(code, tmp_path):
    tmp = tmp_path / "tmp"
    work = tmp_path / "work"
    tmp.mkdir()
    work.mkdir()
    env = {**os.environ, "TMPDIR": str(tmp), "PYTHONPATH": str(ROOT)}
    r = subprocess.run([sys.executable, "-c", code], cwd=work, env=env, capture_output=True, text=True, timeout=540,
                       check=False)
    assert r.returncode == 0, f"exit {r.returncode}\n--- stdout\n{r.stdout[-3000:]}\n--- stderr\n{r.stderr[-3000:]}"
    ours = sorted(p.name for p in tmp.iterdir() if p.name.startswith("deltasync-"))  # (torch keeps its own caches)
    assert not ours, f"left behind in TMPDIR: {ours}"


def test_the_store_contract_block_passes_under_pytest(tmp_path):
    """The README's store contract block is a third party's test module: saved as its first line says and run
    with pytest outside this repository (no conftest, no configuration), every contract test runs and passes."""
    from deltasync.testing.store_contract import StoreContract

    code = next(code for _, code in blocks(ROOT / "README.md") if "StoreContract" in code)
    name = code.splitlines()[0].split(";")[0].removeprefix("# ")
    assert name == "test_my_store.py"
    (tmp_path / name).write_text(code)
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    env = {**os.environ, "TMPDIR": str(tmp), "PYTHONPATH": str(ROOT)}
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", name], cwd=tmp_path, env=env,
                       capture_output=True, text=True, timeout=540, check=False)
    assert r.returncode == 0, f"exit {r.returncode}\n--- stdout\n{r.stdout[-3000:]}\n--- stderr\n{r.stderr[-3000:]}"
    contract = [n for n in dir(StoreContract) if n.startswith("test_")]
    assert re.search(rf"^{len(contract) - 1} passed, 1 skipped in ", r.stdout, re.M), r.stdout[-2000:]
    ours = sorted(p.name for p in tmp.iterdir() if p.name.startswith("deltasync-"))
    assert not ours, f"left behind in TMPDIR: {ours}"
