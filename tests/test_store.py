"""The store contract on the backends that need no server (S3 runs it in tests/integration)."""

from tests.store_contract import TestFileUrlStore, TestFsspecStore, TestLocalStore, TestMemoryStore  # noqa: F401

import pytest

from deltasync.errors import StoreError
from deltasync.store import Store


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
