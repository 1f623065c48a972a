"""The engine's rank state (rollout_loader/vllm/state.py) on a hand-built state, no engine: sealed writes, rollback
and checksum parts against the FORMAT.md reference (tests/test_reference.py)."""

from __future__ import annotations

import pytest
import torch

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])  # CI has no GPU; a GPU machine runs both


@pytest.mark.parametrize("device", DEVICES)
def test_sealed_write_lands_the_reference_bits_and_checksums(device: str, tmp_path) -> None:
    """A sealed step (checksums computed before the pause from the bits held and the patch) writes exactly
    ``old ^ xor`` and carries this rank's parts as the FORMAT.md reference computes them from the new bits,
    also for the slices of a fused parameter and for a tensor-parallel shard; a seal older than the last write
    writes nothing; a rollback restores the bits and the parts. No engine: a hand-built rank state."""
    import numpy as np

    from rollout_loader.routing import Route
    from rollout_loader.vllm.layout import TensorHome
    from rollout_loader.vllm.state import WorkerState
    from tests.test_reference import ref_checksum

    def route(*values: object) -> Route:
        keys = ("hf_name", "hf_shape", "param_name", "param_shape", "hf_start", "param_start", "extent")
        return Route(**dict(zip(keys, values, strict=True)))  # type: ignore[arg-type]

    rng = np.random.default_rng(7)
    fused = torch.from_numpy(rng.integers(-2**15, 2**15, (6, 40), dtype=np.int16)).view(torch.bfloat16).to(device)
    shard = torch.from_numpy(rng.integers(-2**15, 2**15, (4, 40), dtype=np.int16)).view(torch.bfloat16).to(device)
    routes = {  # "a" and "b" share one fused parameter; this rank holds rows 4..7 of "c" (it owns them)
        "a": route("a", (4, 40), "fused", (6, 40), (0, 0), (0, 0), (4, 40)),
        "b": route("b", (2, 40), "fused", (6, 40), (0, 0), (4, 0), (2, 40)),
        "c": route("c", (8, 40), "shard", (4, 40), (4, 0), (0, 0), (4, 40)),
    }
    params = {"fused": fused, "shard": shard}
    homes = {n: TensorHome(routes=(r,), bits=params[r.param_name].view(torch.int16).reshape(-1), host=False, modules=())
               for n, r in routes.items()}
    state = WorkerState(model=torch.nn.Module(), reload=lambda w: None, table=None, mode="live", homes=homes)  # type: ignore[arg-type]

    def held(name: str) -> tuple[np.ndarray, np.ndarray]:
        """This rank's elements of checkpoint tensor ``name`` (unsigned bits) and their global flat indices."""
        r = routes[name]
        bits = params[r.param_name].view(torch.int16).cpu().numpy().view(np.uint16)
        rows = bits[r.param_start[0]:r.param_start[0] + r.extent[0]]
        return rows.reshape(-1).copy(), np.arange(r.hf_start[0] * 40, (r.hf_start[0] + r.extent[0]) * 40)

    def patch(name: str, density: float) -> tuple[str, np.ndarray, np.ndarray]:
        n = int(np.prod(routes[name].hf_shape))
        pos = np.flatnonzero(rng.random(n) < density).astype(np.int64)
        return name, pos, rng.integers(1, 2**16, pos.size, dtype=np.uint16)

    def reference(patches: list[tuple[str, np.ndarray, np.ndarray]]) -> dict[str, tuple[np.ndarray, int]]:
        """The bits each tensor holds after ``patches`` (checkpoint positions, XOR) and their checksum part."""
        out = {}
        for name, pos, xor in patches:
            bits, idx = held(name)
            full = np.zeros(int(np.prod(routes[name].hf_shape)), np.uint16)
            full[pos] = xor
            bits ^= full[idx]
            out[name] = (bits, ref_checksum(bits, idx))
        return out

    state.checksums()  # the running parts incremental verification starts from
    before = {n: held(n) for n in routes}
    step1 = [patch("a", 0.3), patch("b", 0.5), patch("c", 0.2)]  # "c": positions on both ranks' rows
    want = reference(step1)
    staged = state.route_patches(step1)
    sealed = state.seal(staged)
    # sealing writes nothing
    assert {n: held(n)[0].tolist() for n in routes} == {n: b.tolist() for n, (b, _) in before.items()}
    sums = state.write_sealed(staged, sealed)
    assert sums == {n: s for n, (_, s) in want.items()}
    assert {n: held(n)[0].tolist() for n in routes} == {n: b.tolist() for n, (b, _) in want.items()}

    assert state.rollback()
    assert {n: held(n)[0].tolist() for n in routes} == {n: b.tolist() for n, (b, _) in before.items()}
    assert {n: state.sums[n] for n in routes} == {n: ref_checksum(b, i) for n, (b, i) in before.items()}
    assert state.write_sealed(staged, sealed) is None  # the rollback moved the bits since the seal: stale
    assert {n: held(n)[0].tolist() for n in routes} == {n: b.tolist() for n, (b, _) in before.items()}

    # sealed again against the bits held now; another write in between makes it stale, and nothing is written
    sealed = state.seal(staged)
    other = [patch("a", 0.1)]
    after_other = reference(other)
    state.write(state.route_patches(other))
    assert state.write_sealed(staged, sealed) is None
    assert held("a")[0].tolist() == after_other["a"][0].tolist()
    assert state.sums["a"] == after_other["a"][1]

    # a write that lands while a seal is being computed (the seal holds no lock then, so that an update never
    # waits for it) makes that seal stale too
    import rollout_loader.vllm.state as state_module

    real_change = state_module.checksum_change
    racing = [patch("b", 0.1)]

    def change_racing_a_write(*args: object) -> int:
        if racing:
            state.write(state.route_patches([racing.pop()]))  # an update on another thread, mid-seal
        return real_change(*args)  # type: ignore[arg-type]

    state_module.checksum_change = change_racing_a_write  # type: ignore[assignment]
    try:
        sealed = state.seal(staged)
    finally:
        state_module.checksum_change = real_change
    held_now = {n: held(n)[0].tolist() for n in routes}
    assert not racing and state.write_sealed(staged, sealed) is None
    assert {n: held(n)[0].tolist() for n in routes} == held_now  # nothing written

    # one patch of a sealed step fails its check (written on the pool beside the others): nothing stays written
    import dataclasses

    from deltasync.errors import TensorMismatchError

    now = {n: held(n)[0].tolist() for n in routes}
    staged = state.route_patches([patch("a", 0.3), patch("b", 0.5), patch("c", 0.2)])
    sealed = state.seal(staged)
    bad = dataclasses.replace(staged[1], idx=staged[1].idx + 10**6)  # past the end of its home
    with pytest.raises(TensorMismatchError):
        state.write_sealed([staged[0], bad, staged[2]], sealed)
    assert {n: held(n)[0].tolist() for n in routes} == now

    # a real delta object decoded, routed and sealed in one pass per tensor (the prefetcher's path): the same
    # staged patches and seal as routing all first and sealing after; its sealed write lands the object's bits
    from deltasync.format.objects import StepObject
    from deltasync.publish.steps import snapshot_headers, write_step
    from deltasync.stages.diff import Snapshot
    from tests.conftest import perturb

    def checkpoint(name: str) -> torch.Tensor:
        """The whole checkpoint tensor: this rank's rows as the engine holds them, the other rows random."""
        r = routes[name]
        full = torch.from_numpy(rng.integers(-2**15, 2**15, r.hf_shape, dtype=np.int16)).view(torch.bfloat16)
        full[r.hf_start[0]:r.hf_start[0] + r.extent[0]] = params[r.param_name][
            r.param_start[0]:r.param_start[0] + r.extent[0]].cpu()
        return full

    old = {n: checkpoint(n) for n in routes}
    snap = Snapshot(old)
    new = {n: perturb(t, 0.2, torch.Generator().manual_seed(3)) for n, t in old.items()}
    path = tmp_path / "1.safetensors"
    write_step(path, kind="delta", step=1, base_step=0, headers=snapshot_headers(snap),
               changes=[c for c in snap.diff(new) if c.changed])
    with StepObject(path, where="step 1") as obj:
        staged = state.route_patches([(p.name, p.positions, p.xor) for p in obj.patches()])
        sealed = state.seal(staged)
        fused, fused_seal = state.stage_object(obj, seal=True)
        assert state.stage_object(obj)[1] is None  # no seal unless asked
    assert fused_seal == sealed

    def flat(st: list) -> list:
        return [(s.name, s.owned, s.idx.tolist(), s.x.tolist(), s.hf_idx.tolist()) for s in st]

    assert flat(fused) == flat(staged)
    sums = state.write_sealed(fused, fused_seal)
    for name, r in routes.items():
        bits, idx = held(name)
        rows = new[name][r.hf_start[0]:r.hf_start[0] + r.extent[0]].reshape(-1).view(torch.int16).numpy()
        assert bits.tolist() == rows.view(np.uint16).tolist()
        assert sums is not None and sums[name] == ref_checksum(bits, idx)


