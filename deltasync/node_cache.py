"""A download cache shared by every process on one machine, so that a host's engines fetch each object once.

Eight engines on one host following one remote stream would otherwise download every step eight times
(and pay eight times the egress and requests). A :class:`NodeCache` is a folder every process on the host
points at (``DELTASYNC_NODE_CACHE``, or ``node_cache=`` on ``Store``/``StreamReader``): objects are kept
by their SHA-256 (from the manifest), so two streams, two steps or two processes that need the same bytes
share one file, and nothing a process finds there is trusted: the store checks the size and digest of
every object it opens, wherever it came from.

Concurrent use is safe across processes: a process downloads an object while holding that digest's
``flock`` (the others wait, then find it), writes it under a temporary name and renames it into place, so
no file is ever seen half written. The cache is bounded in bytes: after each addition the least recently
used objects go beyond ``max_bytes``. A process that opened an object keeps its own hard link to it (the
store's per-process cache), so eviction never pulls a file from under a reader. POSIX only (``flock``);
elsewhere the node cache is refused with a ``ConfigError``.

    DELTASYNC_NODE_CACHE=/local/nvme/deltasync DELTASYNC_NODE_CACHE_BYTES=50e9 vllm serve ...
"""

from __future__ import annotations

import errno
import logging
import os
import re
import shutil
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from deltasync.errors import ConfigError, CorruptObjectError

log = logging.getLogger(__name__)

__all__ = ["NodeCache", "node_cache_from_env"]

try:
    import fcntl
except ImportError:  # Windows
    fcntl = None  # type: ignore[assignment]

DEFAULT_NODE_CACHE_BYTES = 20 << 30
_DIGEST = re.compile(r"[0-9a-f]{64}")
_STRIPES = 256  # lock files: one per first byte of the digest (bounded, whatever the number of objects)


