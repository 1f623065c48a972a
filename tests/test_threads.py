"""The shared work pool: results in order, largest first, every thread (the caller's too) draining one queue,
errors and cancellation as the apply's undo relies on them."""

import threading
import time

import pytest

from deltasync.threads import parallel_map, submit_all


def test_results_keep_the_items_order_and_the_largest_start_first():
    started: list[int] = []
    lock = threading.Lock()

    def work(x: int) -> int:
        with lock:
            started.append(x)
        return x * x

    items = [3, 50, 1, 7, 20, 2, 9]
    assert parallel_map(work, items, cost=lambda x: x) == [x * x for x in items]
    # each thread takes the next item in cost order; with 2+ threads two may swap, never more than that
    first_two = sorted(items, reverse=True)[:2]
    assert set(started[:2]) <= set(sorted(items, reverse=True)[:3]) and set(first_two) & set(started[:2])
    assert sorted(started) == sorted(items)


def test_the_caller_works_too_and_a_nested_map_runs_in_its_thread():
    seen: dict[int, set[str]] = {}

    def inner(x: int) -> str:
        return threading.current_thread().name

    def outer(x: int) -> int:
        me = threading.current_thread().name
        names = set(parallel_map(inner, range(4)))
        seen[x] = names
        assert names == {me}  # nested: inline, never waiting on a pool its own thread occupies
        time.sleep(0.01)
        return x

    assert parallel_map(outer, range(16)) == list(range(16))
    workers = set().union(*seen.values())
    assert threading.current_thread().name in workers  # the caller took items itself


def test_every_item_runs_and_the_first_error_in_item_order_is_raised():
    ran: list[int] = []

    def work(x: int) -> int:
        ran.append(x)
        if x in (2, 5):
            raise ValueError(f"item {x}")
        return x

    with pytest.raises(ValueError, match="item 2"):
        parallel_map(work, range(8))
    assert sorted(ran) == list(range(8))


def test_a_cancelled_future_never_starts_its_item():
    gate = threading.Event()
    ran: list[int] = []

    def work(x: int) -> int:
        gate.wait(10)  # every pool thread holds its first item until the gate opens (at most 8 threads)
        ran.append(x)
        return x

    futures = submit_all(work, range(200))
    cancelled = [f for f in futures[100:] if f.cancel()]
    gate.set()
    results = [f.result() for f in futures if not f.cancelled()]
    assert len(cancelled) == 100  # the pool had not reached them
    assert sorted(ran) == sorted(results) == list(range(100))
    assert all(f.done() for f in futures)


def test_an_interrupt_in_an_item_stops_the_map():
    ran: list[int] = []

    def work(x: int) -> int:
        ran.append(x)
        if x == 0:
            raise KeyboardInterrupt
        time.sleep(0.001)
        return x

    with pytest.raises(KeyboardInterrupt):
        parallel_map(work, range(500))
    time.sleep(0.05)
    assert len(ran) < 500  # the other thread stopped taking items
