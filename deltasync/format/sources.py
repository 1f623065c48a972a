"""Random-access reads of an object's bytes, from a file or from memory, with the process's open object files
bounded (docs/FORMAT.md reading rules live in :mod:`deltasync.format.objects`; this is only how bytes arrive).

Why a module of its own: a reader that holds a whole chain open (replay, verify: 64 ranks x 20 steps is 1,280
objects) must not hold a descriptor per object, and a file swapped in under a reader must be refused; both are
about files, not the format.
"""

from __future__ import annotations

import contextlib
import errno
import mmap
import os
import threading
from collections import OrderedDict
from collections.abc import Iterator
from pathlib import Path

from deltasync.errors import FormatError, ResourceLimitError

__all__ = ["Source", "open_for_reading", "resource_error"]


class _Descriptors:
    """The process's open object files, at most ``limit`` at once, least recently used closed first.

    A reader that holds a whole chain open (replay, verify: 64 ranks x 20 steps is 1,280 objects) would otherwise
    hold a descriptor per object and fail under the common limit of 1,024. An object whose descriptor was
    closed is opened again at its next read, and must be the same file (device and inode): a file swapped in
    under the reader is refused. Descriptors in use by a read are never closed under it.
    """

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._lock = threading.RLock()  # re-entrant: an object collected inside a locked section drops itself
        self._open: OrderedDict[int, int] = OrderedDict()  # source id -> descriptor, least recently used first
        self._busy: dict[int, int] = {}  # source id -> reads in progress

    @contextlib.contextmanager
    def fd(self, source: Source) -> Iterator[int]:
        key = id(source)
        with self._lock:
            fd = self._open.get(key)
            if fd is not None:
                self._open.move_to_end(key)
            self._busy[key] = self._busy.get(key, 0) + 1
        try:
            if fd is None:
                fd = source.reopen()
                with self._lock:
                    other = self._open.get(key)
                    if other is not None:  # another thread reopened it meanwhile: keep one
                        os.close(fd)
                        fd = other
                    else:
                        self._open[key] = fd
                    self._trim()
            yield fd
        finally:
            with self._lock:
                left = self._busy.get(key, 1) - 1
                if left:
                    self._busy[key] = left
                else:
                    self._busy.pop(key, None)
                self._trim()

    def add(self, source: Source, fd: int) -> None:
        with self._lock:
            self._open[id(source)] = fd
            self._trim()

    def drop(self, source: Source) -> None:
        with self._lock:
            fd = self._open.pop(id(source), None)
            self._busy.pop(id(source), None)
        if fd is not None:
            os.close(fd)

    def _trim(self) -> None:  # under the lock
        if len(self._open) <= 8:
            return  # under the least limit (below): no need to read the process's limit on every read
        limit = max(8, min(self.limit, _soft_nofile() // 4))  # a quarter of what the process may open, at most
        for key in list(self._open):
            if len(self._open) <= limit:
                return
            if key not in self._busy:
                os.close(self._open.pop(key))


def _soft_nofile() -> int:
    """The process's current limit on open files (it may be lowered at any time: read each time)."""
    try:
        import resource

        soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
        return soft if soft > 0 else 1 << 20
    except (ImportError, OSError, ValueError):  # no resource module (Windows)
        return 1024


_DESCRIPTORS = _Descriptors(limit=256)


class Source:
    """Random-access reads of an object's bytes: a file (``pread`` through the bounded descriptor pool,
    :class:`_Descriptors`) or a buffer in memory."""

    def __init__(self, source: str | Path | bytes | bytearray | memoryview | mmap.mmap) -> None:
        self.path: str | None = None
        self._buf: memoryview | None = None
        self._identity: tuple[int, int] | None = None  # (device, inode) of the file first opened
        self._closed = False
        if isinstance(source, (str, Path)):
            self.path = str(source)
            fd = open_for_reading(self.path)
            st = os.fstat(fd)
            self.size, self._identity = st.st_size, (st.st_dev, st.st_ino)
            _DESCRIPTORS.add(self, fd)
        else:
            self._buf = memoryview(source).cast("B")
            self.size = self._buf.nbytes

    def reopen(self) -> int:
        """The file opened again after the pool closed it: the same file, or a ``FormatError``."""
        assert self.path is not None and not self._closed, "read from a closed object"
        fd = open_for_reading(self.path)
        st = os.fstat(fd)
        if (st.st_dev, st.st_ino) != self._identity or st.st_size != self.size:
            os.close(fd)
            raise FormatError(f"{self.path}: the file was replaced while it was open")
        return fd

    def read_into(self, offset: int, out: memoryview) -> int:
        """Fill ``out`` from ``offset``; returns the bytes read (fewer only at the end of the object)."""
        if self._buf is not None:
            n = max(0, min(out.nbytes, self.size - offset))
            out[:n] = self._buf[offset : offset + n]
            return n
        assert not self._closed, "read from a closed object"
        done = 0
        with _DESCRIPTORS.fd(self) as fd:
            while done < out.nbytes:  # a descriptor shared by threads: pread has no file position
                n = os.preadv(fd, [out[done:]], offset + done)
                if n == 0:
                    break
                done += n
        return done

    def read(self, offset: int, size: int) -> bytearray:
        buf = bytearray(size)
        if self.read_into(offset, memoryview(buf)) != size:
            raise EOFError
        return buf

    def close(self) -> None:
        if self.path is not None and not self._closed:
            self._closed = True
            _DESCRIPTORS.drop(self)
        self._buf = None

    def __del__(self) -> None:  # an object dropped unclosed gives its descriptor back
        try:
            self.close()
        except Exception:  # noqa: BLE001 - at interpreter exit the pool may be gone
            pass


def open_for_reading(path: str) -> int:
    """A read-only descriptor of ``path``; running out of descriptors or memory is a ``ResourceLimitError``."""
    try:
        return os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
    except OSError as e:
        raise resource_error(e, path) from e


def resource_error(e: OSError, path: str) -> OSError:
    """``e`` itself, or a ``ResourceLimitError`` saying which limit was hit (so that callers report it)."""
    if e.errno in (errno.EMFILE, errno.ENFILE):
        return ResourceLimitError(f"{path}: cannot open: the process has too many open files ({e.strerror}); "
                                  f"raise the limit (ulimit -n) or read fewer objects at once")
    return e
