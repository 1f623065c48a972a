"""How deltasync's CPU kernels are compiled (numba), and where they are kept, so that they compile once per machine
and version.

numba's default cache sits beside the source (``__pycache__`` inside the installed package) and trusts a cache
entry while the source file's modification time and size are unchanged. Both fail users: ``pip install
'./deltasync[EXTRA]'`` reinstalls the package, which removes that folder and rewrites every file with a new
time, so each extra added meant another minute of compiling. Here instead:

- the cache is a user cache folder, as numba's own user-wide cache is: ``$NUMBA_CACHE_DIR/deltasync-kernels``
  when that variable is set (numba's convention for choosing where caches go), else the platform's user cache
  (``~/.cache/deltasync/kernels`` on Linux, honouring ``XDG_CACHE_HOME``);
- an entry is keyed by the SHA-256 of the kernels' source (both kernel modules: a kernel of one calls the other's),
  not by file times: a reinstall of the same version finds it, a changed kernel never does (its folder is another);
- where that folder cannot be written (a read-only home in a container), numba's own places are used, as before.

``deltasync warm`` fills it ahead of time; ``deltasync env`` says where it is and whether it is filled.
"""

from __future__ import annotations

import hashlib
import os
import sys
from collections.abc import Callable
from functools import cache
from pathlib import Path
from typing import Any

import numba
import numpy as np
from numba.core import caching

SOURCES = ("_kernels.py", "_byte_kernels.py", "_simd.py", "_kernel_cache.py")  # the kernels, how they are compiled
HERE = Path(__file__).resolve().parent


@cache
def source_digest() -> str:
    """SHA-256 of the kernel modules' source, together: what a cache entry was compiled from."""
    h = hashlib.sha256()
    for name in SOURCES:
        h.update(name.encode() + b"\0" + (HERE / name).read_bytes() + b"\0")
    return h.hexdigest()


def cache_root() -> Path:
    """The folder that holds every version's kernels (``$NUMBA_CACHE_DIR/deltasync-kernels``, else the user's
    cache folder for deltasync)."""
    chosen = os.environ.get("NUMBA_CACHE_DIR")
    if chosen:
        return Path(chosen) / "deltasync-kernels"
    from numba.misc.appdirs import AppDirs

    return Path(AppDirs(appname="deltasync", appauthor=False).user_cache_dir) / "kernels"


def cache_dir() -> Path:
    """This source's kernels for this Python and numba: one folder, so that versions never overwrite each other's
    (numba names the files by function; the CPU is part of each entry's key)."""
    python = f"py{sys.version_info[0]}{sys.version_info[1]}"
    return cache_root() / f"{python}-numba{numba.__version__}-{source_digest()[:16]}"


class _Locator(caching._CacheLocator):
    """numba's cache locator for deltasync's kernel modules: :func:`cache_dir`, entries stamped by source digest."""

    def __init__(self, py_func: Any, py_file: str) -> None:
        self._py_file = py_file
        self._lineno = py_func.__code__.co_firstlineno
        self._path = str(cache_dir())

    def get_cache_path(self) -> str:
        return self._path

    def get_source_stamp(self) -> str:
        return source_digest()

    def get_disambiguator(self) -> str:
        return str(self._lineno)

    @classmethod
    def from_function(cls, py_func: Any, py_file: str) -> _Locator | None:
        path = Path(py_file).resolve()
        if path.parent != HERE or path.name not in SOURCES:
            return None
        locator = cls(py_func, py_file)
        try:
            locator.ensure_cache_path()
        except OSError:  # not writable here: numba's own locators decide
            return None
        return locator


class _Impl(caching.CompileResultCacheImpl):
    _locator_classes = [_Locator, *caching.CompileResultCacheImpl._locator_classes]


class _FunctionCache(caching.FunctionCache):
    _impl_class = _Impl


def use_kernel_cache(dispatcher: Any) -> Any:
    """Cache ``dispatcher`` (a numba function compiled with ``cache=False``) in deltasync's kernel cache; returns
    it. Where no folder at all can be written, it stays uncached (it compiles in every process)."""
    try:
        dispatcher._cache = _FunctionCache(dispatcher.py_func)
    except RuntimeError:  # "no locator available": nothing writable anywhere
        pass
    return dispatcher


def cache_state() -> dict[str, Any]:
    """What ``deltasync env`` reports: the folder, whether it can be written, how many kernels are cached there
    for this source (numba's index files; 0: the next first use compiles), and whether the 2-byte diff runs on
    AVX-512 (``vector_diff``: this CPU has VBMI2, see ``_simd``) or the portable kernel."""
    from deltasync.format import _simd

    where = cache_dir()
    indexes = sorted(where.glob("*.nbi")) if where.is_dir() else []
    probe = where if where.is_dir() else cache_root()
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    return {"dir": str(where), "writable": os.access(probe, os.W_OK), "cached_kernels": len(indexes),
            "source_sha256": source_digest(), "vector_diff": _simd.COMPRESS16}


def jit(fn: Callable[..., Any]) -> Any:
    """A compiled kernel, cached on disk where it survives reinstalls (this module)."""
    return use_kernel_cache(numba.njit(cache=False, nogil=True, boundscheck=False)(fn))


def pjit(fn: Callable[..., Any]) -> Any:
    """A compiled ``prange`` kernel (its loops split across cores), cached as :func:`jit`'s are."""
    return use_kernel_cache(numba.njit(cache=False, nogil=True, boundscheck=False, parallel=True)(fn))


def read_only(a: np.ndarray) -> np.ndarray:
    """``a`` as a read-only view. numba compiles a kernel once per writability of each array argument, and
    inputs arrive both ways (views of immutable object bytes, writable buffers): the kernel modules' wrappers hand
    every input-only array over read-only, so each kernel compiles once per dtype instead of twice."""
    if not a.flags.writeable:
        return a
    view = a.view()
    view.flags.writeable = False
    return view