def test_a_tied_pair_is_held_once_whichever_name_the_stream_carries() -> None:
    """A tied head the engine's checkpoint stores is discarded (rollout_loader/routing.py): the engine holds one
    tensor. A step may carry both names (a pushed folder), only the embedding (a tied trainer), or only the head (a
    trainer whose state dict lists it first): the step fits each time, the tensor the engine does not hold is never
    written, and its checksum part is the held one's (a stream whose two tensors differ fails verification)."""
    from types import SimpleNamespace

    from rollout_loader.routing import Route
    from rollout_loader.vllm.layout import TensorHome
    from rollout_loader.vllm.state import WorkerState

    param = torch.arange(32, dtype=torch.float32).reshape(4, 8).bfloat16()
    route = Route(hf_name="embed", hf_shape=(4, 8), param_name="embed", param_shape=(4, 8), hf_start=(0, 0),
                  param_start=(0, 0), extent=(4, 8))

    def state() -> WorkerState:
        home = TensorHome(routes=(route,), bits=param.view(torch.int16).reshape(-1), host=False, modules=())
        return WorkerState(model=torch.nn.Module(), reload=lambda w, m: None, table=None, mode="live",  # type: ignore[arg-type]
                           homes={"embed": home}, aliases={"head": "embed"})

    def header(*names: str) -> SimpleNamespace:
        return SimpleNamespace(tensors={n: SimpleNamespace(shape=[4, 8], itemsize=2, dtype="BF16") for n in names})

    for names in (("embed", "head"), ("embed",), ("head",)):
        s = state()
        s.check_header(header(*names), "step")  # type: ignore[arg-type]
        held = "head" if names == ("head",) else "embed"
        assert set(s.homes) == {held} and set(s.aliases.values()) == {held}
        other = next(iter(s.aliases))
        pos, xor = torch.tensor([3, 9], dtype=torch.int64), torch.tensor([1, 2], dtype=torch.int16)
        assert s.route_patches([(other, pos, xor)]) == []  # checked, never written
        parts = s.checksums([held, other])
        assert parts[held] == parts[other]
        assert s.with_aliases({held: parts[held]}, names) == {n: parts[held] for n in names}


