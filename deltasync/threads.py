"""The process's one small thread pool for work across tensors: ``parallel_map`` and ``submit_all``.

Every stage that works tensor by tensor (diff, encode, decode, apply, checksums) maps over this pool: the
numba kernels and zstd release the GIL, so independent items keep every core busy. One pool per process, so
that stages called from one another never multiply threads (a nested map runs in the calling pool thread).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TypeVar

T = TypeVar("T")
R = TypeVar("R")

__all__ = ["parallel_map", "submit_all"]

_local = threading.local()
_pool: ThreadPoolExecutor | None = None
_pool_lock = threading.Lock()


def parallel_map(fn: Callable[[T], R], items: Iterable[T], *, cost: Callable[[T], int] | None = None) -> list[R]:
    """Map over tensors (or ranges of tensors) on a small shared thread pool: the kernels and zstd release the
    GIL, and many independent work items keep every core busy even when another process holds one (unlike
    one kernel split across all cores, which waits for its slowest thread). Called from one of the pool's
    own threads, it maps in that thread (a nested map on a full pool would wait for itself).

    With ``cost``, items start largest first, so that no big one starts last while the other cores idle
    (lm_head and the embeddings hold a third of a step's change); results keep the items' order."""
    items = list(items)
    if len(items) <= 1 or getattr(_local, "in_pool", False):
        return [fn(x) for x in items]
    order = _start_order(items, cost)
    done = dict(zip(order, _executor().map(lambda k: fn(items[k]), order), strict=True))
    return [done[k] for k in range(len(items))]


def submit_all(fn: Callable[[T], R], items: Iterable[T], *, cost: Callable[[T], int] | None = None) -> list[Future[R]]:
    """Like ``parallel_map`` (``cost`` included) but returns the futures, in the items' order, for a caller
    that must know which items finished (an apply that undoes what it wrote when another item fails). Inside
    the pool the items run in order right here, and those after a failed one are cancelled (never started);
    an interrupt propagates."""
    items = list(items)
    if len(items) > 1 and not getattr(_local, "in_pool", False):
        pool = _executor()
        started = {k: pool.submit(fn, items[k]) for k in _start_order(items, cost)}
        return [started[k] for k in range(len(items))]
    futures: list[Future[R]] = [Future() for _ in items]
    for k, (f, x) in enumerate(zip(futures, items, strict=True)):
        try:
            f.set_result(fn(x))
        except Exception as e:  # noqa: BLE001 - reported through the future, as the pool would
            f.set_exception(e)
            for rest in futures[k + 1 :]:
                rest.cancel()
            break
    return futures


def _start_order(items: list[T], cost: Callable[[T], int] | None) -> list[int]:
    """Indices of ``items`` in the order to start them: largest ``cost`` first, else as given."""
    return list(range(len(items))) if cost is None else sorted(range(len(items)), key=lambda k: -cost(items[k]))


def _executor() -> ThreadPoolExecutor:
    global _pool
    if _pool is None:
        with _pool_lock:
            if _pool is None:
                _pool = ThreadPoolExecutor(max_workers=max(1, min(8, os.cpu_count() or 1)),
                                           thread_name_prefix="deltasync-work", initializer=_mark_pool_thread)
    return _pool


def _mark_pool_thread() -> None:
    _local.in_pool = True
