"""The transport interface: how bytes move between this process and one store location.

A transport is opened on a URL (``open_transport``) and addresses objects by *key*: a ``/``-separated
path relative to that URL (``steps/000000000012/manifest.json``), never starting with ``/``. A backend
implements six primitives (``put``, ``get``, ``list``, ``delete``, plus ``capabilities`` and ``root``);
everything else here is written once on top of them and may be overridden where a backend does better
(a ranged read, a multipart download, a recursive delete).

Two conditions make a commit safe (``deltasync.store``): ``put(..., if_absent=True)`` never replaces an
existing object (the manifest: a committed step is never replaced), and ``put(..., if_version=v)``
replaces an object only while it is still at version ``v`` as read by ``get_versioned`` (the writer
lease: a compare-and-swap). ``Capabilities`` says whether the backend does each atomically; where it
cannot, it checks first and writes after (a window of one round trip, docs/FORMAT.md section 5).

Every ``put`` is all or nothing for readers: an object is visible complete or not at all.
"""

from __future__ import annotations

import builtins
import hashlib
import os
import shutil
import uuid
from abc import ABC, abstractmethod
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, BinaryIO

from deltasync.errors import CorruptObjectError

if TYPE_CHECKING:
    from deltasync.notify import Notifier

Data = bytes | bytearray | memoryview | Path
"""What ``put`` takes: bytes-like objects are written as they are; a ``Path`` is a local file, streamed
(a local transport may move it into place instead of copying it: the caller hands the file over)."""

_COPY_CHUNK_BYTES = 8 << 20


@dataclass(frozen=True, kw_only=True)
class Capabilities:
    """What a backend guarantees, for callers that choose a protocol by it (and for the docs' table).

    ``create_only``: ``put(if_absent=True)`` is atomic (two writers: exactly one succeeds).
    ``compare_and_swap``: ``put(if_version=v)`` is atomic. (New steps are pushed by step, not by object:
    deltasync/notify.py.)
    ``local_files``: objects are files on this machine (``local_path``), read in place, never downloaded.
    """

    create_only: bool
    compare_and_swap: bool
    local_files: bool = False


@dataclass(frozen=True)
class Entry:
    """One listed object: its key, its size, and when it was last written (None where unknown)."""

    key: str
    size: int
    mtime_unix_s: float | None = None


def content_version(data: bytes | memoryview) -> str:
    """A version tag for backends without one of their own: the content's SHA-256 (equal bytes, equal tag)."""
    return hashlib.sha256(data).hexdigest()


def check_key(key: str) -> str:
    """``key`` if it stays inside the transport's location (no ``..``, no absolute path, no empty part)."""
    if key.startswith("/") or "\\" in key or "\0" in key or any(p in ("", ".", "..") for p in key.split("/")):
        raise ValueError(f"not a store key: {key!r} (relative, '/'-separated, no '.' or '..' parts)")
    return key


def as_buffer(data: bytes | bytearray | memoryview) -> bytes | memoryview:
    """A byte-addressed view of ``data`` without copying (a typed memoryview counts its items, not bytes)."""
    if isinstance(data, memoryview):
        return data if data.format == "B" and data.ndim == 1 else data.cast("B")
    return data if isinstance(data, bytes) else memoryview(data)


