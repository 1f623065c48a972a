"""The process's one small thread pool for work across tensors: ``parallel_map`` and ``submit_all``.

Every stage that works tensor by tensor (diff, encode, decode, apply, checksums) maps over this pool: the
numba kernels and zstd release the GIL, so independent items keep every core busy. One pool per process, so
that stages called from one another never multiply threads (a nested map runs in the calling pool thread).
"""

from __future__ import annotations

import itertools
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
    one kernel split across all cores, which waits for its slowest thread). The calling thread works too.
    Called from one of the pool's own threads, it maps in that thread (a nested map on a full pool would wait
    for itself).

    With ``cost``, items start largest first, so that no big one starts last while the other cores idle
    (lm_head and the embeddings hold a third of a step's change); results keep the items' order. Every item
    runs; the first error in the items' order is raised.

    Example: ``parallel_map(tensor_checksum, tensors, cost=lambda t: t.numel())``."""
    items = list(items)
    if len(items) <= 1 or getattr(_local, "in_pool", False):
        return [fn(x) for x in items]
    return [f.result() for f in _drain_all(fn, items, cost, caller_works=True)]


def submit_all(fn: Callable[[T], R], items: Iterable[T], *, cost: Callable[[T], int] | None = None,
               pool: ThreadPoolExecutor | None = None) -> list[Future[R]]:
    """Like ``parallel_map`` (``cost`` included) but returns the futures, in the items' order, for a caller
    that must know which items finished (an apply that undoes what it wrote when another item fails): a
    future cancelled before its item started never starts it. Inside the pool the items run in order right
    here, and those after a failed one are cancelled (never started); an interrupt propagates.

    ``pool``: run on these threads instead of the shared pool (an engine's pause must not queue behind the
    decoding of the next step there)."""
    items = list(items)
    if len(items) > 1 and (pool is not None or not getattr(_local, "in_pool", False)):
        return _drain_all(fn, items, cost, caller_works=False, pool=pool)
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


def _drain_all(fn: Callable[[T], R], items: list[T], cost: Callable[[T], int] | None, *,
               caller_works: bool, pool: ThreadPoolExecutor | None = None) -> list[Future[R]]:
    """Run every item on the pool's threads (and the caller's, with ``caller_works``), each thread taking the
    next item until none is left: one hand-over per thread, not one per item. A step's small tensors (norms,
    biases) take microseconds each, and handing each to a pool thread and back cost more than running it and
    kept two threads slower than one (measured on a step's decode). Returns the futures in the items' order."""
    order = _start_order(items, cost)
    futures: list[Future[R]] = [Future() for _ in items]
    taken = itertools.count()  # next() on a count is atomic under the GIL: each item is taken once

    def drain() -> None:
        for k in taken:
            if k >= len(order):
                return
            f = futures[order[k]]
            if not f.set_running_or_notify_cancel():
                continue  # cancelled by the caller before it started
            try:
                f.set_result(fn(items[order[k]]))
            except Exception as e:  # noqa: BLE001 - reported through the future
                f.set_exception(e)
            except BaseException as e:  # an interrupt: this item failed, and no further item starts
                f.set_exception(e)
                for rest in futures:
                    rest.cancel()
                raise

    pool = pool or _executor()
    helpers = min(pool._max_workers, len(items)) - (1 if caller_works else 0)
    for _ in range(helpers):
        pool.submit(drain)
    if caller_works:
        _local.in_pool = True  # a nested map in the caller's items runs inline, as in the pool's threads
        try:
            drain()
        finally:
            _local.in_pool = False
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
