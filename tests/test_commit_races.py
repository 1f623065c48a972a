"""The commit races of issue 8, made deterministic: a committed step is never replaced.

(2) A writer whose lease ran out during a long upload (another writer took the stream over and committed
the same step) must not commit: the lease is checked right before the manifest is written, and a manifest
is written create-only. (3) A publisher restarted after a crash between a manifest and its ``latest.json``
hint must resume after the newest committed manifest, not after the hint.

The races are forced, not waited for: an upload is held on an ``Event`` (the stand-in for a long upload)
while the second writer acts. What the store holds is read back with fsspec directly, not through
deltasync, so that the check does not depend on the code under test.
"""

from __future__ import annotations

import json
import shutil
import threading
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Literal

import fsspec
import pytest
import torch

from deltasync import DeltaPublisher, StreamReader, verify
from deltasync.errors import PublishError, StepExistsError, StepOrderError, WriterConflictError
from deltasync.store import Manifest, Store, step_dir
from tests.conftest import perturb, states_equal
from tests.crash import hook_transport, is_object_path


def _state(step: int, writer: str = "a") -> dict[str, torch.Tensor]:
    """The weights writer ``writer`` publishes as ``step`` (two writers publish different weights)."""
    g = torch.Generator().manual_seed(0)
    base = {"w": torch.randn(64, 96, generator=g).bfloat16(), "b": torch.randn(128, generator=g).bfloat16()}
    g.manual_seed({"a": 1000, "b": 5000}[writer] + step)
    return {k: perturb(v, 0.05, g) for k, v in base.items()}


@dataclass
class Backend:
    """One stream on one store backend, and plain fsspec access to its bytes (independent of deltasync)."""

    url: str
    tmp: Path
    storage_options: dict[str, Any] = field(default_factory=dict)

    def store(self) -> Store:
        return Store(
            self.url,
            storage_options=self.storage_options,
            cache_dir=self.tmp / f"cache-{uuid.uuid4().hex[:6]}",
            retries=1,
            retry_base_s=0.01,
        )

    def reader(self) -> StreamReader:
        return StreamReader(self.store())

    @property
    def _fs(self) -> tuple[fsspec.AbstractFileSystem, str]:
        fs, root = fsspec.core.url_to_fs(self.url, **self.storage_options)
        fs.invalidate_cache()
        return fs, root.rstrip("/")

    def files(self, step: int) -> dict[str, bytes]:
        """Every file in the step's folder, by name, with its bytes."""
        fs, root = self._fs
        folder = f"{root}/{step_dir(step)}"
        if not fs.exists(folder):
            return {}
        return {p[len(folder) + 1 :]: fs.cat_file(p) for p in fs.find(folder)}

    def write(self, rel: str, data: bytes) -> None:
        fs, root = self._fs
        fs.pipe_file(f"{root}/{rel}", data)

    def spool(self) -> Path:
        path = self.tmp / f"spool-{uuid.uuid4().hex[:6]}"
        path.mkdir()
        return path


@pytest.fixture(params=["local", "memory"])
def backend(request, tmp_path) -> Iterator[Backend]:
    """The stream the races run on (tests/integration/test_crash_s3.py runs them on S3 too)."""
    if request.param == "local":
        yield Backend(str(tmp_path / "stream"), tmp_path)
        return
    url = f"memory://races-{uuid.uuid4().hex}"
    yield Backend(url, tmp_path)
    fs, root = fsspec.core.url_to_fs(url)
    if fs.exists(root):
        fs.rm(root, recursive=True)


def _publish(backend: Backend, steps: list[int], *, writer: str = "a", **kw) -> None:
    with DeltaPublisher(backend.store(), _state(steps[0], writer), on_backlog="block", spool_dir=backend.spool(),
                        **kw) as pub:
        for s in steps:
            pub.source = _state(s, writer)
            pub.publish(s)


