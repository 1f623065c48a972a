"""A download cache shared by every process on one machine, so that a host's engines fetch each object once.

Eight engines on one host following one remote stream would otherwise download every step eight times
(and pay eight times the egress and requests). A :class:`NodeCache` is a folder every process on the host
points at (``DELTASYNC_NODE_CACHE``, or ``node_cache=`` on ``Store``/``StreamReader``): objects are kept
by their digest (from the manifest, algorithm included), so two streams, two steps or two processes that need the
same bytes share one file, and nothing a process finds there is trusted: the store checks the size and digest of
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
import stat
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from deltasync.errors import ConfigError, CorruptObjectError, DeltaSyncError

log = logging.getLogger(__name__)

__all__ = ["NodeCache", "node_cache_from_env"]

try:
    import fcntl
except ImportError:  # Windows
    fcntl = None  # type: ignore[assignment]

T = TypeVar("T")
DEFAULT_NODE_CACHE_BYTES = 20 << 30
_DIGEST = re.compile(r"(sha256|blake3):([0-9a-f]{64})")
_STRIPES = 256  # lock files: one per first byte of the digest (bounded, whatever the number of objects)


class NodeCache:
    """Objects by digest (algorithm and value) in ``folder`` (made if missing, mode 0700), at most ``max_bytes``.

    The folder belongs to one user (the processes of the host that share it run as that user) and nobody else may
    write it: an existing folder owned by another user, or writable by others, is refused (they could plant
    links or FIFOs where this process writes and reads). Nothing in it is followed or waited on: objects are
    opened without following links and without blocking, and anything but a regular file is removed.

    Args:
        folder: a folder on a local disk, this user's (made mode 0700 if missing).
        max_bytes: the byte bound; the least recently used objects are deleted beyond it.

    Raises:
        ConfigError: ``max_bytes`` is not a positive integer, the folder cannot be made or written, belongs to
            another user or is writable by others, or the platform has no ``flock``.

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
        self._broken_said = False  # a failure of the cache itself was logged (once)
        try:
            _own_folder(self.folder, follow=True)
            for sub in ("objects", "locks", "tmp"):
                _own_folder(self.folder / sub, follow=False)
        except OSError as e:
            raise ConfigError(f"NodeCache: cannot use {str(self.folder)!r} as the node cache: {e}") from e

    def __repr__(self) -> str:
        return f"NodeCache({str(self.folder)!r}, max_bytes={self.max_bytes})"

    @property
    def scratch(self) -> Path:
        """A folder on the cache's file system for downloads in progress (so they can be linked, not copied)."""
        return self.folder / "tmp"

    def fetch(self, digest: str, size: int, dest: Path, download: Callable[[Path], None],
              check: Callable[[Path], None]) -> None:
        """Put the object with ``digest`` (prefixed with its algorithm: ``"blake3:…"``) at ``dest``: linked from the
        cache, else downloaded (by one process of the host at a time) with ``download(dest)``, checked with
        ``check(dest)`` and added.

        A cached file that fails ``check`` (damaged on disk) is dropped and downloaded again; ``check``'s
        error from a fresh download propagates and nothing is added. A cache that fails itself (its disk full,
        a folder removed) costs the sharing, never the read: the object is downloaded as without a cache (the
        failure logged once).
        """
        digest = self.file_name(digest)
        claim = self._try(lambda: self._claim(digest))
        if claim is None:
            download(dest)
            check(dest)
            return
        with claim:
            if self._try(lambda: self._link_out(digest, size, dest)):
                try:
                    check(dest)
                except CorruptObjectError as e:
                    log.warning("node cache %s: dropping a damaged object: %s", self.folder, e)
                    dest.unlink(missing_ok=True)
                    self._try(lambda: self._path(digest).unlink(missing_ok=True))
                else:
                    self.hits += 1
                    return
            download(dest)
            check(dest)
            self._try(lambda: self._link_in(digest, dest))
        self.downloads += 1
        self._try(self._evict)

    def read(self, digest: str, size: int, download: Callable[[], bytes], check: Callable[[bytes], None]) -> bytes:
        """The object's bytes: from the cache, else ``download()``-ed (one process at a time), checked and
        added. Like :meth:`fetch`, for objects read into memory."""
        digest = self.file_name(digest)
        claim = self._try(lambda: self._claim(digest))
        if claim is None:
            data = download()
            check(data)
            return data
        with claim:
            cached: bytes | None = self._try(lambda: self._read(digest, size))
            if cached is not None:
                data = cached
                try:
                    check(data)
                except CorruptObjectError as e:
                    log.warning("node cache %s: dropping a damaged object: %s", self.folder, e)
                    self._try(lambda: self._path(digest).unlink(missing_ok=True))
                else:
                    self.hits += 1
                    return data
            data = download()
            check(data)
            self._try(lambda: self._add(digest, data))
        self.downloads += 1
        self._try(self._evict)
        return data

    def size_bytes(self) -> int:
        """The bytes the cache holds now."""
        return sum(size for _, size, _ in self._entries())

    # --- internals ---

    def _try(self, fn: Callable[[], T]) -> T | None:
        """``fn()``, or None when the cache itself fails (an ``OSError`` of its files: a full disk, a removed
        folder, no permission), logged once: the caller then reads from the store as without a cache."""
        try:
            return fn()
        except OSError as e:
            if isinstance(e, DeltaSyncError):  # a store's error is the caller's to see
                raise
            if not self._broken_said:
                self._broken_said = True
                log.warning("node cache %s failed (%s: %s): reading from the store without it (said once)",
                            self.folder, type(e).__name__, e)
            return None

    @staticmethod
    def file_name(digest: str) -> str:
        """The file name of an object with prefixed ``digest``: the bare hex for SHA-256 (as caches written before
        BLAKE3 hold them), ``blake3-<hex>`` for BLAKE3, so that two algorithms' digests never name one file."""
        m = _DIGEST.fullmatch(digest) if isinstance(digest, str) else None
        if m is None:
            raise CorruptObjectError(f"node cache: expected a digest 'sha256:<64 hex>' or 'blake3:<64 hex>', "
                                     f"got {str(digest)[:80]!r}")
        return m.group(2) if m.group(1) == "sha256" else f"{m.group(1)}-{m.group(2)}"

    def _path(self, digest: str) -> Path:
        return self.folder / "objects" / digest

    def _claim(self, digest: str) -> _Lock:
        """This digest's lock (striped over 256 files), held across processes while it is fetched; the lock file
        is opened now (an ``OSError`` here is the cache's), taken on ``with``."""
        return _Lock(self.folder / "locks" / f"{digest[-64:][:2]}.lock")

    def _link_out(self, digest: str, size: int, dest: Path) -> bool:
        """Link (or copy, across file systems) the cached object to ``dest``; False when it is not cached, has the
        wrong size, or is not a regular file (a link or a FIFO planted there is removed, never followed)."""
        src = self._path(digest)
        try:
            st = os.lstat(src)
        except FileNotFoundError:
            return False
        if not stat.S_ISREG(st.st_mode) or st.st_size != size:
            src.unlink(missing_ok=True)
            return False
        os.utime(src, follow_symlinks=False)  # recently used
        dest.unlink(missing_ok=True)
        try:
            _link_or_copy(src, dest)
        except FileNotFoundError:  # evicted meanwhile by another process
            return False
        return True

    def _link_in(self, digest: str, src: Path) -> None:
        """Add a checked download: linked (or copied) under a temporary name, then renamed into place."""
        tmp = self.scratch / f"{digest}.{os.getpid()}.part"
        try:
            tmp.unlink(missing_ok=True)  # a link planted there is removed, not followed
            _link_or_copy(src, tmp)
            os.replace(tmp, self._path(digest))
        finally:
            tmp.unlink(missing_ok=True)

    def _add(self, digest: str, data: bytes) -> None:
        """Add checked bytes: written to a new temporary file (never through a link), then renamed into place."""
        tmp = self.scratch / f"{digest}.{os.getpid()}.part"
        try:
            tmp.unlink(missing_ok=True)
            _write_new(tmp, data)
            os.replace(tmp, self._path(digest))
        finally:
            tmp.unlink(missing_ok=True)

    def _read(self, digest: str, size: int) -> bytes | None:
        """The cached object's bytes, or None: not cached, the wrong size, or not a regular file (opened without
        following a link and without blocking, so a FIFO planted there holds nobody)."""
        path = self._path(digest)
        fd = _open_regular(path)
        if fd is None:
            return None
        with os.fdopen(fd, "rb") as f:
            data = f.read(size + 1)
        os.utime(path, follow_symlinks=False)
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
        with _Lock(self.folder / "locks" / "evict.lock"):
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


