"""deltasync.engine tells the truth (issue 32, item 7): the flow its docstring shows, run as written on a real
stream, brings an engine's tensors to each step bit-exact (the reference: the trainer's own weights, cast to bf16),
refuses a step whose patches would not give the trainer's checksums before writing anything, and undoes a write
with the same XOR."""

from __future__ import annotations

import torch

from deltasync import DeltaPublisher, StreamReader
from deltasync.engine import checksum_change, tensor_checksum, xor_apply


def _stream(url: str, steps: int) -> dict[int, dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(7)
    state = {"a": torch.randn(64, 32, generator=g), "b": torch.randn(300, generator=g)}
    truth = {}
    with DeltaPublisher(url, state, dtype=torch.bfloat16, on_backlog="block") as pub:
        for s in range(steps):
            for t in state.values():
                t.add_(torch.randn(t.shape, generator=g) * 1e-2 * (torch.rand(t.shape, generator=g) < 0.1))
            pub.publish(s)
            truth[s] = {n: t.bfloat16() for n, t in state.items()}
    return truth


def test_the_documented_flow_follows_a_stream_bit_exact(tmp_path):
    url = str(tmp_path / "s")
    truth = _stream(url, 4)
    with StreamReader(url) as reader:
        bits = {n: t.clone() for n, t in reader.state_dict(0).items()}  # the engine, at step 0
        sums = {n: tensor_checksum(t) for n, t in bits.items()}
        for step in range(1, 4):
            with reader.open(step, base=step - 1) as obj:
                patches = obj.patches()
            assert patches and all(p.positions is not None for p in patches)
            for p in patches:  # sealed ahead, as the docstring does it
                pos, x = torch.from_numpy(p.positions), torch.from_numpy(p.xor)
                assert (sums[p.name] + checksum_change(bits[p.name], pos, x, pos)) % 2**64 == p.checksum
            before = {n: t.clone() for n, t in bits.items()}
            for p in patches:
                xor_apply(bits[p.name], p.positions, p.xor, checksum=False)
                sums[p.name] = p.checksum
            for n, t in bits.items():
                assert torch.equal(t.view(torch.int16), truth[step][n].view(torch.int16)), (step, n)
            for p in patches:  # the same XOR again undoes the write
                xor_apply(bits[p.name], p.positions, p.xor, checksum=False)
            assert all(torch.equal(bits[n].view(torch.int16), before[n].view(torch.int16)) for n in bits)
            for p in patches:
                xor_apply(bits[p.name], p.positions, p.xor, checksum=False)


def test_the_seal_refuses_a_step_on_the_wrong_base_before_writing(tmp_path):
    url = str(tmp_path / "s")
    _stream(url, 3)
    with StreamReader(url) as reader:
        bits = {n: t.clone() for n, t in reader.state_dict(0).items()}  # step 0 held; step 2's delta is on step 1
        sums = {n: tensor_checksum(t) for n, t in bits.items()}
        with reader.open(2, base=1) as obj:
            patches = obj.patches()
    sealed = [(sums[p.name] + checksum_change(bits[p.name], torch.from_numpy(p.positions), torch.from_numpy(p.xor),
                                              torch.from_numpy(p.positions))) % 2**64 == p.checksum for p in patches]
    assert not all(sealed)
