"""Local scratch space: temporary folders and the download cache, removed as soon as nothing needs them.

Long runs must not fill the disk. Every folder made here (``deltasync-<what>-*`` in the temp folder) is
removed by its owner's ``close()``, when its owner is garbage-collected, and at interpreter exit (a
Ctrl-C in the CLI ends as an exit), whichever comes first. A process killed outright (SIGKILL, the OOM
killer) cleans nothing: each folder holds a lock (``flock``) for its process's lifetime, and the next
process that makes a folder of the same kind removes those whose lock is free (POSIX only). The download
cache deletes an object as soon as the last reader holding it lets go, and bounds the objects nobody
holds by a byte cap.
"""

from __future__ import annotations

import atexit
import itertools
import logging
import os
import shutil
import tempfile
import threading
import time
import weakref
from collections import OrderedDict
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from deltasync.errors import FormatError

log = logging.getLogger(__name__)

DEFAULT_CACHE_MAX_BYTES = 4 << 30
OWNER_LOCK = ".owner.lock"
RECLAIM_AFTER_S = 60.0  # a folder younger than this may be one whose lock is being taken right now

try:
    import fcntl
except ImportError:  # Windows: no reclaiming of dead processes' folders
    fcntl = None  # type: ignore[assignment]


def _lock_owner(folder: Path) -> int | None:
    """Hold ``folder``'s owner lock for this process's lifetime; the open descriptor (None without flock)."""
    if fcntl is None:
        return None
    fd = os.open(folder / OWNER_LOCK, os.O_CREAT | os.O_RDWR, 0o600)
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    return fd


def reclaim_abandoned(prefix: str, *, older_than_s: float = RECLAIM_AFTER_S) -> list[str]:
    """Remove ``deltasync-<prefix>-*`` folders left by processes that died without cleaning up (their owner
    lock is free); returns their names. Folders without a lock (other tools, older versions) are kept."""
    if fcntl is None:
        return []
    root = Path(tempfile.gettempdir())
    removed = []
    try:
        candidates = [p for p in root.iterdir() if p.name.startswith(f"deltasync-{prefix}-")]
    except OSError:
        return []
    for folder in candidates:
        try:
            if time.time() - folder.stat().st_mtime < older_than_s:
                continue
            fd = os.open(folder / OWNER_LOCK, os.O_RDWR)
        except OSError:  # gone, not ours to judge, or no lock file
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:  # its process is alive
            continue
        finally:
            os.close(fd)
        shutil.rmtree(folder, ignore_errors=True)
        removed.append(folder.name)
    if removed:
        log.info("removed %d temporary folder(s) of processes that died: %s", len(removed), removed)
    return removed


def _remove_tree(key: int, path: str, lock_fd: int | None) -> None:
    _live.pop(key, None)
    # a download thread may still add a file while the tree is removed: try again a few times
    for _ in range(3):
        shutil.rmtree(path, ignore_errors=True)
        if not os.path.exists(path):
            return
    log.warning("could not remove temporary folder %s", path)
    if lock_fd is not None:
        os.close(lock_fd)  # after removing: a reclaimer must not see a free lock on a folder being removed


class ScratchFolder:
    """A folder for temporary files: ``folder`` if given (kept, only our files in it are removed), else a
    new ``deltasync-<prefix>-*`` folder in the temp folder, made on first use and removed by ``remove()``,
    by garbage collection of this object, or at interpreter exit.
    """

    def __init__(self, prefix: str, folder: str | Path | None = None) -> None:
        self.prefix = prefix
        self.given = Path(folder) if folder else None
        self._path: Path | None = None
        self._finalizer: weakref.finalize | None = None
        self._lock = threading.Lock()

    def existing(self) -> Path | None:
        """The folder if it exists now; never makes one (cleanup must not create what it removes)."""
        folder = self.given if self.given is not None else self._path
        return folder if folder is not None and folder.is_dir() else None

    @property
    def path(self) -> Path:
        """The folder, made now if it does not exist yet (also again after ``remove()``)."""
        with self._lock:
            if self.given is not None:
                self.given.mkdir(parents=True, exist_ok=True)  # a missing folder must not read as a missing object
                return self.given
            if self._path is None or not self._path.is_dir():
                if _exiting:  # a daemon thread still at work after the exit sweep: a new folder would stay
                    raise RuntimeError(f"no new temporary folder: the interpreter is exiting ({self.prefix})")
                reclaim_abandoned(self.prefix)
                self._path = Path(tempfile.mkdtemp(prefix=f"deltasync-{self.prefix}-"))
                lock_fd = _lock_owner(self._path)
                # the finalizer holds the path, not this object: it runs when this object is collected,
                # and the atexit sweep below runs it for the ones still alive at exit
                key = next(_keys)
                self._finalizer = weakref.finalize(self, _remove_tree, key, str(self._path), lock_fd)
                self._finalizer.atexit = False
                _live[key] = self._finalizer
            return self._path

    def remove(self) -> None:
        """Remove the folder we made (and everything in it). A given folder is left to its owner."""
        with self._lock:
            finalizer, self._finalizer, self._path = self._finalizer, None, None
        if finalizer is not None:
            finalizer()