def _object_of(backend: Backend, step: int, writer: str, tmp: Path) -> tuple[Manifest, Path]:
    """A valid manifest and object for ``step`` with ``writer``'s weights, made in a scratch stream."""
    scratch = Backend(str(tmp / f"scratch-{uuid.uuid4().hex[:6]}"), tmp)
    _publish(scratch, [step], writer=writer)
    manifest = scratch.store().manifest(step)
    local = tmp / f"upload-{uuid.uuid4().hex[:6]}"
    shutil.copyfile(Path(scratch.url) / step_dir(step) / manifest.object, local)
    return manifest, local


class HeldUpload:
    """Holds the upload of a step's object until ``release`` is set (any transport method, any name).

    ``when="before"`` holds it before any byte lands under the object's name (a slow network), ``"after"``
    once the object is in place and before the commit goes on (a writer stalled before its manifest).
    """

    def __init__(self, store: Store, step: int, when: Literal["before", "after"]) -> None:
        self.step = step
        self.reached = threading.Event()
        self.release = threading.Event()
        hook_transport(store.transport, **{when: self._hold})

    def _hold(self, path: str) -> None:
        if is_object_path(path, self.step) and not self.reached.is_set():
            self.reached.set()
            if not self.release.wait(60):
                raise TimeoutError("the held upload was never released")


# --- Store.commit: create-only, fenced by the lease ---


def test_commit_never_replaces_a_committed_step(backend, tmp_path):
    _publish(backend, [0, 1])
    before = backend.files(1)
    store = backend.store()
    store.acquire_lease("trainer-b", ttl_s=60, take_over=True)
    manifest, local = _object_of(backend, 1, "b", tmp_path)  # an anchor over a delta
    with pytest.raises(StepExistsError):
        store.commit(manifest, local, owner="trainer-b")
    after = backend.files(1)
    for name, data in before.items():  # extra uncommitted files are tolerated; the step's own are not touched
        assert after.get(name) == data, f"{name} of committed step 1 was replaced"
    assert states_equal(backend.reader().state_dict(1), _state(1))


def test_commit_never_replaces_a_committed_object_of_the_same_name(backend, tmp_path):
    """The intruder's object has the committed object's very name (a retried or duplicated commit)."""
    _publish(backend, [0])
    before = backend.files(0)
    store = backend.store()
    committed = store.manifest(0)
    store.acquire_lease("trainer-b", ttl_s=60, take_over=True)
    manifest, local = _object_of(backend, 0, "b", tmp_path)
    manifest = replace(manifest, object=committed.object)
    with pytest.raises(StepExistsError):
        store.commit(manifest, local, owner="trainer-b")
    assert {n: backend.files(0).get(n) for n in before} == before
    report = verify(backend.reader())
    assert report.ok and report.verified == (0,), report.problems
    assert states_equal(backend.reader().state_dict(0), _state(0))


def test_commit_by_a_writer_that_lost_the_lease_writes_no_manifest(backend, tmp_path):
    _publish(backend, [0])
    store_a = backend.store()
    store_a.acquire_lease("trainer-a", ttl_s=60)
    backend.store().acquire_lease("trainer-b", ttl_s=60, take_over=True)
    manifest, local = _object_of(backend, 1, "a", tmp_path)
    with pytest.raises(WriterConflictError, match="trainer-b"):
        store_a.commit(manifest, local, owner="trainer-a")
    assert "manifest.json" not in backend.files(1)
    assert backend.store().steps() == [0]


@pytest.mark.parametrize("when", ["before", "after"])
def test_lease_is_checked_right_before_the_manifest(backend, tmp_path, when):
    """Writer A's lease is good when its upload starts; B takes the stream over while it runs."""
    _publish(backend, [0])
    store_a = backend.store()
    store_a.acquire_lease("trainer-a", ttl_s=60, take_over=True)
    held = HeldUpload(store_a, 1, when)
    manifest, local = _object_of(backend, 1, "a", tmp_path)
    with ThreadPoolExecutor(1) as pool:
        commit = pool.submit(store_a.commit, manifest, local, owner="trainer-a")
        try:
            while not held.reached.wait(0.05):
                assert not commit.done(), f"the commit ended before its upload: {commit.exception()!r}"
            backend.store().acquire_lease("trainer-b", ttl_s=60, take_over=True)
        finally:
            held.release.set()
        with pytest.raises(WriterConflictError):
            commit.result(timeout=60)
    assert "manifest.json" not in backend.files(1)
    assert backend.store().steps() == [0]


