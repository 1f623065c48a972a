"""How objects move between this machine and a store: the one stage that differs per backend.

``Store`` (store.py) owns the layout and the commit protocol and calls three primitives here. Backends:
``LocalTransport`` (atomic rename), ``FsspecTransport`` (any fsspec filesystem: S3, GCS, Azure, memory),
``HfBucketTransport`` (Hugging Face Storage Buckets through huggingface_hub's batched bucket API).
"""

from __future__ import annotations

import os
import shutil
import uuid
from pathlib import Path
from typing import Any, Protocol

import fsspec

from .errors import StoreError


class Transport(Protocol):
    """Whole-object transfers; each object becomes visible complete or not at all."""

    def move_in(self, local: Path, path: str) -> None:
        """Publish the local file at ``path`` (the local file may be consumed)."""

    def put_bytes(self, items: list[tuple[bytes, str]]) -> None:
        """Write small objects, in order."""

    def get_file(self, path: str, local: Path) -> None:
        """Download ``path`` to ``local``; ``FileNotFoundError`` if it does not exist."""


class LocalTransport:
    """A folder on this machine: temporary name, fsync, atomic rename."""

    def __init__(self, fs: fsspec.AbstractFileSystem) -> None:
        self.fs = fs

    def move_in(self, local: Path, path: str) -> None:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(local, "rb+") as f:
            os.fsync(f.fileno())
        try:
            os.replace(local, path)
        except OSError:  # another filesystem: copy under a temporary name, then rename
            tmp = f"{path}.tmp-{uuid.uuid4().hex}"
            shutil.copyfile(local, tmp)
            os.replace(tmp, path)

    def put_bytes(self, items: list[tuple[bytes, str]]) -> None:
        for data, path in items:
            os.makedirs(os.path.dirname(path), exist_ok=True)
            tmp = f"{path}.tmp-{uuid.uuid4().hex}"
            with open(tmp, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)

    def get_file(self, path: str, local: Path) -> None:
        shutil.copyfile(path, local)


class FsspecTransport:
    """Any fsspec filesystem whose single-object PUT is atomic (S3, GCS, Azure Blob, memory)."""

    def __init__(self, fs: fsspec.AbstractFileSystem) -> None:
        self.fs = fs

    def move_in(self, local: Path, path: str) -> None:
        self.fs.put_file(str(local), path)  # multipart for large files, streamed from disk

    def put_bytes(self, items: list[tuple[bytes, str]]) -> None:
        for data, path in items:
            self.fs.pipe_file(path, data)

    def get_file(self, path: str, local: Path) -> None:
        self.fs.get_file(path, str(local))


class HfBucketTransport:
    """Hugging Face Storage Buckets: batched uploads from files, downloads that fail on a missing file.

    ``download_bucket_files`` only warns about missing files unless told otherwise; here a missing file is
    always an error, so a step can never be half-downloaded silently.
    """

    def __init__(self, fs: fsspec.AbstractFileSystem, root: str, storage_options: dict[str, Any]) -> None:
        from huggingface_hub import HfApi

        parts = root.split("/")
        if len(parts) < 3 or parts[0] != "buckets":
            raise StoreError(f"hf://{root}: a bucket URL looks like hf://buckets/<namespace>/<name>[/path]")
        self.fs = fs
        self.bucket_id = f"{parts[1]}/{parts[2]}"
        self._prefix = f"buckets/{self.bucket_id}/"
        self.api = HfApi(token=storage_options.get("token"), endpoint=storage_options.get("endpoint"))

    def _key(self, path: str) -> str:
        if not path.startswith(self._prefix):
            raise StoreError(f"{path} is outside bucket {self.bucket_id}")
        return path[len(self._prefix) :]

    def move_in(self, local: Path, path: str) -> None:
        self.api.batch_bucket_files(self.bucket_id, add=[(str(local), self._key(path))])
        self._invalidate()

    def put_bytes(self, items: list[tuple[bytes, str]]) -> None:
        # one batch per object keeps the order (a batch is not transactional, so order is our commit)
        for data, path in items:
            self.api.batch_bucket_files(self.bucket_id, add=[(data, self._key(path))])
        self._invalidate()

    def get_file(self, path: str, local: Path) -> None:
        from huggingface_hub.errors import EntryNotFoundError

        try:
            self.api.download_bucket_files(self.bucket_id, [(self._key(path), str(local))], raise_on_missing_files=True)
        except EntryNotFoundError as e:
            raise FileNotFoundError(path) from e

    def _invalidate(self) -> None:
        # HfFileSystem caches listings; our own writes must be visible to our next listing
        self.fs.invalidate_cache()


def transient_errors() -> tuple[type[BaseException], ...]:
    """Exception types worth retrying: the builtins, plus the HTTP clients' own (botocore's connection
    errors, for one, are not ``OSError``s). Clients that are not installed are skipped."""
    errors: list[type[BaseException]] = [OSError, TimeoutError, ConnectionError]
    for module, names in (
        ("botocore.exceptions", ("ConnectionError", "HTTPClientError")),
        ("aiohttp", ("ClientError",)),
        ("httpx", ("TransportError",)),
    ):
        try:
            mod = __import__(module, fromlist=list(names))
        except ImportError:
            continue
        errors += [getattr(mod, n) for n in names if hasattr(mod, n)]
    return tuple(errors)


def transport_for(fs: fsspec.AbstractFileSystem, root: str, storage_options: dict[str, Any]) -> Transport:
    protocols = (fs.protocol,) if isinstance(fs.protocol, str) else tuple(fs.protocol)
    if "file" in protocols or "local" in protocols:
        return LocalTransport(fs)
    if "hf" in protocols and root.startswith("buckets/"):
        return HfBucketTransport(fs, root, storage_options)
    return FsspecTransport(fs)