_live: dict[int, weakref.finalize] = {}  # the folders not removed yet, by key
_keys = itertools.count()
_exiting = False


@atexit.register
def _remove_all_at_exit() -> None:
    """Remove the folders of objects never closed. Registered when deltasync is imported, so it runs after
    the atexit hooks registered later (followers stop their threads first)."""
    global _exiting
    _exiting = True
    for finalizer in list(_live.values()):
        finalizer()
    _live.clear()


def plain_name(name: str, *, where: str) -> str:
    """``name`` if it is a plain file name (no folder part, not ``.`` or ``..``); a store names our files."""
    if not name or name in (".", "..") or "/" in name or "\\" in name or "\0" in name:
        raise FormatError(f"{where}: object name {name!r} is not a plain file name")
    return name


class ObjectCache:
    """Objects downloaded from a remote store, each kept only while someone needs it.

    A reader *holds* an object while it has it open (``hold`` / ``release``, counted); when the last
    holder releases it the file is deleted. Objects fetched without holding (callers of
    ``Store.fetch_object`` that keep the path) stay until the unheld ones exceed ``max_bytes``; then the
    least recently fetched are deleted first. Held objects are never deleted by the cap.
    """

    def __init__(self, folder: str | Path | None = None, *, max_bytes: int = DEFAULT_CACHE_MAX_BYTES) -> None:
        self.scratch = ScratchFolder("cache", folder)
        self.max_bytes = max_bytes
        self._lock = threading.Lock()
        self._files: OrderedDict[str, int] = OrderedDict()  # name -> bytes, least recently fetched first
        self._held: dict[str, int] = {}
        # per-name locks (striped: bounded memory over a long run), so that one object is not fetched and
        # deleted at once while other objects download in parallel; re-entrant for eviction during a fetch
        self._stripes = [threading.RLock() for _ in range(64)]

    @property
    def folder(self) -> Path:
        return self.scratch.path

    def path(self, name: str) -> Path:
        return self.folder / plain_name(name, where="cache")

    @contextmanager
    def filling(self, name: str) -> Iterator[Path]:
        """The path to download ``name`` to, locked against other threads fetching or releasing it."""
        with self._stripe(name):
            yield self.path(name)

    def add(self, name: str, *, hold: bool) -> None:
        """Record a downloaded (or reused) object; evict unheld objects beyond the byte cap."""
        path = self.path(name)
        with self._lock:
            self._files[name] = path.stat().st_size
            self._files.move_to_end(name)
            if hold:
                self._held[name] = self._held.get(name, 0) + 1
            evict = self._over_cap(keep=name)
        for victim, size in evict:
            self._evict(victim, size)

    def release(self, name: str) -> None:
        """One holder is done with ``name``: the file is deleted when nobody holds it any more."""
        with self._lock:
            count = self._held.get(name, 0) - 1
            if count > 0:
                self._held[name] = count
                return
            self._held.pop(name, None)
            if name not in self._files:
                return
        with self._stripe(name):  # not while another thread is fetching it again
            with self._lock:
                if self._held.get(name):
                    return
                self._files.pop(name, None)
            self._delete(name)

    def discard(self, name: str) -> None:
        """Forget and delete ``name`` (a download that failed its checks)."""
        with self._lock:
            self._files.pop(name, None)
        self._delete(name)

    def close(self) -> None:
        """Delete every cached object and the folder we made (a given folder is kept, emptied of our files)."""
        with self._lock:
            names = list(self._files)
            self._files.clear()
            self._held.clear()
        if self.scratch.given is not None:
            for name in names:
                self._delete(name)
                self._delete(name + ".part")
        self.scratch.remove()

    def _over_cap(self, *, keep: str) -> list[tuple[str, int]]:
        """Unheld objects to delete so that the unheld ones fit in ``max_bytes`` (never ``keep``, just fetched)."""
        unheld = [(n, size) for n, size in self._files.items() if not self._held.get(n)]
        total = sum(size for _, size in unheld)
        evict = []
        for n, size in unheld:  # least recently fetched first
            if total <= self.max_bytes:
                break
            if n == keep:
                continue
            evict.append((n, size))
            total -= size
            del self._files[n]
        return evict

    def _stripe(self, name: str) -> threading.RLock:
        return self._stripes[hash(name) % len(self._stripes)]

    def _evict(self, name: str, size: int) -> None:
        lock = self._stripe(name)
        if not lock.acquire(blocking=False):  # another thread fetches it (or a neighbour): keep it for now
            with self._lock:
                self._files.setdefault(name, size)
                self._files.move_to_end(name, last=False)
            return
        try:
            self._delete(name)
        finally:
            lock.release()

    def _delete(self, name: str) -> None:
        folder = self.scratch.existing()
        if folder is None:
            return
        try:
            (folder / plain_name(name, where="cache")).unlink(missing_ok=True)
        except OSError as e:  # e.g. still mapped on Windows: the folder goes at close or exit
            log.debug("could not delete cached object %s: %s", name, e)
