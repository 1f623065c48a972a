"""A new backend is one small module: a dict-backed transport in about 30 lines passes the whole store
contract, registered once with ``register_transport`` and once through a package's entry point."""

from __future__ import annotations

import shutil
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path

import pytest

from deltasync.testing.store_contract import StoreContract
from deltasync.transports import (
    Capabilities,
    Entry,
    Transport,
    register_transport,
    reload_entry_points,
    unregister_transport,
)
from deltasync.transports.base import Data, check_key, read_data

_STORES: dict[str, dict[str, tuple[bytes, int, float]]] = {}  # name -> key -> (bytes, version, written at)
_LOCK = threading.Lock()


class DictTransport(Transport):
    """Objects in a dict of this process; one lock makes create-only and compare-and-swap atomic."""

    capabilities = Capabilities(create_only=True, compare_and_swap=True)

    def __init__(self, name: str) -> None:
        self.root, self.objects = name, _STORES.setdefault(name, {})

    def put(self, key: str, data: Data, *, if_absent: bool = False, if_version: str | None = None) -> None:
        body = bytes(read_data(data))
        with _LOCK:
            old = self.objects.get(check_key(key))
            if (if_absent and old) or (if_version is not None and (not old or str(old[1]) != if_version)):
                raise FileExistsError(key)
            self.objects[key] = (body, old[1] + 1 if old else 0, time.time())

    def get(self, key: str, *, start: int = 0, end: int | None = None) -> bytes:
        return self.get_versioned(key)[0][start:end]

    def get_versioned(self, key: str) -> tuple[bytes, str]:
        if key not in self.objects:
            raise FileNotFoundError(key)
        data, version, _ = self.objects[key]
        return data, str(version)

    def list(self, prefix: str = "") -> list[Entry]:
        folder = prefix.rstrip("/") + "/" if prefix else ""
        return [Entry(k, len(v[0]), v[2]) for k, v in list(self.objects.items()) if k.startswith(folder)]

    def delete(self, key: str) -> None:
        self.objects.pop(key, None)


def open_dict(url: str, storage_options: dict) -> DictTransport:
    return DictTransport(url.split("://", 1)[1])


class TestRegisteredTransport(StoreContract):
    @pytest.fixture(autouse=True)
    def _registered(self):
        register_transport("dict", open_dict)
        yield
        unregister_transport("dict")

    def make_url(self, tmp_path) -> str:
        return f"dict://stream-{uuid.uuid4().hex}"


class TestEntryPointTransport(StoreContract):
    """As a package would ship it: ``[project.entry-points."deltasync.transports"] dictep = "...:open_dict"``."""

    @pytest.fixture(autouse=True)
    def _installed(self):
        site = Path(tempfile.mkdtemp(prefix="fake-site-"))
        info = site / "deltasync_dict_transport-1.0.dist-info"
        info.mkdir()
        (info / "METADATA").write_text("Metadata-Version: 2.1\nName: deltasync-dict-transport\nVersion: 1.0\n")
        (info / "entry_points.txt").write_text("[deltasync.transports]\ndictep = "
                                               "tests.test_custom_transport:open_dict\n")
        sys.path.insert(0, str(site))
        reload_entry_points()  # entry points are read once, on the first unknown scheme: read them again
        yield
        sys.path.remove(str(site))
        unregister_transport("dictep")
        reload_entry_points()
        shutil.rmtree(site)

    def make_url(self, tmp_path) -> str:
        return f"dictep://stream-{uuid.uuid4().hex}"

    def test_the_entry_point_made_the_transport(self, url):
        assert type(self.store(url).transport) is DictTransport


def test_an_unregistered_scheme_is_refused_again():
    from deltasync.errors import StoreConfigError
    from deltasync.store import Store

    with pytest.raises(StoreConfigError, match="no transport for scheme 'dictep'"):
        Store(f"dictep://stream-{uuid.uuid4().hex}")
