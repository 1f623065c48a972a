"""Any fsspec filesystem (GCS, Azure Blob, and every protocol deltasync has no module of its own for).

Create-only writes use fsspec's ``mode="create"``, which backends implement natively where they can
(GCS ``ifGenerationMatch=0``, Azure ``If-None-Match: *``); fsspec's own fallback, and the compare-and-swap
here, check first and write after. So neither is promised atomic (``capabilities``); subclasses that know
their backend (s3.py, memory.py) say more.
"""

from __future__ import annotations

import builtins
import threading
from pathlib import Path
from typing import Any

import fsspec
import fsspec.asyn
from fsspec.callbacks import Callback

from deltasync.transports.base import (
    Capabilities,
    Data,
    Entry,
    Transport,
    as_buffer,
    check_key,
    content_version,
    copy_bounded,
    too_large,
)

CALLBACK_DOWNLOADS = frozenset({"fsspec.implementations.http.HTTPFileSystem._get_file"})
"""The downloads (:func:`download_method`) read to call ``callback.set_size`` with the size the server announces
before reading the body, and ``callback.relative_update`` after each chunk written, and to close their response
when the callback raises; a bounded download through any other is copied through ``fs.open`` (an override may
ignore callbacks: sftp, ftp and arrow's do). Not s3fs's: it leaves the response open when ``set_size`` raises, and
aiohttp keeps such a connection out of its pool for good (s3.py downloads bounded objects itself)."""


class FsspecTransport(Transport):
    """Objects under ``root`` of the filesystem ``fs`` (``root`` in fsspec's own form, e.g. ``bucket/prefix``)."""

    capabilities = Capabilities(create_only=False, compare_and_swap=False)

    def __init__(self, fs: fsspec.AbstractFileSystem, root: str, *, lock: Any = None) -> None:
        self.fs = fs
        self.root = root.rstrip("/")
        # serialises this process's own check-then-write conditions; other processes are not excluded
        self._lock = lock if lock is not None else threading.Lock()

    def path(self, key: str) -> str:
        """The fsspec path of ``key``."""
        return f"{self.root}/{check_key(key)}" if key else self.root

    def put(self, key: str, data: Data, *, if_absent: bool = False, if_version: str | None = None) -> None:
        path = self.path(key)
        if isinstance(data, Path) and not (if_absent or if_version is not None):
            self.fs.put_file(str(data), path)  # multipart for large files, streamed from disk
            return
        # fsspec's pipe_file takes bytes (s3fs refuses a memoryview): a buffer is copied once, bytes are not
        body = data.read_bytes() if isinstance(data, Path) else bytes(as_buffer(data))
        with self._lock:
            if if_absent:
                self.fs.pipe_file(path, body, mode="create")
                return
            if if_version is not None:
                try:
                    current = content_version(self.fs.cat_file(path))
                except FileNotFoundError:
                    current = None
                if current != if_version:
                    raise FileExistsError(f"{path} changed since it was read")
            self.fs.pipe_file(path, body)

    def get(self, key: str, *, start: int = 0, end: int | None = None) -> bytes:
        if start == 0 and end is None:
            return self.fs.cat_file(self.path(key))
        return self.fs.cat_file(self.path(key), start=start, end=end)

    def get_file(self, key: str, local: Path, *, max_bytes: int | None = None) -> None:
        """The object into ``local`` (``Transport.get_file``). A filesystem whose own download is known to report
        sizes to fsspec's callbacks (HTTP: :data:`CALLBACK_DOWNLOADS`) downloads as it always does, bounded by a
        callback that refuses the object from the announced size (the response's Content-Length), before any body
        is read; without one announced, after one chunk past the bound (HTTP: 5 MiB). Any other is copied here
        through ``fs.open``, which is what fsspec's generic ``get_file`` does (the same requests), bounded exactly
        (a filesystem that overrides ``get_file`` may have done it in fewer requests)."""
        path = self.path(key)
        if max_bytes is None:
            self.fs.get_file(path, str(local))
        elif download_method(self.fs) in CALLBACK_DOWNLOADS:
            self.fs.get_file(path, str(local), callback=_Bound(key, max_bytes))
        else:
            with self.fs.open(path, "rb") as src, open(local, "wb") as dst:
                copy_bounded(src, dst, key, max_bytes=max_bytes, size=getattr(src, "size", None),
                             chunk_bytes=max(self.fs.blocksize, 1 << 20))

    def list(self, prefix: str = "") -> list[Entry]:
        self.fs.invalidate_cache()  # other processes write this location
        try:
            found = self.fs.find(self.path(prefix.rstrip("/")), detail=True)
        except FileNotFoundError:
            return []
        under = self.root + "/"  # s3fs lists a prefix whose objects were all deleted as a folder named like it
        return [
            Entry(p[len(under) :], int(info.get("size") or 0), listed_mtime(info))
            for p, info in found.items()
            if p.startswith(under) and info.get("type") != "directory"
        ]

    def exists(self, key: str) -> bool:
        self.fs.invalidate_cache()
        return self.fs.exists(self.path(key))

    def children(self, prefix: str = "") -> builtins.list[str]:
        self.fs.invalidate_cache()
        found = self.fs.ls(self.path(prefix.rstrip("/")), detail=False)
        return sorted(p.rstrip("/").rsplit("/", 1)[-1] for p in found)

    def delete(self, key: str) -> None:
        try:
            self.fs.rm(self.path(key))
        except FileNotFoundError:
            pass

    def delete_tree(self, prefix: str) -> None:
        try:
            self.fs.rm(self.path(prefix.rstrip("/")), recursive=True)
        except FileNotFoundError:
            pass


def download_method(fs: fsspec.AbstractFileSystem) -> str:
    """``module.Class.method`` of the code ``fs.get_file`` runs: the class's ``get_file``, or the ``_get_file``
    coroutine that fsspec wraps into it for an async filesystem that does not override ``get_file``."""
    cls = type(fs)
    method: Any = cls.get_file
    if method is fsspec.AbstractFileSystem.get_file and isinstance(fs, fsspec.asyn.AsyncFileSystem):
        method = cls._get_file
    return f"{method.__module__}.{method.__qualname__}"


class _Bound(Callback):
    """An fsspec callback that refuses a download past ``max_bytes`` (``too_large``): from the size announced
    (``set_size``), else from the bytes written so far (``relative_update``)."""

    def __init__(self, key: str, max_bytes: int) -> None:
        super().__init__()
        self.key, self.max_bytes = key, max_bytes

    def call(self, hook_name: str | None = None, **kwargs: Any) -> None:
        if self.size is not None and self.size > self.max_bytes:
            raise too_large(self.key, self.max_bytes, int(self.size))
        if self.value > self.max_bytes:
            raise too_large(self.key, self.max_bytes, int(self.value))


def listed_mtime(info: dict[str, Any]) -> float | None:
    """When a listed file was last written (unix seconds), from whatever the backend reports; None if nothing."""
    t = info.get("mtime") or info.get("LastModified") or info.get("last_modified") or info.get("created")
    if t is not None and hasattr(t, "timestamp"):  # a datetime
        t = t.timestamp()
    return float(t) if isinstance(t, (int, float)) else None


def open_fsspec(url: str, storage_options: dict[str, Any]) -> FsspecTransport:
    """Any URL fsspec knows; storage options go to the filesystem."""
    fs, root = fsspec.core.url_to_fs(url, **storage_options)
    return FsspecTransport(fs, root)
