"""``memory://name``: objects in this process's memory, for tests and same-process pipelines.

The objects live in fsspec's in-process memory filesystem, so that ``memory://`` means one place in a
process whoever reads it (deltasync, or fsspec directly). Every write through this module holds one
process-wide lock: create-only and compare-and-swap are atomic among all writers of the process that go
through deltasync. Subscribers hear of each object written (``subscribe``): a consumer in the same
process need not poll.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import fsspec

from deltasync.transports.base import Capabilities, Data
from deltasync.transports.fsspec import FsspecTransport

_LOCK = threading.RLock()  # one for the process: every MemoryTransport on any name shares the same objects
_SUBSCRIBERS: dict[int, tuple[str, str, Callable[[str], None]]] = {}  # id -> (their root, folder, callback)
_NEXT_ID = [0]


class MemoryTransport(FsspecTransport):
    """Objects under ``memory://<root>`` of this process."""

    capabilities = Capabilities(create_only=True, compare_and_swap=True, notify=True)

    def __init__(self, root: str) -> None:
        super().__init__(fsspec.filesystem("memory"), root, lock=_LOCK)

    def put(self, key: str, data: Data, *, if_absent: bool = False, if_version: str | None = None) -> None:
        with _LOCK:
            super().put(key, data, if_absent=if_absent, if_version=if_version)
            path = self.path(key)
            heard = [(path[len(root) + 1 :], cb) for root, folder, cb in _SUBSCRIBERS.values() if path.startswith(folder)]
        for their_key, cb in heard:  # outside the lock: a callback may read the store
            cb(their_key)

    def subscribe(self, prefix: str, callback: Callable[[str], None]) -> Callable[[], None]:
        with _LOCK:
            _NEXT_ID[0] += 1
            token = _NEXT_ID[0]
            _SUBSCRIBERS[token] = (self.root, self.path(prefix.rstrip("/")) + "/", callback)
        return lambda: _SUBSCRIBERS.pop(token, None) and None


def open_memory(url: str, storage_options: dict[str, Any]) -> MemoryTransport:
    """``memory://name[/prefix]``; no storage options apply."""
    _, root = fsspec.core.url_to_fs(url)
    return MemoryTransport(root)
