"""The public surface: a dozen names at the top, documented submodules for the rest, and no package reaching
into another's internals (issue 21: an API a newcomer can hold in their head)."""

from __future__ import annotations

import ast
import importlib
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PUBLIC = ["deltasync", "deltasync.engine", "deltasync.errors", "deltasync.history", "deltasync.transports",
          "deltasync.publish", "deltasync.testing", "deltasync.testing.store_contract",
          "deltasync.integrations.transformers", "rollout_loader", "rollout_loader.vllm"]


def _imports(folder: str) -> list[tuple[str, int, str]]:
    """(file, line, module) of every ``import``/``from ... import`` of a deltasync module under ``folder``."""
    out = []
    for path in sorted((ROOT / folder).rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                mods = [node.module]
            elif isinstance(node, ast.Import):
                mods = [a.name for a in node.names]
            else:
                continue
            out += [(str(path.relative_to(ROOT)), node.lineno, m) for m in mods if m.split(".")[0] == "deltasync"]
    return out


def test_the_top_level_exports_a_dozen_names_and_each_resolves():
    import deltasync

    assert len(deltasync.__all__) <= 15, deltasync.__all__
    assert len(set(deltasync.__all__)) == len(deltasync.__all__)
    for name in deltasync.__all__:
        if name != "RdmaConsumer":  # imported on first use (needs the rdma extra); resolved in test_rdma_*
            assert getattr(deltasync, name) is not None
    assert deltasync.__version__


@pytest.mark.parametrize("module", PUBLIC)
def test_every_public_module_has_an_all_whose_names_resolve(module):
    m = importlib.import_module(module)
    names = m.__all__
    assert names and len(set(names)) == len(names)
    missing = [n for n in names if n != "RdmaConsumer" and not hasattr(m, n)]
    assert missing == []
    assert m.__doc__ and len(m.__doc__) > 80  # documented: what the module is for


def test_rollout_loader_uses_only_the_engine_api():
    """The vLLM integration is an engine integration like any other: ``deltasync``, ``deltasync.engine`` and
    ``deltasync.errors`` only, so deltasync's internals can move without breaking it."""
    allowed = {"deltasync", "deltasync.engine", "deltasync.errors"}
    assert [i for i in _imports("rollout_loader") if i[2] not in allowed] == []


@pytest.mark.parametrize("folder", ["rollout_loader", "deltasync_cli", "examples"])  # bench/ measures internals
def test_nothing_outside_the_package_imports_a_private_module(folder):
    private = [i for i in _imports(folder) if any(part.startswith("_") for part in i[2].split("."))]
    assert private == []


def test_examples_use_only_public_modules():
    """What a user copies from an example must be the public API."""
    assert [i for i in _imports("examples") if i[2] not in PUBLIC] == []


def test_the_library_and_its_testing_helpers_do_not_import_pytest():
    """pytest is a test dependency: only the store contract (imported by test code) needs it."""
    code = ("import sys, deltasync, deltasync.testing, deltasync.transports, deltasync.engine\n"
            "print('pytest' in sys.modules)")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120,
                          check=False)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines()[-1] == "False"
