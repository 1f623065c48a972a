"""The store contract (deltasync.testing.store_contract) on the backends that need no server (S3 runs it in
tests/integration, a registered transport in test_custom_transport.py, an outside fsspec backend in
examples/store_contract_fsspec.py)."""

import uuid

import pytest

from deltasync.errors import StoreError
from deltasync.store import Store
from deltasync.testing.store_contract import StoreContract


class TestLocalStore(StoreContract):
    def make_url(self, tmp_path) -> str:
        return str(tmp_path / "stream")


class TestFileUrlStore(StoreContract):
    def make_url(self, tmp_path) -> str:
        return f"file://{tmp_path}/stream"


class TestMemoryStore(StoreContract):
    def make_url(self, tmp_path) -> str:
        return f"memory://deltasync-test-{uuid.uuid4().hex}"


class TestFsspecStore(StoreContract):
    """The generic fsspec transport (fsspec.py), on a local folder behind a protocol deltasync has no module for."""

    def make_url(self, tmp_path) -> str:
        from tests.remote_cli import register, remote_url

        register()
        return remote_url(tmp_path / "stream")


def test_unknown_protocol_names_the_url():
    with pytest.raises(StoreError, match="nosuch://x"):
        Store("nosuch://x")


def test_transient_errors_are_retried_then_reported(tmp_path):
    store = Store(str(tmp_path), retries=2, retry_base_s=0.001)
    calls = []

    def flaky():
        calls.append(1)
        if len(calls) < 3:
            raise ConnectionError("reset by peer")
        return "ok"

    assert store.call("flaky op", flaky) == "ok" and len(calls) == 3

    def down():
        raise TimeoutError("timed out")

    with pytest.raises(StoreError, match="down op failed after 3 attempts"):
        store.call("down op", down)


def test_remote_objects_download_into_a_new_cache_dir(tmp_path, small_state):
    import uuid

    from deltasync import DeltaPublisher, StreamReader

    url = f"memory://cache-{uuid.uuid4().hex}"
    with DeltaPublisher(url, small_state) as pub:
        pub.publish(0)
    reader = StreamReader(url, cache_dir=tmp_path / "not" / "yet")
    assert set(reader.state_dict(0)) == set(small_state)


def _within(seconds: float, fn):
    """``fn()``'s result or exception, or a failure if it blocks longer than ``seconds`` (a FIFO would block)."""
    import threading

    box: list = []
    t = threading.Thread(target=lambda: box.append(_outcome(fn)), daemon=True)
    t.start()
    t.join(seconds)
    assert box, f"blocked for over {seconds} s"
    kind, value = box[0]
    if kind == "raised":
        raise value
    return value


def _outcome(fn):
    try:
        return ("returned", fn())
    except BaseException as e:  # noqa: BLE001 - handed to the test's thread
        return ("raised", e)


def test_a_local_store_reads_only_regular_files(tmp_path, small_state):
    """(issue 19, item 9) A FIFO where a document belongs blocked every reader for ever; a folder raised a
    builtin error. Now: a hint that cannot be read is ignored, anything else is a FormatError naming the path."""
    import os

    from deltasync import DeltaPublisher, StreamReader, collect_garbage
    from deltasync.errors import FormatError
    from deltasync.store import step_dir
    from rollout_loader import Follower, StateDictTarget

    url = str(tmp_path / "s")
    with DeltaPublisher(url, small_state, on_backlog="block") as pub:
        pub.publish(0)
        pub.publish(1)
    os.unlink(tmp_path / "s" / "latest.json")
    os.mkfifo(tmp_path / "s" / "latest.json")
    store = Store(url)
    assert _within(10, store.latest_hint) is None
    follower = Follower(url, StateDictTarget())
    assert _within(30, follower.sync) == [0, 1]  # the manifests decide
    follower.close()
    os.makedirs(tmp_path / "s" / "consumers", exist_ok=True)
    os.mkfifo(tmp_path / "s" / "consumers" / "c1.json")
    plan = _within(10, lambda: collect_garbage(url, keep_last=1, dry_run=True))  # not respected, reported
    assert [f for f, _ in plan.unreadable] == ["consumers/c1.json"]
    assert "expected a regular file, found a FIFO" in plan.unreadable[0][1]
    assert StreamReader(url).steps() == [0, 1]
    manifest = tmp_path / "s" / step_dir(1) / "manifest.json"
    manifest.unlink()
    manifest.mkdir()
    with pytest.raises(FormatError, match="manifest.json: expected a regular file, found a folder"):
        _within(10, lambda: Store(url).manifest(1))


def test_the_newest_step_is_found_whatever_the_hint_says(tmp_path, small_state):
    """(issue 19, item 10) Gapped step numbers and a writer that died between step 20's manifest and the hint:
    the hint says 10 and no step 11 exists, yet the newest committed step is 20."""
    from deltasync import DeltaPublisher, StreamReader
    from deltasync.format.documents import LatestHint, encode

    url = str(tmp_path / "s")
    with DeltaPublisher(url, small_state, on_backlog="block") as pub:
        for step in (0, 10, 20):
            pub.publish(step)
    store = Store(url)
    store.write_bytes("latest.json", encode(LatestHint(step=10)))  # as the dead writer left it
    assert store.latest_hint().step == 10
    assert store.latest_step() == 20 and StreamReader(url).latest_step() == 20
