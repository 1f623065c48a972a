"""The static schedule: every consumer gets exactly the parts covering its needs, each from a rank that holds
it, trainer load balanced across replicas; inconsistent metadata is refused by name. Checked against
properties computed here from the inputs, not with the planner's own helpers."""

from __future__ import annotations

import itertools
import random

import pytest

from deltasync.errors import ScheduleError
from deltasync.rdma.schedule import Consumer, TensorInfo, TensorSlice, TrainerRank, plan


def _qwen_like(layers: int = 3) -> dict[str, TensorInfo]:
    names = ["model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"]
    for i in range(layers):
        names += [f"model.layers.{i}.self_attn.{x}_proj.weight" for x in "qkvo"]
        names += [f"model.layers.{i}.mlp.{x}_proj.weight" for x in ("gate", "up", "down")]
        names += [f"model.layers.{i}.input_layernorm.weight"]
    rng = random.Random(0)
    return {n: TensorInfo(numel=rng.choice([64, 4096, 65536]), itemsize=2) for n in names}


def _check_exact_cover(tensors, trainers, consumers, schedule):
    held = {(t.rank, p) for t in trainers for p in t.parts}
    for c in consumers:
        got: dict[str, list[tuple[int, int]]] = {}
        for read in schedule.reads[c.id]:
            assert read.consumer == c.id
            assert read.dense_bytes == sum(p.numel * tensors[p.name].itemsize for p in read.parts)
            for p in read.parts:
                assert (read.rank, p) in held, f"{c.id} reads {p} from rank {read.rank}, which does not hold it"
                got.setdefault(p.name, []).append((p.start, p.stop))
        assert set(got) == set(c.needs)
        for name, ranges in got.items():
            ranges.sort()
            assert ranges[0][0] == 0 and ranges[-1][1] == tensors[name].numel
            assert all(a[1] == b[0] for a, b in itertools.pairwise(ranges)), f"{name}: {ranges}"


def test_replicated_tensors_are_balanced_across_ranks():
    tensors = _qwen_like()
    trainers = [TrainerRank(r, f"trainer-{r}", tuple(TensorSlice(n, 0, i.numel) for n, i in tensors.items()))
                for r in range(4)]
    consumers = [Consumer(f"engine0-tp{r}", "engine0", frozenset(tensors)) for r in range(2)]
    s = plan(tensors, trainers, consumers)
    _check_exact_cover(tensors, trainers, consumers, s)
    loads = sorted(s.rank_bytes.values())
    biggest = max(i.numel * i.itemsize for i in tensors.values())
    assert sum(loads) == 2 * sum(i.numel * i.itemsize for i in tensors.values())
    assert loads[-1] - loads[0] <= biggest  # greedy largest-first: within one part of even
    assert s.engines == {"engine0": frozenset({"engine0-tp0", "engine0-tp1"})}


def test_sharded_tensors_are_read_from_every_shard_owner():
    tensors = {"w": TensorInfo(100, 2), "b": TensorInfo(10, 4)}
    trainers = [TrainerRank(0, "a", (TensorSlice("w", 0, 50), TensorSlice("b", 0, 10))),
                TrainerRank(1, "b", (TensorSlice("w", 50, 100),))]
    consumers = [Consumer("c0", "e", frozenset({"w"})), Consumer("c1", "e", frozenset({"w", "b"}))]
    s = plan(tensors, trainers, consumers)
    _check_exact_cover(tensors, trainers, consumers, s)
    assert {r.rank for r in s.reads["c0"]} == {0, 1}
    assert s.consumer_bytes("c1") == 100 * 2 + 10 * 4


def test_tensor_parallel_ranks_read_whole_fused_sources():
    """A TP rank holding a slice of a fused qkv parameter needs q, k and v whole: delta positions are global."""
    tensors = _qwen_like(layers=1)
    fused = {f"model.layers.0.self_attn.{x}_proj.weight" for x in "qkv"}
    trainers = [TrainerRank(0, "t0", tuple(TensorSlice(n, 0, i.numel) for n, i in tensors.items()))]
    consumers = [Consumer(f"tp{r}", "e", frozenset(fused)) for r in range(2)]
    s = plan(tensors, trainers, consumers)
    _check_exact_cover(tensors, trainers, consumers, s)
    for c in consumers:
        assert {p.name for r in s.reads[c.id] for p in r.parts} == fused


@pytest.mark.parametrize("seed", range(20))
def test_random_layouts_cover_exactly(seed):
    rng = random.Random(seed)
    tensors = {f"t{i}": TensorInfo(rng.randint(1, 1000), rng.choice([1, 2, 4])) for i in range(rng.randint(1, 12))}
    ranks = rng.randint(1, 5)
    parts: dict[int, list[TensorSlice]] = {r: [] for r in range(ranks)}
    for name, info in tensors.items():
        cuts = sorted(rng.sample(range(1, info.numel), min(info.numel - 1, rng.randint(0, 3)))) \
            if info.numel > 1 else []
        edges = [0, *cuts, info.numel]
        for a, b in itertools.pairwise(edges):
            for r in rng.sample(range(ranks), rng.randint(1, ranks)):  # replicated on 1..ranks ranks
                parts[r].append(TensorSlice(name, a, b))
    trainers = [TrainerRank(r, f"t{r}", tuple(ps)) for r, ps in parts.items()]
    consumers = [Consumer(f"c{i}", f"e{i % 2}", frozenset(rng.sample(sorted(tensors), rng.randint(1, len(tensors)))))
                 for i in range(rng.randint(1, 4))]
    s = plan(tensors, trainers, consumers)
    _check_exact_cover(tensors, trainers, consumers, s)
    assert sum(s.rank_bytes.values()) == sum(s.consumer_bytes(c.id) for c in consumers)


@pytest.mark.parametrize(
    ("trainers", "needs", "match"),
    [
        ([TrainerRank(0, "a", (TensorSlice("w", 0, 40),)), TrainerRank(1, "b", (TensorSlice("w", 60, 100),))], {"w"},
         "a gap at element 40"),
        ([TrainerRank(0, "a", (TensorSlice("w", 0, 60),)), TrainerRank(1, "b", (TensorSlice("w", 50, 100),))], {"w"},
         "overlapping"),
        ([TrainerRank(0, "a", (TensorSlice("w", 0, 80),))], {"w"}, "only up to element 80"),
        ([TrainerRank(0, "a", (TensorSlice("w", 0, 101),))], {"w"}, "outside 0:100"),
        ([TrainerRank(0, "a", (TensorSlice("x", 0, 1),))], {"w"}, "'x', which the tensor list lacks"),
        ([TrainerRank(0, "a", (TensorSlice("w", 0, 100),))], {"w", "nope"}, "needs 1 tensor"),
        ([TrainerRank(0, "a", ())], {"w"}, "no trainer rank holds 'w'"),
        ([TrainerRank(0, "a", (TensorSlice("w", 0, 100),)), TrainerRank(0, "b", ())], {"w"}, "distinct"),
    ],
)
def test_inconsistent_metadata_is_refused_by_name(trainers, needs, match):
    with pytest.raises(ScheduleError, match=match):
        plan({"w": TensorInfo(100, 2)}, trainers, [Consumer("c", "e", frozenset(needs))])
