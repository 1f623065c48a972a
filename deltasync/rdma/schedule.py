"""The static schedule: computed once at start from metadata, then reused for every step.

Trainer ranks say which parts of which tensors they hold (a whole tensor when replicated, a range of its
flattened elements when sharded, e.g. FSDP2's ``Shard(0)``); consumers (one per engine rank) say which
checkpoint tensors they need (the names of their routing table: a tensor-parallel rank needs every tensor it
holds a slice of, because delta positions are global). The plan says, for each consumer, which parts to read
from which trainer rank, choosing among replicas the rank with the fewest bytes so far (largest parts
first), so no trainer NIC carries more than it must. Per step the controller only announces the step and
counts acknowledgements; nothing here runs per step.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from deltasync.errors import ScheduleError


@dataclass(frozen=True, order=True)
class TensorSlice:
    """Elements ``start:stop`` of tensor ``name`` flattened (the full checkpoint tensor's coordinates)."""

    name: str
    start: int
    stop: int

    @property
    def numel(self) -> int:
        return self.stop - self.start


@dataclass(frozen=True)
class TensorInfo:
    """A checkpoint tensor: its element count and bytes per element (both trainer-reported)."""

    numel: int
    itemsize: int


@dataclass(frozen=True)
class TrainerRank:
    """What one trainer process holds and serves: ``agent`` names its transfer endpoint."""

    rank: int
    agent: str
    parts: tuple[TensorSlice, ...]


@dataclass(frozen=True)
class Consumer:
    """One reader (an engine rank): ``engine`` groups the consumers whose acknowledgements advance it."""

    id: str
    engine: str
    needs: frozenset[str]


@dataclass(frozen=True)
class Read:
    """One consumer's reads from one trainer rank: the parts, and their dense bytes (the balancing weight)."""

    consumer: str
    rank: int
    parts: tuple[TensorSlice, ...]
    dense_bytes: int


@dataclass(frozen=True)
class Schedule:
    """The plan: reads per consumer, consumers per engine, and each trainer rank's total (dense) bytes."""

    reads: Mapping[str, tuple[Read, ...]]
    engines: Mapping[str, frozenset[str]]
    rank_bytes: Mapping[int, int] = field(default_factory=dict)

    def consumer_bytes(self, consumer: str) -> int:
        return sum(r.dense_bytes for r in self.reads[consumer])


def plan(tensors: Mapping[str, TensorInfo], trainers: Iterable[TrainerRank], consumers: Iterable[Consumer]) -> Schedule:
    """Plan who reads what from whom; raises :class:`ScheduleError` naming the tensor, rank or consumer at fault."""
    trainers, consumers = list(trainers), list(consumers)
    holders = _holders(tensors, trainers)
    load: dict[int, int] = {t.rank: 0 for t in trainers}
    picked: dict[tuple[str, TensorSlice], int] = {}
    wanted = sorted({(c.id, p) for c in consumers for name in _known(c, tensors) for p in _cover(name, holders)},
                    key=lambda cp: (-cp[1].numel * tensors[cp[1].name].itemsize, cp))
    for cid, part in wanted:
        rank = min(holders[part.name][part], key=lambda r: (load[r], r))
        load[rank] += part.numel * tensors[part.name].itemsize
        picked[(cid, part)] = rank
    by: dict[str, dict[int, list[TensorSlice]]] = defaultdict(lambda: defaultdict(list))
    for (cid, part), rank in picked.items():
        by[cid][rank].append(part)
    reads = {
        c.id: tuple(
            Read(c.id, rank, tuple(sorted(parts)), sum(p.numel * tensors[p.name].itemsize for p in parts))
            for rank, parts in sorted(by[c.id].items())
        )
        for c in consumers
    }
    engines: dict[str, set[str]] = defaultdict(set)
    for c in consumers:
        engines[c.engine].add(c.id)
    return Schedule(reads, {e: frozenset(ids) for e, ids in engines.items()}, load)


def _known(consumer: Consumer, tensors: Mapping[str, TensorInfo]) -> list[str]:
    missing = sorted(consumer.needs - tensors.keys())
    if missing:
        raise ScheduleError(f"consumer {consumer.id!r} needs {len(missing)} tensor(s) no trainer rank holds, "
                            f"e.g. {missing[:3]}")
    return sorted(consumer.needs)


def _holders(tensors: Mapping[str, TensorInfo], trainers: list[TrainerRank]) -> dict[str, dict[TensorSlice, list[int]]]:
    """For every tensor, its distinct parts and the ranks holding each; checks the parts tile the tensor."""
    ranks = [t.rank for t in trainers]
    if len(set(ranks)) != len(ranks):
        raise ScheduleError(f"trainer ranks must be distinct, got {sorted(ranks)}")
    holders: dict[str, dict[TensorSlice, list[int]]] = defaultdict(lambda: defaultdict(list))
    for t in trainers:
        for p in t.parts:
            info = tensors.get(p.name)
            if info is None:
                raise ScheduleError(f"trainer rank {t.rank} holds {p.name!r}, which the tensor list lacks")
            if not 0 <= p.start < p.stop <= info.numel:
                raise ScheduleError(f"trainer rank {t.rank}: part {p.start}:{p.stop} of {p.name!r} is outside "
                                    f"0:{info.numel}")
            holders[p.name][p].append(t.rank)
    for name, parts in holders.items():
        edge = 0
        for p in sorted(parts):
            if p.start != edge:
                what = "a gap" if p.start > edge else "overlapping parts"
                raise ScheduleError(f"trainer ranks describe {name!r} with {what} at element {min(edge, p.start)}: "
                                    f"parts {[(q.start, q.stop) for q in sorted(parts)]}")
            edge = p.stop
        if edge != tensors[name].numel:
            raise ScheduleError(f"trainer ranks hold {name!r} only up to element {edge} of {tensors[name].numel}")
    return holders


def _cover(name: str, holders: Mapping[str, Mapping[TensorSlice, list[int]]]) -> list[TensorSlice]:
    if not holders.get(name):
        raise ScheduleError(f"no trainer rank holds {name!r}, which a consumer needs")
    return sorted(holders[name])