class NodeCache:
    """Objects by SHA-256 in ``folder`` (made if missing, mode 0700), at most ``max_bytes`` of them.

    Args:
        folder: a folder on a local disk that every process of the host can write.
        max_bytes: the byte bound; the least recently used objects are deleted beyond it.

    Raises:
        ConfigError: ``max_bytes`` is not a positive integer, the folder cannot be made or written, or the
            platform has no ``flock``.

    Example::

        node = NodeCache("/local/nvme/deltasync", max_bytes=50 << 30)
        reader = StreamReader("s3://bucket/run", node_cache=node)
    """

    def __init__(self, folder: str | Path, *, max_bytes: int = DEFAULT_NODE_CACHE_BYTES) -> None:
        if fcntl is None:
            raise ConfigError("NodeCache: needs flock (POSIX); leave DELTASYNC_NODE_CACHE unset on this platform")
        if isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or max_bytes <= 0:
            raise ConfigError(f"NodeCache: max_bytes must be a positive number of bytes, not {max_bytes!r}")
        self.folder = Path(folder).absolute()
        self.max_bytes = max_bytes
        self.hits = 0  # objects this process found here
        self.downloads = 0  # objects this process downloaded and added
        try:
            for sub in ("objects", "locks", "tmp"):
                (self.folder / sub).mkdir(mode=0o700, parents=True, exist_ok=True)
        except OSError as e:
            raise ConfigError(f"NodeCache: cannot use {str(self.folder)!r} as the node cache: {e}") from e
        if not os.access(self.folder / "objects", os.W_OK | os.X_OK):
            raise ConfigError(f"NodeCache: {str(self.folder)!r} is not writable by this process")

    def __repr__(self) -> str:
        return f"NodeCache({str(self.folder)!r}, max_bytes={self.max_bytes})"

    @property
    def scratch(self) -> Path:
        """A folder on the cache's file system for downloads in progress (so they can be linked, not copied)."""
        return self.folder / "tmp"

    def fetch(self, sha256: str, size: int, dest: Path, download: Callable[[Path], None],
              check: Callable[[Path], None]) -> None:
        """Put the object with digest ``sha256`` at ``dest``: linked from the cache, else downloaded (by one
        process of the host at a time) with ``download(dest)``, checked with ``check(dest)`` and added.

        A cached file that fails ``check`` (damaged on disk) is dropped and downloaded again; ``check``'s
        error from a fresh download propagates and nothing is added.
        """
        digest = self._digest(sha256)
        with self._claim(digest):
            if self._link_out(digest, size, dest):
                try:
                    check(dest)
                except CorruptObjectError as e:
                    log.warning("node cache %s: dropping a damaged object: %s", self.folder, e)
                    dest.unlink(missing_ok=True)
                    self._path(digest).unlink(missing_ok=True)
                else:
                    self.hits += 1
                    return
            download(dest)
            check(dest)
            self._link_in(digest, dest)
        self.downloads += 1
        self._evict()

    def read(self, sha256: str, size: int, download: Callable[[], bytes], check: Callable[[bytes], None]) -> bytes:
        """The object's bytes: from the cache, else ``download()``-ed (one process at a time), checked and
        added. Like :meth:`fetch`, for objects read into memory."""
        digest = self._digest(sha256)
        with self._claim(digest):
            data = self._read(digest, size)
            if data is not None:
                try:
                    check(data)
                except CorruptObjectError as e:
                    log.warning("node cache %s: dropping a damaged object: %s", self.folder, e)
                    self._path(digest).unlink(missing_ok=True)
                else:
                    self.hits += 1
                    return data
            data = download()
            check(data)
            tmp = self.scratch / f"{digest}.{os.getpid()}.part"
            try:
                tmp.write_bytes(data)
                os.replace(tmp, self._path(digest))
            finally:
                tmp.unlink(missing_ok=True)
        self.downloads += 1
        self._evict()
        return data

    def size_bytes(self) -> int:
        """The bytes the cache holds now."""
        return sum(size for _, size, _ in self._entries())

    # --- internals ---

    def _digest(self, sha256: str) -> str:
        if not (isinstance(sha256, str) and _DIGEST.fullmatch(sha256)):
            raise CorruptObjectError(f"node cache: expected a SHA-256 in lowercase hex, got {sha256!r}")
        return sha256

    def _path(self, digest: str) -> Path:
        return self.folder / "objects" / digest

    @contextmanager
    def _claim(self, digest: str) -> Iterator[None]:
        """This digest's lock (striped over 256 files), held across processes while it is fetched."""
        with self._flock(self.folder / "locks" / f"{digest[:2]}.lock"):
            yield

    @contextmanager
    def _flock(self, path: Path) -> Iterator[None]:
        fd = os.open(path, os.O_CREAT | os.O_RDWR, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)  # releases the lock

    def _link_out(self, digest: str, size: int, dest: Path) -> bool:
        """Link (or copy, across file systems) the cached object to ``dest``; False when it is not cached or
        has the wrong size."""
        src = self._path(digest)
        try:
            if src.stat().st_size != size:
                src.unlink(missing_ok=True)
                return False
            os.utime(src)  # recently used
            dest.unlink(missing_ok=True)
            _link_or_copy(src, dest)
        except FileNotFoundError:
            return False
        return True

    def _link_in(self, digest: str, src: Path) -> None:
        """Add a checked download: linked (or copied) under a temporary name, then renamed into place."""
        tmp = self.scratch / f"{digest}.{os.getpid()}.part"
        try:
            tmp.unlink(missing_ok=True)
            _link_or_copy(src, tmp)
            os.replace(tmp, self._path(digest))
        except OSError as e:  # a full or read-only cache costs sharing, never the read
            log.warning("node cache %s: could not add an object: %s", self.folder, e)
        finally:
            tmp.unlink(missing_ok=True)

    def _read(self, digest: str, size: int) -> bytes | None:
        path = self._path(digest)
        try:
            with open(path, "rb") as f:
                data = f.read(size + 1)
            os.utime(path)
        except FileNotFoundError:
            return None
        return data if len(data) == size else None

    def _entries(self) -> list[tuple[float, int, Path]]:
        out = []
        for entry in os.scandir(self.folder / "objects"):
            try:
                st = entry.stat(follow_symlinks=False)
            except FileNotFoundError:
                continue
            out.append((st.st_mtime, st.st_size, Path(entry.path)))
        return out

    def _evict(self) -> None:
        """Delete the least recently used objects beyond ``max_bytes`` (one evicting process at a time).
        A reader that opened one keeps its own link, so its bytes stay until it lets go."""
        with self._flock(self.folder / "locks" / "evict.lock"):
            entries = sorted(self._entries())
            total = sum(size for _, size, _ in entries)
            for _, size, path in entries:
                if total <= self.max_bytes:
                    break
                path.unlink(missing_ok=True)
                total -= size
            # downloads abandoned by killed processes (older than an hour) go too
            cutoff = time.time() - 3600
            for entry in os.scandir(self.scratch):
                try:
                    if entry.stat(follow_symlinks=False).st_mtime < cutoff:
                        os.unlink(entry.path)
                except FileNotFoundError:
                    pass


def _link_or_copy(src: Path, dest: Path) -> None:
    """A hard link (no bytes copied; eviction of one name leaves the other), or a copy across file systems."""
    try:
        os.link(src, dest)
    except OSError as e:
        if e.errno not in (errno.EXDEV, errno.EPERM, errno.EMLINK):
            raise
        shutil.copyfile(src, dest)


def node_cache_from_env() -> NodeCache | None:
    """The node cache named by ``DELTASYNC_NODE_CACHE`` (bounded by ``DELTASYNC_NODE_CACHE_BYTES``), or None.

    Raises:
        ConfigError: the byte bound is not a positive number, or the folder cannot be used.
    """
    folder = os.environ.get("DELTASYNC_NODE_CACHE", "").strip()
    if not folder:
        return None
    raw = os.environ.get("DELTASYNC_NODE_CACHE_BYTES", "").strip()
    try:
        limit = float(raw) if raw else float(DEFAULT_NODE_CACHE_BYTES)
    except ValueError:
        limit = float("nan")
    if not (limit == limit and 0 < limit < 1e18):
        raise ConfigError(f"DELTASYNC_NODE_CACHE_BYTES: expected a positive number of bytes, got {raw!r}")
    return NodeCache(folder, max_bytes=int(limit))