def test_a_converted_tensor_lands_in_its_parameter_as_the_loader_converts_it() -> None:
    """A bf16 checkpoint tensor the loader widens into an fp32 parameter (Qwen3-Next's ``A_log``) is held on the
    host in bf16 (its checksum is the checkpoint's); every write lands in the parameter converted, and a rollback
    puts the parameter back too."""
    from rollout_loader.routing import Route
    from rollout_loader.vllm.layout import TensorHome
    from rollout_loader.vllm.state import WorkerState

    host = torch.randn(6).bfloat16()
    model = torch.nn.Module()
    model.A_log = torch.nn.Parameter(host.float(), requires_grad=False)
    route = Route(hf_name="A_log", hf_shape=(6,), param_name="A_log", param_shape=(6,), hf_start=(0,),
                  param_start=(0,), extent=(6,), casts=(torch.float32,))
    home = TensorHome(routes=(route,), bits=host.view(torch.int16), host=True, modules=(), mirror=(route,))
    s = WorkerState(model=model, reload=lambda w, m: None, table=None, mode="live", homes={"A_log": home},  # type: ignore[arg-type]
                    host={"A_log": host})
    before = model.A_log.detach().clone()
    staged = s.route_patches([("A_log", torch.tensor([1, 4], dtype=torch.int64),
                               torch.tensor([0x40, -0x7000], dtype=torch.int16))])
    s.write(staged)
    assert torch.equal(model.A_log.detach(), host.float()) and not torch.equal(model.A_log.detach(), before)
    assert s.rollback()
    assert torch.equal(model.A_log.detach(), before)