class Transport(ABC):
    """Whole-object transfers to and from one store location (see the module docstring for keys).

    Implement ``put``, ``get``, ``list``, ``delete`` and set ``capabilities`` and ``root``. Missing objects
    raise ``FileNotFoundError``; a failed condition raises ``FileExistsError``; any other failure is the
    backend's own exception (``deltasync.store.Store`` classifies and retries them).
    """

    capabilities: Capabilities = Capabilities(create_only=False, compare_and_swap=False)
    root: str = ""
    """The location in the backend's own words (a folder, ``bucket/prefix``): for messages only."""

    @abstractmethod
    def put(self, key: str, data: Data, *, if_absent: bool = False, if_version: str | None = None) -> None:
        """Write one object. ``if_absent``: ``FileExistsError`` if it exists. ``if_version``:
        ``FileExistsError`` unless it is still at that version (``get_versioned``)."""

    @abstractmethod
    def get(self, key: str, *, start: int = 0, end: int | None = None) -> bytes:
        """The object's bytes ``[start, end)`` (to its end when ``end`` is None); ``FileNotFoundError``
        if it does not exist. A range past the end is cut short, as in Python slicing."""

    @abstractmethod
    def list(self, prefix: str = "") -> list[Entry]:
        """Every object under the folder ``prefix`` ("" for all), at any depth; [] if there is none."""

    @abstractmethod
    def delete(self, key: str) -> None:
        """Delete one object; nothing happens if it does not exist."""

    # --- written once on top of the primitives; override where the backend does better ---

    def get_versioned(self, key: str) -> tuple[bytes, str]:
        """The object's bytes and an opaque version tag for ``put(if_version=...)``; ``FileNotFoundError``
        if it does not exist. The default tag is the content's SHA-256."""
        data = self.get(key)
        return data, content_version(data)

    def get_file(self, key: str, local: Path, *, max_bytes: int | None = None) -> None:
        """Download the object into the local file ``local`` (large anchors: never whole in memory where the
        backend streams); ``FileNotFoundError`` if it does not exist.

        ``max_bytes``: the size the caller expects at most (a manifest's ``object_bytes``). A larger object is
        refused with :func:`too_large`'s ``CorruptObjectError`` as soon as the excess shows (from the size the
        backend announces, before any byte is read, where it announces one), and at most ``max_bytes + 1``
        bytes are fetched and written: a bucket writer who swaps in a huge object cannot fill a reader's disk.
        What was written stays in ``local`` (the caller deletes it). None: no bound.

        Older transports may define ``get_file(key, local)`` without ``max_bytes``: a store still reads from them,
        unbounded (warned once), and the store contract's ``test_downloads_are_bounded`` fails until they take it.
        """
        data = self.get(key, end=None if max_bytes is None else max_bytes + 1)
        if max_bytes is not None and len(data) > max_bytes:
            raise too_large(key, max_bytes, len(data))
        with open(local, "wb") as f:
            f.write(data)

    def exists(self, key: str) -> bool:
        """Whether ``key`` is an object, or a folder holding any object."""
        folder = key.rstrip("/") + "/"
        return any(e.key == key or e.key.startswith(folder)
                   for e in self.list(key.rsplit("/", 1)[0] if "/" in key else ""))

    def delete_tree(self, prefix: str) -> None:
        """Delete every object under the folder ``prefix``."""
        for entry in self.list(prefix):
            self.delete(entry.key)

    def children(self, prefix: str = "") -> builtins.list[str]:
        """The names directly under the folder ``prefix`` (objects and folders), sorted."""
        start = len(prefix.rstrip("/")) + 1 if prefix else 0
        return sorted({e.key[start:].split("/", 1)[0] for e in self.list(prefix)})

    def local_path(self, key: str) -> Path | None:
        """The object's file on this machine, for transports with ``capabilities.local_files``; else None."""
        return None

    def step_events(self) -> Notifier | None:
        """A new :class:`deltasync.notify.Notifier` of steps committed here (the caller closes it), where the
        backend pushes its changes (a Hugging Face bucket's event feed); None (the default): followers poll."""
        return None

    def close(self) -> None:  # noqa: B027 - an optional hook, not abstract: most transports hold nothing
        """Release connections and clients (the default holds none)."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.root!r})"


def read_data(data: Data) -> bytes | memoryview:
    """``data`` as bytes in memory (a ``Path`` is read): for backends that cannot stream a file."""
    return Path(data).read_bytes() if isinstance(data, Path) else as_buffer(data)


def copy_to_temporary(source: Data, folder: str, name: str) -> str:
    """Write ``source`` to a new temporary file beside ``folder/name`` and return its path (fsynced), so
    that a rename or link can publish it whole."""
    tmp = os.path.join(folder, f"{name}.tmp-{uuid.uuid4().hex}")
    with open(tmp, "wb") as f:
        if isinstance(source, Path):
            with open(source, "rb") as src:
                shutil.copyfileobj(src, f, _COPY_CHUNK_BYTES)
        else:
            f.write(as_buffer(source))
        f.flush()
        os.fsync(f.fileno())
    return tmp


def too_large(key: str, max_bytes: int, found: int) -> CorruptObjectError:
    """The error of a bounded download (``Transport.get_file(max_bytes=...)``) whose object is larger than
    ``max_bytes``: ``found`` is its size where the backend announced it, else the bytes seen (``max_bytes + 1``:
    a lower bound). Never retried (not transient: the same object is as large the next time)."""
    return CorruptObjectError(f"{key}: {found}{'+' if found == max_bytes + 1 else ''} bytes, more than the "
                              f"{max_bytes} expected: refused while downloading",
                              key=key, expected=max_bytes, found=found)


def copy_bounded(src: BinaryIO, dst: BinaryIO, key: str, *, max_bytes: int | None, size: int | None = None,
                 chunk_bytes: int = _COPY_CHUNK_BYTES) -> int:
    """Copy ``src`` to ``dst`` in chunks and return the bytes copied; with ``max_bytes``, refuse (``too_large``) a
    source larger than that: at once where its ``size`` is known, else after reading ``max_bytes + 1`` bytes (never
    more: the last chunk read is cut to the bound)."""
    if max_bytes is not None and size is not None and size > max_bytes:
        raise too_large(key, max_bytes, size)
    limit = None if max_bytes is None else max_bytes + 1
    done = 0
    while limit is None or done < limit:
        data = src.read(chunk_bytes if limit is None else min(chunk_bytes, limit - done))
        if not data:
            break
        dst.write(data)
        done += len(data)
    if max_bytes is not None and done > max_bytes:
        raise too_large(key, max_bytes, done)
    return done
