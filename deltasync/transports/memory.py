"""``memory://name``: objects in this process's memory, for tests and same-process pipelines.

The objects live in fsspec's in-process memory filesystem, so that ``memory://`` means one place in a
process whoever reads it (deltasync, or fsspec directly). Every write through this module holds one
process-wide lock: create-only and compare-and-swap are atomic among all writers of the process that go
through deltasync.
"""

from __future__ import annotations

import threading
from typing import Any

import fsspec

from deltasync.transports.base import Capabilities
from deltasync.transports.fsspec import FsspecTransport

_LOCK = threading.RLock()  # one for the process: every MemoryTransport on any name shares the same objects


class MemoryTransport(FsspecTransport):
    """Objects under ``memory://<root>`` of this process."""

    capabilities = Capabilities(create_only=True, compare_and_swap=True)

    def __init__(self, root: str) -> None:
        super().__init__(fsspec.filesystem("memory"), root, lock=_LOCK)


def open_memory(url: str, storage_options: dict[str, Any]) -> MemoryTransport:
    """``memory://name[/prefix]``; no storage options apply."""
    _, root = fsspec.core.url_to_fs(url)
    return MemoryTransport(root)
