"""A folder on this machine (plain paths and ``file://`` URLs): objects are files, read in place.

Every write goes to a temporary name, is fsynced, then renamed into place (readers never see half a file).
Create-only is ``link(2)`` of the complete temporary file (it fails if the name exists: never replaces a
file); compare-and-swap holds an ``flock`` on a sibling lock file (atomic among processes of one machine).
"""

from __future__ import annotations

import builtins
import fcntl
import os
import shutil
import stat
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, BinaryIO

from deltasync.errors import FormatError
from deltasync.transports.base import (
    Capabilities,
    Data,
    Entry,
    Transport,
    check_key,
    content_version,
    copy_bounded,
    copy_to_temporary,
    too_large,
)


def _umask() -> int:
    try:  # Linux tells it without changing it
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except OSError:
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


UMASK = _umask()


def share(path: str | Path) -> None:
    """Give a file made under a private temporary name the permissions the umask asks for (temporary files
    are 0600: an inference server running as another user could not read the store)."""
    os.chmod(path, 0o666 & ~UMASK)


def _open_regular(path: str) -> BinaryIO:
    """``path`` opened for reading if it is a regular file. Opened without blocking and checked on the open
    descriptor (no race with a swap): a FIFO where a document belongs would block every reader for ever, a
    folder would raise a builtin error; either is a ``FormatError`` naming what was found."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            kind = {stat.S_IFIFO: "a FIFO", stat.S_IFDIR: "a folder", stat.S_IFSOCK: "a socket",
                    stat.S_IFCHR: "a character device", stat.S_IFBLK: "a block device"}.get(stat.S_IFMT(mode), "not a "
                                                                                                               "file")
            raise FormatError(f"{path}: expected a regular file, found {kind}")
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


@contextmanager
def _locked(path: str) -> Iterator[None]:
    """An exclusive lock on ``path`` for processes of this machine (a sibling ``.lock`` file)."""
    lock = f"{os.path.dirname(path)}/.{os.path.basename(path)}.lock"
    fd = os.open(lock, os.O_CREAT | os.O_RDWR, 0o666)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


class LocalTransport(Transport):
    """Objects as files under the folder ``root`` (created on the first write)."""

    capabilities = Capabilities(create_only=True, compare_and_swap=True, local_files=True)

    def __init__(self, root: str | Path) -> None:
        self.root = os.path.abspath(os.path.expanduser(str(root))).rstrip("/") or "/"

    def _path(self, key: str) -> str:
        return os.path.join(self.root, check_key(key)) if key else self.root

    def put(self, key: str, data: Data, *, if_absent: bool = False, if_version: str | None = None) -> None:
        path = self._path(key)
        folder, name = os.path.split(path)
        os.makedirs(folder, exist_ok=True)
        if isinstance(data, Path) and not (if_absent or if_version is not None):
            self._move_in(data, path)
            return
        tmp = copy_to_temporary(data, folder, name)
        share(tmp)
        try:
            if if_absent:
                os.link(tmp, path)  # atomic, and fails if the name exists: never replaces a file
            elif if_version is not None:
                with _locked(path):
                    try:
                        current = content_version(Path(path).read_bytes())
                    except FileNotFoundError:
                        current = None
                    if current != if_version:
                        raise FileExistsError(f"{path} changed since it was read")
                    os.replace(tmp, path)
            else:
                os.replace(tmp, path)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)

    def _move_in(self, local: Path, path: str) -> None:
        """Publish a whole local file: renamed into place (consumed), copied where it lies on another filesystem."""
        with open(local, "rb+") as f:
            os.fsync(f.fileno())
        share(local)
        try:
            os.replace(local, path)
        except OSError:  # another filesystem: copy under a temporary name, then rename
            folder, name = os.path.split(path)
            tmp = copy_to_temporary(local, folder, name)
            share(tmp)
            os.replace(tmp, path)

    def get(self, key: str, *, start: int = 0, end: int | None = None) -> bytes:
        with _open_regular(self._path(key)) as f:
            f.seek(start)
            if end is None:
                return f.read()
            # read(n) allocates n bytes first: a bounded read of a small file (a 2 KB manifest read with a
            # 64 MiB limit) must not allocate the limit
            return f.read(max(0, min(end, os.fstat(f.fileno()).st_size) - start))

    def get_file(self, key: str, local: Path, *, max_bytes: int | None = None) -> None:
        with _open_regular(self._path(key)) as src:
            size = os.fstat(src.fileno()).st_size  # the file opened, not its name: a swap cannot slip past
            if max_bytes is not None and size > max_bytes:
                raise too_large(key, max_bytes, size)
            with open(local, "wb") as dst:
                copy_bounded(src, dst, key, max_bytes=max_bytes, chunk_bytes=1 << 20)  # a file that grows, too

    def list(self, prefix: str = "") -> list[Entry]:
        base = self._path(prefix.rstrip("/"))
        out = []
        for folder, _, files in os.walk(base):
            for name in files:
                path = os.path.join(folder, name)
                try:
                    st = os.stat(path)
                except FileNotFoundError:  # removed while listed
                    continue
                out.append(Entry(os.path.relpath(path, self.root).replace(os.sep, "/"), st.st_size, st.st_mtime))
        return out

    def exists(self, key: str) -> bool:
        return os.path.exists(self._path(key))

    def children(self, prefix: str = "") -> builtins.list[str]:
        try:
            return sorted(os.listdir(self._path(prefix.rstrip("/"))))
        except NotADirectoryError:
            return []

    def delete(self, key: str) -> None:
        try:
            os.unlink(self._path(key))
        except FileNotFoundError:
            pass

    def delete_tree(self, prefix: str) -> None:
        path = self._path(prefix.rstrip("/"))
        if os.path.isdir(path):
            shutil.rmtree(path)
        else:
            self.delete(prefix)

    def local_path(self, key: str) -> Path:
        return Path(self._path(key))


def open_local(url: str, storage_options: dict[str, Any]) -> LocalTransport:
    """``/path``, ``path`` or ``file:///path`` (``local://`` too); storage options are not used by folders."""
    path = url.split("://", 1)[1] if "://" in url else url
    return LocalTransport(path)