class _Lock:
    """An exclusive ``flock`` on a lock file, opened at once (no link followed, nothing blocks on opening: a
    special file planted there is replaced by a regular one), taken on ``with``."""

    def __init__(self, path: Path) -> None:
        fd = _open_regular(path, create=True)
        if fd is None:  # not a regular file: replaced (our folder, mode 0700: only this user could have put it)
            path.unlink(missing_ok=True)
            fd = _open_regular(path, create=True)
            if fd is None:
                raise OSError(errno.EEXIST, f"{path}: not a regular file, and it cannot be replaced")
        self._fd = fd

    def __enter__(self) -> _Lock:
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX)
        except BaseException:
            os.close(self._fd)
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        os.close(self._fd)  # releases the lock


def _open_regular(path: Path, *, create: bool = False) -> int | None:
    """A file descriptor of ``path`` if it is a regular file (a link is not followed, a FIFO or device not waited
    on), or None where it is absent or something else (then removed, when not ``create``: it is garbage)."""
    flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
    if create:
        flags = os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
    try:
        fd = os.open(path, flags, 0o600)
    except FileNotFoundError:
        return None
    except OSError as e:
        if e.errno not in (errno.ELOOP, errno.ENXIO, errno.EISDIR):  # a link, an unconnected FIFO or socket, a dir
            raise
        if not create:
            _remove(path)
        return None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        if not create:
            _remove(path)
        return None
    return fd


