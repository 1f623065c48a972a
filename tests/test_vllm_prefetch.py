"""The engine's prefetcher (rollout_loader/vllm/prefetch.py) on hand-built rank states over a real local stream, no
engine: one watcher per engine. The first tensor-parallel rank watches the stream and tells the other what to stage,
so a step is discovered once per engine (one watch polling the store, one chain resolution), not once per rank;
each rank stages and seals its own slices, and a sealed write lands the trainer's bits with the checksums the
FORMAT.md reference (tests/test_reference.py) computes."""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch

from deltasync import DeltaPublisher, StreamReader
from deltasync.errors import FormatError
from deltasync.follow.watch import PollPolicy
from tests.conftest import perturb
from tests.test_reference import ref_checksum
from tests.test_watch import _counting

SHAPES = {"a": (4, 40), "b": (2, 40), "c": (8, 40)}  # "c" is split by rows between two ranks, "a" and "b" are whole
FAST = PollPolicy(fast_s=0.05, idle_max_s=0.2, retry_max_s=0.2)


def _steps(url: str, n: int) -> dict[int, dict[str, torch.Tensor]]:
    """A stream of ``n`` steps (an anchor, then deltas); the trainer's weights at each."""
    g = torch.Generator().manual_seed(0)
    state = {k: torch.randn(s, generator=g).bfloat16() for k, s in SHAPES.items()}
    truth = {}
    with DeltaPublisher(url, state, on_backlog="block") as pub:
        for step in range(n):
            if step:
                for k in state:
                    state[k].copy_(perturb(state[k], 0.2, g))
            truth[step] = {k: v.clone() for k, v in state.items()}
            pub.publish(step)
    return truth


def _rows(name: str, rank: int) -> tuple[int, int]:
    return (4 * rank, 4) if name == "c" else (0, SHAPES[name][0])


def _rank_state(weights: dict[str, torch.Tensor], rank: int):
    """Rank ``rank``'s state: whole "a" and "b", rows 4*rank.. of "c", holding ``weights``' bits."""
    from rollout_loader.routing import Route
    from rollout_loader.vllm.layout import TensorHome
    from rollout_loader.vllm.state import WorkerState

    homes = {}
    for name, shape in SHAPES.items():
        start, rows = _rows(name, rank)
        param = weights[name][start:start + rows].clone()
        route = Route(hf_name=name, hf_shape=shape, param_name=name, param_shape=tuple(param.shape),
                      hf_start=(start, 0), param_start=(0, 0), extent=(rows, shape[1]))
        homes[name] = TensorHome(routes=(route,), bits=param.view(torch.int16).reshape(-1), host=False, modules=(),
                                 hf_shape=shape)
    state = WorkerState(model=torch.nn.Module(), reload=lambda w, m: None, table=None, mode="live",  # type: ignore[arg-type]
                        homes=homes)
    state.checksums()  # the running parts a seal starts from
    return state


def _lands(state, rank: int, want: dict[str, torch.Tensor], sums: dict[str, int]) -> None:
    """The rank's bits are the trainer's rows, and its checksum parts the reference's over them."""
    for name, shape in SHAPES.items():
        start, rows = _rows(name, rank)
        bits = state.homes[name].bits.numpy().view(np.uint16)
        expected = want[name][start:start + rows].reshape(-1).view(torch.int16).numpy().view(np.uint16)
        assert bits.tolist() == expected.tolist(), (rank, name)
        idx = np.arange(start * shape[1], (start + rows) * shape[1])
        if name in sums:
            assert sums[name] == ref_checksum(bits, idx), (rank, name)


def _eventually(predicate, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "not reached in time"
        time.sleep(0.01)


def test_one_rank_watches_the_stream_and_every_rank_stages_its_slices(tmp_path) -> None:
    from rollout_loader.vllm.prefetch import PlanBoard, Prefetcher

    url = str(tmp_path / "stream")
    truth = _steps(url, 3)
    states = [_rank_state(truth[0], r) for r in (0, 1)]
    held = [0, 0]
    readers = [StreamReader(url), StreamReader(url)]
    calls = [_counting(r) for r in readers]
    board = PlanBoard.serve(1)
    port, token = board.address
    joined = PlanBoard.join("127.0.0.1", port, token)
    ranks = [Prefetcher(readers[0], states[0], lambda: held[0], policy=FAST, board=board),
             Prefetcher(readers[1], states[1], lambda: held[1], policy=FAST, plans=joined)]
    try:
        _eventually(lambda: all(p.has(1) for p in ranks))  # the chain 0 -> 2 starts at 1, sealed on both ranks
        # discovered once per engine: one watch polls the store and resolves the chain; the other rank reads
        # only what staging needs (the steps' manifests and objects), never the hint, never a listing
        assert ranks[0].watch is not None and ranks[1].watch is None
        assert ranks[0].watch.polls >= 1 and calls[0]["get", "latest.json"] >= 1
        assert not [k for k in calls[1] if k[0] == "list" or k[1] == "latest.json"], calls[1]
        assert ranks[1].feed is not None and ranks[1].feed.received >= 1
        for step in (1, 2):
            for rank, p in enumerate(ranks):
                prepared = p.take(step)
                assert prepared is not None and prepared.staged is not None and prepared.seal is not None
                sums = states[rank].write_sealed(prepared.staged, prepared.seal)
                assert sums is not None  # the seal was taken against the bits held: a plain scatter
                _lands(states[rank], rank, truth[step], sums)
                held[rank] = step
                p.wake()  # the engine moved: the first rank posts a plan from the new step, each rank seals it
            if step == 1:
                _eventually(lambda: all(p.has(2) for p in ranks))
        polls = ranks[0].watch.polls
        assert not [k for k in calls[1] if k[0] == "list" or k[1] == "latest.json"], calls[1]
        assert polls >= 2  # the first rank looked again after each move; the other never looked at the store
    finally:
        for p in ranks:
            p.stop()
        for r in readers:
            r.close()


def test_the_board_admits_only_ranks_with_the_token_and_only_plans() -> None:
    from rollout_loader.vllm.prefetch import PlanBoard, StagePlan

    board = PlanBoard.serve(2)
    port, token = board.address
    stranger = PlanBoard.join("127.0.0.1", port, "00" * 32)  # a wrong token: never admitted, hears nothing
    rank = PlanBoard.join("127.0.0.1", port, token)
    try:
        plan = StagePlan(held=3, steps=(4, 5))
        deadline = time.monotonic() + 30
        got = None
        while got is None:
            assert time.monotonic() < deadline
            board.post(plan)
            got = rank.receive()
        assert got == plan
        with pytest.raises((ConnectionError, OSError)):  # refused: the board closed its connection
            while stranger.receive() is None:
                assert time.monotonic() < deadline
    finally:
        for b in (stranger, rank, board):
            b.close()
    for raw in (b"not json", b"[1, 2]", b'{"held": 3, "steps": [5, 4]}', b'{"held": 5, "steps": [4]}',
                b'{"held": -1, "steps": []}', b'{"held": 1, "steps": [2, true]}',
                b'{"held": 0, "steps": ' + str(list(range(1, 40))).encode() + b"}"):
        with pytest.raises(FormatError, match="stage plan"):
            StagePlan.decode(raw, "test")
    assert StagePlan.decode(b'{"held": null, "steps": [7]}', "test") == StagePlan(held=None, steps=(7,))
