"""The store contract on the backends that need no server (S3 runs it in tests/integration)."""

from tests.store_contract import TestFileUrlStore, TestLocalStore, TestMemoryStore  # noqa: F401

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