def _remove(path: Path) -> None:
    try:
        if Path(path).is_dir() and not Path(path).is_symlink():
            return
        path.unlink(missing_ok=True)
    except OSError:
        pass


def _write_new(path: Path, data: bytes | memoryview) -> None:
    """Write ``data`` to a file that did not exist (``O_EXCL``: never through a link or into another file)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(data)


def _own_folder(path: Path, *, follow: bool) -> None:
    """Make ``path`` a folder of this user, mode 0700, or check that it is one: owned by this user, not writable
    by anyone else (a folder other users can write lets them plant links and FIFOs where this process writes and
    reads). ``follow``: the cache's own folder may be reached through a link; its subfolders may not."""
    try:
        os.mkdir(path, 0o700)
        os.chmod(path, 0o700)  # whatever the umask
    except FileExistsError:
        pass
    if follow and os.path.islink(path) and os.lstat(path).st_uid != os.geteuid():
        raise OSError(errno.EPERM, f"{path} is a link another user made (uid {os.lstat(path).st_uid}): use a folder "
                                   "of your own")
    st = os.stat(path) if follow else os.lstat(path)
    if not stat.S_ISDIR(st.st_mode):
        raise OSError(errno.ENOTDIR, f"{path} is not a folder")
    if st.st_uid != os.geteuid():
        raise OSError(errno.EPERM, f"{path} belongs to uid {st.st_uid}, not to this user (uid {os.geteuid()}): "
                                   "use a folder of your own")
    if st.st_mode & 0o022:
        raise OSError(errno.EPERM, f"{path} is writable by other users (mode {stat.S_IMODE(st.st_mode):04o}): any "
                                   f"user of the host could plant links there; chmod 700 {path}, or use a folder "
                                   "of your own")
    if not os.access(path, os.W_OK | os.X_OK):
        raise OSError(errno.EACCES, f"{path} is not writable by this process")


def _link_or_copy(src: Path, dest: Path) -> None:
    """A hard link (no bytes copied; eviction of one name leaves the other), or a copy across file systems (read
    without following a link, written to a new file)."""
    try:
        os.link(src, dest, follow_symlinks=False)
    except OSError as e:
        if e.errno not in (errno.EXDEV, errno.EPERM, errno.EMLINK):
            raise
        fd = _open_regular(src)
        if fd is None:
            raise FileNotFoundError(errno.ENOENT, f"{src} is not a regular file") from None
        with os.fdopen(fd, "rb") as f:
            dest.unlink(missing_ok=True)
            out = os.open(dest, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
            with os.fdopen(out, "wb") as w:
                shutil.copyfileobj(f, w, 1 << 20)


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
