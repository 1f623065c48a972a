"""The cheapest way from the step a reader holds to a target step (docs/FORMAT.md sections 6 and 5g).

A way is a list of hops, each an object whose base is the step before it: a step's own delta, an anchor's own
delta, a catch-up delta, or an anchor (which needs no base). The planner is a shortest path over those hops,
weighed in bytes, searched backwards from the target (Dijkstra): it reads a step's manifest only when the step
is the cheapest one left to explore, so that a catch-up spanning many steps spares the reads of the manifests
it jumps over, and it stops as soon as the step held (or the start of an anchor) is reached at the lowest cost.
Planning is apart from I/O: manifests and catch-ups come in through two functions.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

from deltasync.errors import StepNotFoundError
from deltasync.format.documents import Manifest

__all__ = ["Hop", "cheapest_chain"]

HopKind = Literal["anchor", "delta", "anchor-delta", "catchup"]
_ORIGIN = -1  # the node "nothing held": an anchor is a hop from it


@dataclass(frozen=True)
class Hop:
    """One object of a way: it takes the state at ``base`` (None: nothing, for an anchor) to ``step``."""

    step: int
    base: int | None
    kind: HopKind
    nbytes: int


def cheapest_chain(
    step: int,
    *,
    start: int | None,
    manifest: Callable[[int], Manifest],
    catchups: Callable[[int], list[tuple[int, int]]] | None = None,
    max_walk: int = 64,
    anchors: bool = True,
) -> list[Hop]:
    """The hops, in order, of fewest bytes that lead to ``step``: from ``start`` (the step held; None: nothing held)
    or from an anchor.

    ``manifest(s)`` reads step ``s``'s manifest (``StepNotFoundError`` where it is gone); ``catchups(s)`` lists the
    catch-ups into ``s`` as ``(base_step, bytes)``. Steps below the newest anchor explored are explored only to
    reach ``start``, at most ``max_walk`` of them. Raises ``StepNotFoundError`` when no way exists (the chain to
    ``step`` is broken before any anchor is reached).
    """
    if start == step:
        return []  # held already: nothing to open
    if start is not None and start > step:
        start = None  # a consumer past the target goes back from an anchor
    cost: dict[int, int] = {step: 0}
    via: dict[int, Hop] = {}  # node -> the hop that leaves it toward ``step`` on the cheapest way found
    heap: list[tuple[int, int]] = [(0, -step)]  # ties: the newer step first (fewer manifests to read)
    done: set[int] = set()
    anchor: int | None = None  # the newest anchor explored so far
    below = 0  # steps explored below it
    gone: tuple[int, StepNotFoundError] | None = None  # the first step found missing on the way

    def reach(node: int, c: int, hop: Hop) -> None:
        if c < cost.get(node, c + 1):
            cost[node] = c
            via[node] = hop
            heapq.heappush(heap, (c, -node))

    while heap:
        c, neg = heapq.heappop(heap)
        s = -neg
        if s in done or c > cost.get(s, c):
            continue
        done.add(s)
        if s == _ORIGIN or s == start:
            return _walk(s, via, step)
        if start is not None and s < start:
            continue  # below the step held: only an anchor could lead there, and one nearer is cheaper
        if anchor is not None and s < anchor:
            if start is None or below >= max_walk:
                continue
            below += 1
        try:
            m = manifest(s)
        except StepNotFoundError as e:
            if s == step:
                raise
            gone = gone or (s, e)  # another way (an anchor, a catch-up) may still serve
            continue
        if m.kind == "anchor":
            if anchors:
                anchor = s if anchor is None else max(anchor, s)
                reach(_ORIGIN, c + m.object_bytes, Hop(s, None, "anchor", m.object_bytes))
            if m.delta is not None:
                reach(m.delta.base_step, c + m.delta.object_bytes,
                      Hop(s, m.delta.base_step, "anchor-delta", m.delta.object_bytes))
        else:
            assert m.base_step is not None
            reach(m.base_step, c + m.object_bytes, Hop(s, m.base_step, "delta", m.object_bytes))
        for base, nbytes in catchups(s) if catchups is not None else ():
            if base < s and (start is None or base >= start):
                reach(base, c + nbytes, Hop(s, base, "catchup", nbytes))
    broken = f" at step {gone[0]}: {gone[1]}" if gone is not None else " before any anchor"
    raise StepNotFoundError(f"the chain to step {step} is broken{broken}")


def _walk(node: int, via: dict[int, Hop], step: int) -> list[Hop]:
    hops = []
    while node != step:
        hop = via[node]
        hops.append(hop)
        node = hop.step
    return hops