# --- (2) through the publisher: the expired writer and its successor ---


@pytest.mark.parametrize("kind", ["anchor", "delta"])
@pytest.mark.parametrize("when", ["before", "after"])
def test_writer_that_lost_its_lease_during_an_upload_cannot_replace_the_step(backend, when, kind):
    """A is uploading step 3 when B takes the stream over (A's lease ran out) and commits its own step 3.

    A's upload then finishes: it must commit nothing, and B's step 3 (an anchor, B's first step) must stay
    exactly as B wrote it, object included. ``kind`` is what A's step 3 is: an anchor too (an object of the
    same kind, once of the same name) or a delta.
    """
    store_a = backend.store()
    held = HeldUpload(store_a, 3, when)
    a = DeltaPublisher(store_a, _state(0), writer_id="trainer-a", on_backlog="block", anchor_every=100,
                       spool_dir=backend.spool())
    b = None
    try:
        for s in range(3):
            a.source = _state(s)
            a.publish(s)
        a.flush()
        a.source = _state(3)
        a.publish(3, anchor=kind == "anchor")
        assert held.reached.wait(30), "A's upload of step 3 never started"

        b = DeltaPublisher(backend.store(), _state(3, "b"), writer_id="trainer-b", take_over=True, on_backlog="block",
                           spool_dir=backend.spool())
        assert b.last_committed_step == 2
        b.source = _state(3, "b")
        b.publish(3)
        b.flush()
        committed = backend.files(3)
        assert json.loads(committed["manifest.json"])["kind"] == "anchor"
    finally:
        held.release.set()
    try:
        a.flush()
        refused = None
    except PublishError as e:
        refused = e.__cause__
    after = backend.files(3)
    for name, data in committed.items():
        assert after.get(name) == data, f"{name} of step 3, committed by B, was replaced by A"
    assert isinstance(refused, (WriterConflictError, StepExistsError)), f"A's late commit was not refused: {refused!r}"
    a.source = _state(4)
    a.publish(4)  # a writer that lost the stream commits nothing more
    with pytest.raises(PublishError):
        a.flush()
    a.close()

    b.source = _state(4, "b")
    b.publish(4)
    b.close()
    reader = backend.reader()
    assert reader.steps() == [0, 1, 2, 3, 4]
    for s in range(3):
        assert states_equal(reader.state_dict(s), _state(s))
    for s in (3, 4):
        assert states_equal(reader.state_dict(s), _state(s, "b")), s
    report = verify(reader)
    assert report.ok and report.verified == (0, 1, 2, 3, 4), report.problems


# --- (3) a stale latest.json hint ---


@pytest.mark.parametrize("hint", [{"step": 10}, {"step": 0}])
def test_restart_after_a_stale_hint_resumes_after_the_newest_manifest(backend, hint):
    """The writer died between step 20's manifest and its hint, so ``latest.json`` names an older step
    (step numbers with gaps, as a trainer that publishes every 10 steps makes). Restarted from its step-10
    checkpoint, the trainer reaches step 20 again: the publisher must refuse it, not publish it over the
    committed one."""
    _publish(backend, [0, 10, 20])
    committed = backend.files(20)
    backend.write("latest.json", json.dumps(hint).encode())
    backend.store().acquire_lease("killed-trainer", ttl_s=600, take_over=True)  # its lease outlives it

    with DeltaPublisher(backend.store(), _state(10), take_over=True, on_backlog="block",
                        spool_dir=backend.spool()) as pub:
        assert pub.last_committed_step == 20
        pub.source = _state(20)
        with pytest.raises(StepOrderError, match="20"):
            pub.publish(20)
        pub.source = _state(30)
        pub.publish(30)

    assert backend.files(20) == committed
    reader = backend.reader()
    assert reader.steps() == [0, 10, 20, 30]
    for s in reader.steps():
        assert states_equal(reader.state_dict(s), _state(s)), s
    report = verify(reader)
    assert report.ok and report.verified == (0, 10, 20, 30), report.problems
