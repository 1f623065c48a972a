"""Hugging Face Storage Buckets (``hf://buckets/<namespace>/<name>[/prefix]``) through huggingface_hub.

Uploads go through the bucket API's batched calls (from a file for objects, so large anchors stream);
downloads fail on a missing file instead of skipping it (``download_bucket_files`` only warns unless told
otherwise: a step is never half-downloaded silently). Listing and ranged reads go through ``HfFileSystem``.
Buckets have no conditional write: create-only and compare-and-swap are a check then a write. Other
``hf://`` URLs (model and dataset repos) are plain fsspec. Needs the ``hf`` extra (huggingface_hub).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import fsspec
from huggingface_hub import HfApi

from deltasync.errors import StoreError
from deltasync.transports.base import Capabilities, Data, check_key, read_data
from deltasync.transports.fsspec import FsspecTransport


class HfBucketTransport(FsspecTransport):
    """Objects under ``buckets/<namespace>/<name>/<prefix>`` of ``fs`` (an ``HfFileSystem``)."""

    capabilities = Capabilities(create_only=False, compare_and_swap=False)

    def __init__(self, fs: fsspec.AbstractFileSystem, root: str, storage_options: dict[str, Any]) -> None:
        parts = root.rstrip("/").split("/")
        if len(parts) < 3 or parts[0] != "buckets" or not all(parts[:3]):
            raise StoreError(f"hf://{root}: a bucket URL looks like hf://buckets/<namespace>/<name>[/path]")
        super().__init__(fs, root)
        self.bucket_id = f"{parts[1]}/{parts[2]}"
        self._prefix = "/".join(parts[3:])  # the stream's folder inside the bucket
        self.api = HfApi(token=storage_options.get("token"), endpoint=storage_options.get("endpoint"))

    def bucket_key(self, key: str) -> str:
        """The key inside the bucket."""
        return f"{self._prefix}/{check_key(key)}".lstrip("/") if key else self._prefix

    def put(self, key: str, data: Data, *, if_absent: bool = False, if_version: str | None = None) -> None:
        # buckets have no conditional writes: check, then write (a window of one round trip; docs/FORMAT.md)
        if if_absent or if_version is not None:
            try:
                current: str | None = self.get_versioned(key)[1]
            except FileNotFoundError:
                current = None
            if (if_absent and current is not None) or (if_version is not None and current != if_version):
                raise FileExistsError(f"{self.path(key)} exists or changed since it was read")
        source: str | bytes = str(data) if isinstance(data, Path) else bytes(read_data(data))
        self.api.batch_bucket_files(self.bucket_id, add=[(source, self.bucket_key(key))])
        self.fs.invalidate_cache()  # HfFileSystem caches listings; our own writes must show in our next one

    def get_file(self, key: str, local: Path) -> None:
        from huggingface_hub.errors import EntryNotFoundError

        try:
            self.api.download_bucket_files(self.bucket_id, [(self.bucket_key(key), str(local))], raise_on_missing_files=True)
        except EntryNotFoundError as e:
            raise FileNotFoundError(self.path(key)) from e


def open_hf(url: str, storage_options: dict[str, Any]) -> FsspecTransport:
    """``hf://buckets/...`` is a bucket; any other ``hf://`` URL (a repo) is plain fsspec."""
    fs, root = fsspec.core.url_to_fs(url, **storage_options)
    if root.startswith("buckets/"):
        return HfBucketTransport(fs, root, storage_options)
    return FsspecTransport(fs, root)
