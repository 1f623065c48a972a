"""Proving a new storage backend with deltasync's store contract, as its author would.

The backend here is a stand-in for your object store: a small fsspec filesystem written from scratch (whole
objects in a dict, no folders, like a bucket) under a protocol deltasync knows nothing about, ``kvstore://``.
Registered with fsspec, it is reached through deltasync's generic fsspec transport; a ``Transport`` of your own
registered with ``deltasync.transports.register_transport`` is tested the same way.

The test is one class: subclass ``StoreContract`` (shipped in the package, ``deltasync.testing.store_contract``)
and say where a new, empty stream lives; pytest then runs every contract test against the backend. This script
runs pytest on itself; in your project the class sits in a test module that your own pytest run collects::

    python examples/store_contract_fsspec.py            # or: pytest examples/store_contract_fsspec.py

The last line says whether the backend passed. Needs pytest (the library itself does not).
"""

from __future__ import annotations

import io
import sys
import threading
import time
import uuid
from typing import Any

import fsspec
import pytest
from fsspec.spec import AbstractFileSystem

from deltasync.testing.store_contract import StoreContract


class KeyValueFileSystem(AbstractFileSystem):
    """Whole objects by key, as an object store keeps them; "folders" are only the keys' common prefixes.

    An fsspec backend implements a few primitives and inherits the rest (``find``, ``exists``, ``rm``,
    ``get_file``, ``put_file`` are fsspec's own, written on top of these)."""

    protocol = "kvstore"
    root_marker = ""
    objects: dict[str, tuple[bytes, float]] = {}  # path -> (bytes, written at): one "server" per process
    lock = threading.Lock()

    def ls(self, path: str, detail: bool = True, **kwargs: Any) -> list[Any]:
        path = self._strip_protocol(path).rstrip("/")
        if path in self.objects:
            entries = [self._entry(path)]
        else:
            under = f"{path}/" if path else ""
            names = {under + key[len(under):].split("/", 1)[0] for key in list(self.objects) if key.startswith(under)}
            if not names:
                raise FileNotFoundError(path)
            entries = [self._entry(n) if n in self.objects else {"name": n, "size": 0, "type": "directory"}
                       for n in sorted(names)]
        return entries if detail else [e["name"] for e in entries]

    def _entry(self, path: str) -> dict[str, Any]:
        data, written = self.objects[path]
        return {"name": path, "size": len(data), "type": "file", "mtime": written}

    def cat_file(self, path: str, start: int | None = None, end: int | None = None, **kwargs: Any) -> bytes:
        path = self._strip_protocol(path)
        if path not in self.objects:
            raise FileNotFoundError(path)
        return self.objects[path][0][start:end]

    def pipe_file(self, path: str, value: bytes, mode: str = "overwrite", **kwargs: Any) -> None:
        path = self._strip_protocol(path)
        with self.lock:  # mode="create" is a create-only write: atomic in this store
            if mode == "create" and path in self.objects:
                raise FileExistsError(path)
            self.objects[path] = (bytes(value), time.time())

    def _open(self, path: str, mode: str = "rb", **kwargs: Any) -> io.BytesIO:
        if "r" in mode:
            return io.BytesIO(self.cat_file(path))
        return _Upload(self, path)

    def rm_file(self, path: str) -> None:
        self.objects.pop(self._strip_protocol(path), None)  # (fsspec's rm also passes "folders": nothing to do)


class _Upload(io.BytesIO):
    """A file opened for writing: its bytes become the object when it is closed, as an upload would."""

    def __init__(self, fs: KeyValueFileSystem, path: str) -> None:
        super().__init__()
        self.fs, self.path = fs, path

    def close(self) -> None:
        if not self.closed:
            self.fs.pipe_file(self.path, self.getvalue())
        super().close()


fsspec.register_implementation("kvstore", KeyValueFileSystem, clobber=True)


class TestKeyValueStore(StoreContract):
    """Every store contract test against ``kvstore://``."""

    storage_options: dict = {}  # what Store(url, storage_options=...) gets for this backend: none here

    def make_url(self, tmp_path) -> str:
        return f"kvstore://test-bucket/{uuid.uuid4().hex}"  # a new, empty stream for each test


if __name__ == "__main__":
    code = pytest.main([__file__, "-q", "-p", "no:cacheprovider", *sys.argv[1:]])
    print(f"store contract on kvstore://: {'passed' if code == 0 else 'FAILED'}")
    sys.exit(int(code))
