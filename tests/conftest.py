"""Shared fixtures: small random models and streams; and the check that no test leaves temporary folders."""

from __future__ import annotations

import gc
import os
import shutil
import tempfile
from pathlib import Path

import numpy as np
import pytest
import torch

LEAK_PREFIX = "deltasync-"  # every temporary folder the library makes (caches, spools, pushes, demos)
_TMP_KEY = pytest.StashKey[tuple]()
_REAL_TMP_ENV = "DELTASYNC_TEST_REAL_TMPDIR"
_GROUPS_ENV = "DELTASYNC_TEST_ENGINE_GROUPS"


def pytest_configure(config: pytest.Config) -> None:
    """Run the session in a private temporary folder (``TMPDIR``, inherited by subprocesses).

    Other engineers' test runs share /tmp: a private folder lets the leak checks below see this session's
    folders only. pytest's own ``tmp_path`` folders stay where pytest keeps them (the real temp folder).
    """
    # pytest-xdist workers inherit the controller's TMPDIR: their folders go beside its folder, not inside,
    # since vLLM puts IPC socket paths (107 bytes at most) under TMPDIR
    real = os.environ.get(_REAL_TMP_ENV) or tempfile.gettempdir()
    root = tempfile.mkdtemp(prefix="dstest-", dir=real)
    config.stash[_TMP_KEY] = (root, os.environ.get("TMPDIR"), os.environ.get("PYTEST_DEBUG_TEMPROOT"),
                              os.environ.get(_REAL_TMP_ENV))
    os.environ.setdefault("PYTEST_DEBUG_TEMPROOT", real)
    os.environ[_REAL_TMP_ENV] = real
    os.environ["TMPDIR"] = root
    tempfile.tempdir = None  # gettempdir() reads TMPDIR again
    if not os.environ.get("PYTEST_XDIST_WORKER"):  # the controller: where workers name their engine tests
        os.environ[_GROUPS_ENV] = os.path.join(root, "engine-tests")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Under pytest-xdist with ``--dist loadgroup`` (``./run.sh test`` runs two workers), the tests that start
    a vLLM engine run one after another on one worker, while the other worker takes the rest: an engine uses
    every core, and two at once would only slow each other down.

    xdist's own ``xdist_group`` cannot do it with pytest 9.2 (it renames each grouped test by an attribute
    pytest no longer reads, so every test stayed a group of its own and engines ran two at a time): each
    worker writes the ids of its engine tests to a file, and the controller's scheduler
    (:func:`pytest_xdist_make_scheduler`) puts them in one group."""
    engines = [item.nodeid for item in items if item.get_closest_marker("vllm")]
    path, worker = os.environ.get(_GROUPS_ENV), os.environ.get("PYTEST_XDIST_WORKER")
    if path and worker:
        Path(f"{path}.{worker}").write_text("\n".join(engines))


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: object) -> object:
    """``--dist loadgroup`` with the workers' engine tests as one group (see above); other tests load-balanced."""
    if config.getvalue("dist") != "loadgroup" or not os.environ.get(_GROUPS_ENV):
        return None
    from xdist.scheduler import LoadGroupScheduling

    base = Path(os.environ[_GROUPS_ENV])

    class EngineTestsTogether(LoadGroupScheduling):
        _engines: set[str] | None = None

        def _split_scope(self, nodeid: str) -> str:
            if self._engines is None:  # first called once every worker sent its collection: the files are there
                self._engines = set()
                for f in base.parent.glob(base.name + ".*"):
                    self._engines |= set(f.read_text().splitlines())
            return "vllm" if nodeid in self._engines else super()._split_scope(nodeid)

    return EngineTestsTogether(config, log)


def pytest_unconfigure(config: pytest.Config) -> None:
    root, tmpdir, temproot, real = config.stash.get(_TMP_KEY, (None, None, None, None))
    if root is None:
        return
    for key, value in (("TMPDIR", tmpdir), ("PYTEST_DEBUG_TEMPROOT", temproot), (_REAL_TMP_ENV, real)):
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value
    tempfile.tempdir = None
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        os.environ.pop(_GROUPS_ENV, None)  # set by this session's controller (pytest_configure)
    shutil.rmtree(root, ignore_errors=True)


def leftovers() -> set[str]:
    """The library's temporary folders now in the (private) temp folder."""
    return {p.name for p in Path(tempfile.gettempdir()).iterdir() if p.name.startswith(LEAK_PREFIX)}


def _leaked(before: set[str]) -> list[str]:
    new = leftovers() - before
    if new:  # objects in a reference cycle are cleaned when collected: give them that chance first
        gc.collect()
        new = leftovers() - before
    return sorted(new)


@pytest.fixture(autouse=True, scope="session")
def _session_leaves_no_temp_folders():
    """The whole session (session fixtures included) leaves nothing behind."""
    before = leftovers()
    yield
    leaked = _leaked(before)
    if leaked:
        pytest.fail(f"the test session left temporary folders behind: {leaked}")


@pytest.fixture(autouse=True)
def _test_leaves_no_temp_folders(request):
    """Each test closes what it opens: a publisher's spool, a reader's or follower's download cache."""
    before = leftovers()
    yield
    leaked = _leaked(before)
    if leaked:
        for name in leaked:  # the next tests start clean; this one fails
            shutil.rmtree(Path(tempfile.gettempdir()) / name, ignore_errors=True)
        pytest.fail(f"{request.node.nodeid} left temporary folders behind: {leaked}")


def perturb(t: torch.Tensor, density: float, gen: torch.Generator, *, finite: bool = True) -> torch.Tensor:
    """A copy of ``t`` with about ``density`` of its elements given new random bits, finite ones unless ``finite`` is
    False (the shipped contract's; imported here when called: this module must not import deltasync before it has
    pointed the temp folder elsewhere)."""
    from deltasync.testing.store_contract import perturb as contract_perturb

    return contract_perturb(t, density, gen, finite=finite)


def bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    return bool(np.array_equal(a.reshape(-1).view(torch.uint8).numpy(), b.reshape(-1).view(torch.uint8).numpy()))


def states_equal(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(bits_equal(a[k], b[k]) for k in a)


@pytest.fixture
def gen() -> torch.Generator:
    return torch.Generator().manual_seed(1234)


@pytest.fixture
def small_state(gen) -> dict[str, torch.Tensor]:
    from deltasync.testing.store_contract import every_shape  # (imported late: see perturb)

    return every_shape(gen)


@pytest.fixture(scope="session")
def qwen_stream(tmp_path_factory):
    """A tied Qwen3 model trained 10 steps with AdamW, published as bf16 with its model files (anchors at
    0, 4, 8). Read-only: copy ``qwen_stream.url`` before damaging it."""
    from tests.streams import make_qwen_stream

    return make_qwen_stream(tmp_path_factory.mktemp("qwen"))


@pytest.fixture
def stream_copy(qwen_stream, tmp_path):
    """A copy of ``qwen_stream`` (at ``tmp_path / "stream"``) to damage or collect; returns its URL."""
    import shutil

    url = str(tmp_path / "stream")
    shutil.copytree(qwen_stream.url, url)
    return url
