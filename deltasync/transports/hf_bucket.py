"""Hugging Face Storage Buckets (``hf://buckets/<namespace>/<name>[/prefix]``) through huggingface_hub.

Uploads go through the bucket API's batched calls (from a file for objects, so large anchors stream);
downloads fail on a missing file instead of skipping it (``download_bucket_files`` only warns unless told
otherwise: a step is never half-downloaded silently). Listing and ranged reads go through ``HfFileSystem``.
Buckets have no conditional write: create-only and compare-and-swap are a check then a write. Other
``hf://`` URLs (model and dataset repos) are plain fsspec. Needs the ``hf`` extra (huggingface_hub).

Buckets push their changes (a server-sent event feed, followed by huggingface_hub's ``BucketFollower``):
``step_events()`` turns each manifest added under the stream into a pushed step, so followers of a bucket
fetch a step as soon as it is committed and poll only as a safety net (deltasync/notify.py). Where the feed
is not served or not allowed for the token, it ends and followers poll as before.
"""

from __future__ import annotations

import logging
import re
import threading
from pathlib import Path
from typing import Any

import fsspec
from huggingface_hub import HfApi

from deltasync.errors import StoreError
from deltasync.notify import Announcements
from deltasync.transports.base import Capabilities, Data, check_key, read_data, too_large
from deltasync.transports.fsspec import FsspecTransport

log = logging.getLogger(__name__)


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

    def step_events(self) -> BucketEvents | None:
        """The bucket's event feed as pushed steps of this stream; None when this huggingface_hub has no
        client of the feed."""
        try:
            return BucketEvents(self.api.endpoint, self.bucket_id, self._prefix, self.api.token)
        except ImportError:
            log.info("hf://buckets/%s: this huggingface_hub has no bucket event feed: followers poll", self.bucket_id)
            return None

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

    def get_file(self, key: str, local: Path, *, max_bytes: int | None = None) -> None:
        """The file into ``local``; with ``max_bytes``, its listed size is read first and a larger file refused
        (``too_large``) before any byte moves. No extra request: ``download_bucket_files`` looks the path up the
        same way when given a name, and downloads the file it is given (its xet hash, of that size) as it is."""
        from huggingface_hub.errors import EntryNotFoundError

        name = self.bucket_key(key)
        try:
            if max_bytes is None:
                self.api.download_bucket_files(self.bucket_id, [(name, str(local))], raise_on_missing_files=True)
                return
            found = next((f for f in self.api.get_bucket_paths_info(self.bucket_id, [name]) if f.path == name), None)
            if found is None:
                raise FileNotFoundError(self.path(key))
            if found.size > max_bytes:
                raise too_large(key, max_bytes, found.size)
            self.api.download_bucket_files(self.bucket_id, [(found, str(local))], raise_on_missing_files=True)
        except EntryNotFoundError as e:
            raise FileNotFoundError(self.path(key)) from e


class BucketEvents(Announcements):
    """Steps committed under ``prefix`` of a bucket, from its event feed: a ``manifest.json`` added (or
    updated) under ``steps/<12 digits>/`` is a pushed step (a hint: the follower checks the manifest)."""

    def __init__(self, endpoint: str, bucket_id: str, prefix: str, token: Any) -> None:
        from huggingface_hub._bucket_live_follow import BucketFollower  # the Hub's own client of its feed

        super().__init__()
        folder = re.escape(f"{prefix}/" if prefix else "")
        self._manifest = re.compile(rf"{folder}steps/(\d{{12}})/manifest\.json")
        self._closed = threading.Event()
        self._follower = BucketFollower(endpoint=endpoint, bucket_id=bucket_id, token=token,
                                        on_changes=self._changes, on_reconcile=lambda: None,
                                        is_alive=lambda: not self._closed.is_set())
        self._follower.start()

    @property
    def alive(self) -> bool:
        """Whether the feed is being followed (it reached ``ready``, and has not ended)."""
        return self._follower.subscribed and self._follower.is_alive()

    def _changes(self, changes: list[Any]) -> None:
        steps = [int(m.group(1)) for c in changes if c.op in ("add", "update")
                 and isinstance(c.path, str) and (m := self._manifest.fullmatch(c.path))]
        if steps:
            self._announce(max(steps))

    def close(self) -> None:
        self._closed.set()
        self._follower.stop()


def open_hf(url: str, storage_options: dict[str, Any]) -> FsspecTransport:
    """``hf://buckets/...`` is a bucket; any other ``hf://`` URL (a repo) is plain fsspec."""
    fs, root = fsspec.core.url_to_fs(url, **storage_options)
    if root.startswith("buckets/"):
        return HfBucketTransport(fs, root, storage_options)
    return FsspecTransport(fs, root)