def test_an_fp8_engine_takes_its_representation_and_names_the_other_one() -> None:
    """An FP8 engine's homes take the stream's dtypes, not only their widths (an ``F8_E5M2`` weight or an ``I32``
    scale would be other bits): a per-tensor group's second scale is the first one's (checked, never written), and a
    step in the other representation, or quantized with another plan, is refused saying what to do."""
    from types import SimpleNamespace

    from rollout_loader.routing import Route
    from rollout_loader.vllm.layout import TensorHome
    from rollout_loader.vllm.state import PatchError, WorkerState

    weight = torch.zeros(4, 8, dtype=torch.float8_e4m3fn)
    scale = torch.tensor([0.5])
    w_route = Route(hf_name="q.weight", hf_shape=(4, 8), param_name="qkv.weight", param_shape=(4, 8),
                    hf_start=(0, 0), param_start=(0, 0), extent=(4, 8))
    s_route = Route(hf_name="q.weight_scale", hf_shape=(), hf_grid=(1,), hf_start=(0,), extent=(1,),
                    param_name="qkv.weight_scale", param_shape=(1,), param_grid=(1,), param_start=(0,),
                    param_extent=(1,))
    homes = {"q.weight": TensorHome(routes=(w_route,), bits=weight.view(torch.int8).reshape(-1), host=False,
                                    modules=(), dtype="F8_E4M3"),
             "q.weight_scale": TensorHome(routes=(s_route,), bits=scale.view(torch.int32), host=False, modules=(),
                                          dtype="F32")}

    def state(representation: str) -> WorkerState:
        return WorkerState(model=torch.nn.Module(), reload=lambda w, m: None, table=None, mode="live",  # type: ignore[arg-type]
                           homes=homes, aliases={"k.weight_scale": "q.weight_scale"}, representation=representation)

    def header(**changed: tuple[str, list[int]]) -> SimpleNamespace:
        tensors = {"q.weight": ("F8_E4M3", [4, 8]), "q.weight_scale": ("F32", []), "k.weight_scale": ("F32", []),
                   **changed}
        return SimpleNamespace(tensors={n: SimpleNamespace(dtype=d, shape=s, itemsize={"F8_E4M3": 1, "F8_E5M2": 1,
                                                                                       "BF16": 2}.get(d, 4))
                                        for n, (d, s) in tensors.items()})

    s = state("fp8")
    s.check_header(header(), "step")  # type: ignore[arg-type]
    assert s.route_patches([("k.weight_scale", None, torch.tensor([7], dtype=torch.int32))]) == []
    parts = s.checksums(["q.weight_scale", "k.weight_scale"])
    assert parts["q.weight_scale"] == parts["k.weight_scale"]
    with pytest.raises(PatchError) as e:
        s.check_header(header(**{"q.weight": ("BF16", [4, 8])}), "step")  # type: ignore[arg-type]
    assert "'q.weight': the step has BF16 [4, 8], the engine F8_E4M3 [4, 8]" in str(e.value)
    assert "follow it with representation='checkpoint', or publish the FP8 representation" in str(e.value)
    with pytest.raises(PatchError, match="the step has F8_E5M2 .4, 8., the engine F8_E4M3"):
        s.check_header(header(**{"q.weight": ("F8_E5M2", [4, 8])}), "step")  # type: ignore[arg-type]
    with pytest.raises(PatchError) as e:  # per channel where the engine quantizes per tensor
        s.check_header(header(**{"q.weight_scale": ("F32", [4, 1])}), "step")  # type: ignore[arg-type]
    assert "the step has F32 [4, 1], the engine F32 []" in str(e.value) and "quantize with the engine's own plan" \
        in str(e.value)
    bf16 = {"q.weight": TensorHome(routes=(w_route,), bits=torch.zeros(32, dtype=torch.int16), host=False,
                                   modules=())}
    checkpoint = WorkerState(model=torch.nn.Module(), reload=lambda w, m: None, table=None, mode="live",  # type: ignore[arg-type]
                             homes=bf16)
    with pytest.raises(PatchError) as e:
        checkpoint.check_header(SimpleNamespace(tensors={"q.weight": SimpleNamespace(  # type: ignore[arg-type]
            dtype="F8_E4M3", shape=[4, 8], itemsize=1)}), "step")
    assert "the engine 16-bit [4, 8]" in str(e.value) and "follow it with representation='fp8'" in str(e.value)


def test_positions_are_checked_strictly_ascending_across_every_chunk() -> None:
    """The ascending check runs a chunk at a time on CPU: a repeat or a step back anywhere, at a chunk's edge
    included, is found (against the plain comparison of neighbours)."""
    from rollout_loader.vllm import state

    n = 3 * state._CHUNK + 5
    good = torch.arange(n, dtype=torch.int64) * 3
    assert state._ascending(good)
    assert state._ascending(good[:1]) and state._ascending(good[:2])
    for at in (1, state._CHUNK - 1, state._CHUNK, state._CHUNK + 1, 2 * state._CHUNK, n - 1):
        for bad_value in (good[at - 1].item(), good[at - 1].item() - 1):  # equal, then lower
            bad = good.clone()
            bad[at] = bad_value
            want = bool((bad[1:] > bad[:-1]).all())
            assert not want and state._ascending(bad) is False, at
