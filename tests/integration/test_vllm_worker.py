"""The vLLM worker extension against a real (CPU) engine: delta objects (docs/FORMAT.md, the only wire format)
land bit-exactly, generation matches a fresh engine loaded with the new weights, rollback is exact, and bad
input changes nothing."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

pytest.importorskip("vllm")

from deltasync import DeltaPublisher, FormatError, StreamReader
from deltasync import tensor_checksum as checksum_tensor
from rollout_loader.routing import RoutingError
from rollout_loader.worker import PatchError, apply_patch, engine_checksums, rpc

from .conftest import engine, generate

pytestmark = pytest.mark.vllm


def expected(state: dict[str, torch.Tensor]) -> dict[str, int]:
    return {k: checksum_tensor(v) for k, v in state.items()}


def delta_object(base: dict[str, torch.Tensor], new: dict[str, torch.Tensor], folder: Path, *, step: int = 1) -> bytes:
    """The bytes of the delta object a trainer publishes when its weights go from ``base`` to ``new``."""
    state = {k: v.clone() for k, v in base.items()}
    with DeltaPublisher(str(folder), state, on_backlog="block") as pub:
        pub.publish(step - 1)
        for k, v in new.items():
            state[k].copy_(v)
        pub.publish(step)
    with StreamReader(str(folder)) as reader, reader.open(step) as obj:
        assert obj.header.kind == "delta"
        return Path(obj.path).read_bytes()


def anchor_object(state: dict[str, torch.Tensor], folder: Path) -> bytes:
    with DeltaPublisher(str(folder), {k: v.clone() for k, v in state.items()}, on_backlog="block") as pub:
        pub.publish(0)
    with StreamReader(str(folder)) as reader, reader.open(0) as obj:
        return Path(obj.path).read_bytes()


@pytest.mark.parametrize(
    ("tie", "dtype", "mode"),
    [
        pytest.param(True, "bfloat16", "live", id="tied-bf16-live"),
        pytest.param(False, "bfloat16", "live", id="untied-bf16-live"),
        # the stock CPU path repacks fp32 linears for oneDNN (weights become empty): real reloads
        pytest.param(True, "float32", "reload", id="tied-fp32-reload"),
        pytest.param(False, "float32", "reload", id="untied-fp32-reload"),
        # bf16 with the stock path: whatever this CPU's GEMM dispatch chose, rebuilt or reloaded
        pytest.param(False, "bfloat16", "reload", id="untied-bf16-reload"),
    ],
)
def test_patch_matches_fresh_engine_and_rolls_back(
    scenario, reference_tokens, tmp_path: Path, tie: bool, dtype: str, mode: str
) -> None:
    sc = scenario(tie, dtype)
    live = mode == "live"
    base_sums, new_sums = expected(sc.base), expected(sc.new)
    payload = delta_object(sc.base, sc.new, tmp_path / "stream")
    reference = reference_tokens(tie, dtype, live)  # first: in-process engines share global state, one at a time
    with engine(sc.base_dir, dtype, live=live) as llm:
        (summary,) = rpc(llm, "deltasync_init", sc.shapes_json, mode)
        assert summary["mode"] == mode and summary["tensors"] == len(sc.base)
        assert summary["tied"] == ({"lm_head.weight": "model.embed_tokens.weight"} if tie else {})
        if dtype == "float32" and not live:
            assert summary["host_copies"] > 0  # fused linears really went through reload_weights
        assert engine_checksums(llm) == base_sums
        before = generate(llm)  # also leaves KV of the long prompt, computed with the old weights, cached

        (result,) = apply_patch(llm, payload)
        assert result["tensors"] == len(sc.patch)  # the changed tensors
        assert engine_checksums(llm) == new_sums
        after = generate(llm)
        assert after != before, "the patch did not change generation at all"
        assert after == reference

        assert rpc(llm, "deltasync_rollback") == [True]
        llm.reset_prefix_cache()
        assert engine_checksums(llm) == base_sums
        assert generate(llm) == before
        assert rpc(llm, "deltasync_rollback") == [False]

        # the same patch from a file path
        path = tmp_path / "patch.safetensors"
        path.write_bytes(payload)
        apply_patch(llm, str(path))
        assert engine_checksums(llm) == new_sums

        # objects that do not fit the engine are rejected whole, weights untouched
        q = "model.layers.0.self_attn.q_proj.weight"
        extra = "model.layers.7.mlp.up_proj.weight"
        wide = {k: v.to(torch.float32 if v.dtype == torch.bfloat16 else torch.bfloat16) for k, v in sc.new.items()}
        bad_cases = {
            "not a checkpoint tensor": ({**sc.new, extra: sc.new[q]}, {**sc.new, extra: -sc.new[q]}),
            "the step has": ({**sc.new, "model.norm.weight": sc.new["model.norm.weight"][:64]},
                             {**sc.new, "model.norm.weight": -sc.new["model.norm.weight"][:64]}),
            "-bit": (wide, {**wide, q: -wide[q]}),
        }
        for i, (match, (old, new)) in enumerate(bad_cases.items()):
            with pytest.raises(PatchError, match=match):
                apply_patch(llm, delta_object(old, new, tmp_path / f"bad{i}"))
        with pytest.raises(PatchError, match="an anchor is loaded with deltasync_load"):
            apply_patch(llm, anchor_object(sc.new, tmp_path / "anchor"))
        with pytest.raises(FormatError, match="too short for a safetensors file|safetensors header"):
            apply_patch(llm, b"garbage")
        with pytest.raises(FormatError, match="no object at"):
            apply_patch(llm, str(tmp_path / "missing.safetensors"))
        assert engine_checksums(llm) == new_sums
        assert rpc(llm, "deltasync_rollback") == [False]  # a failed apply leaves nothing to roll back
        assert generate(llm) == reference


def test_init_rejects_what_it_cannot_route(scenario) -> None:
    from vllm.platforms import current_platform

    sc = scenario(True, "bfloat16")
    shapes = json.loads(sc.shapes_json)
    with engine(sc.base_dir, "bfloat16", live=False) as llm:

        def init(s: dict, mode: str = "reload") -> dict:
            return rpc(llm, "deltasync_init", json.dumps(s), mode)[0]

        with pytest.raises(RuntimeError, match="call collective_rpc\\('deltasync_init'"):
            engine_checksums(llm)
        (reply,) = llm.collective_rpc("deltasync_apply", args=(b"",))  # the raw reply: an error, not an exception
        assert reply["ok"] is False and reply["error"] == "RuntimeError"
        if current_platform.is_cpu():
            with pytest.raises(RoutingError, match="enable_live_cpu_weights"):
                init(shapes, "live")  # stock CPU kernels do not read the parameters
        with pytest.raises(RoutingError, match=r"'model.layers.5.mlp.up_proj.weight' \[256, 128\]: the engine's loader refuses it"):
            init({**shapes, "model.layers.5.mlp.up_proj.weight": [256, 128]})
        with pytest.raises(RoutingError, match=r"qkv_proj.weight': 16384 of its 65536 elements are fed by no"):
            init({k: v for k, v in shapes.items() if k != "model.layers.0.self_attn.k_proj.weight"})
        with pytest.raises(RoutingError, match="ties 'lm_head.weight' to 'model.embed_tokens.weight'"):
            init({**shapes, "lm_head.weight": [512, 128]})
        with pytest.raises(RoutingError, match=r"'model.layers.0.mlp.up_proj.weight' \[256, 64\]: the engine's loader refuses it"):
            init({**shapes, "model.layers.0.mlp.up_proj.weight": [256, 64]})
        with pytest.raises(RoutingError, match="dtypes differ"):
            init({k: {"shape": v, "dtype": "F32"} for k, v in shapes.items()})
        summary = init({k: {"shape": v, "dtype": "BF16"} for k, v in shapes.items()}, "auto")
        assert summary["tensors"] == len(shapes)
        assert engine_checksums(llm) == expected(sc.base)


_MULTIPROCESS_SCRIPT = textwrap.dedent(
    """
    import json, sys
    from vllm import LLM, SamplingParams
    from rollout_loader.worker import apply_patch, engine_checksums, rpc

    if __name__ == "__main__":
        model, dtype, tp, mode, patch_path, prompts, out = sys.argv[1:8]
        llm = LLM(model=model, dtype=dtype, tensor_parallel_size=int(tp), enforce_eager=True, max_model_len=512,
                  seed=0, worker_extension_cls="rollout_loader.worker.DeltaWorkerExtension")
        sp = SamplingParams(max_tokens=12, temperature=0.0, detokenize=False, ignore_eos=True)
        res = {}
        if patch_path != "-":
            res["init"] = rpc(llm, "deltasync_init", None, mode)  # names and shapes: from the model's checkpoint
            res["apply"] = apply_patch(llm, patch_path)
            res["checksums"] = engine_checksums(llm)
        res["tokens"] = [list(o.outputs[0].token_ids) for o in llm.generate(json.loads(prompts), sp, use_tqdm=False)]
        if patch_path != "-":
            res["rollback"] = rpc(llm, "deltasync_rollback")
            res["apply_bytes"] = apply_patch(llm, open(patch_path, "rb").read())
            try:
                apply_patch(llm, b"garbage")
            except Exception as e:
                res["error"] = [type(e).__name__, str(e)]
            res["checksums_after_error"] = engine_checksums(llm)
            res["checksums_again"] = engine_checksums(llm)  # replies still in step after a failed call
        json.dump(res, open(out, "w"))
    """
)


def run_engine_process(tmp_path: Path, model: Path, dtype: str, *, tp: int = 1, mode: str = "live", patch=None) -> dict:
    """Run the script above in a fresh interpreter: vLLM's default multiprocess mode, engine in its own process."""
    from .conftest import PROMPTS

    tmp_path.mkdir(parents=True, exist_ok=True)
    script, patch_path, out = tmp_path / "engine.py", tmp_path / "patch.safetensors", tmp_path / "out.json"
    script.write_text(_MULTIPROCESS_SCRIPT)
    if patch is not None:
        patch_path.write_bytes(patch)
    env = {k: v for k, v in os.environ.items() if k != "VLLM_ENABLE_V1_MULTIPROCESSING"}
    # inherited by the engine process: live mode is decided there, when the model loads
    env.update(VLLM_CPU_KVCACHE_SPACE="1", DELTASYNC_CPU_LIVE_WEIGHTS="1" if mode == "live" else "0")
    if tp > 1:
        env["VLLM_CPU_OMP_THREADS_BIND"] = "|".join(str(i) for i in range(tp))  # one core per rank, one NUMA node
    args = [str(model), dtype, str(tp), mode, str(patch_path) if patch is not None else "-", json.dumps(PROMPTS)]
    proc = subprocess.run(
        [sys.executable, str(script), *args, str(out)], env=env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(out.read_text())


def check_engine_process(res: dict, sc, reference: list[list[int]], mode: str, tp: int) -> None:
    new_sums = expected(sc.new)
    assert [r["mode"] for r in res["init"]] == [mode] * tp
    assert [r["tp_rank"] for r in res["init"]] == list(range(tp))
    assert res["checksums"] == new_sums
    assert res["tokens"] == reference
    assert res["rollback"] == [True] * tp
    assert res["error"][0] == "FormatError" and f"failed on {tp} of {tp} rank(s)" in res["error"][1]
    assert res["checksums_after_error"] == res["checksums_again"] == new_sums


def test_default_multiprocess_mode(scenario, reference_tokens, tmp_path: Path) -> None:
    """Engine in its own process (vLLM's default): only bytes and paths cross collective_rpc."""
    sc = scenario(False, "bfloat16")
    res = run_engine_process(tmp_path, sc.base_dir, "bfloat16", patch=delta_object(sc.base, sc.new, tmp_path / "stream"))
    check_engine_process(res, sc, reference_tokens(False, "bfloat16", True), "live", 1)


@pytest.mark.slow
@pytest.mark.skipif(os.environ.get("DELTASYNC_TP_TESTS") != "1", reason="set DELTASYNC_TP_TESTS=1 (about 2 minutes)")
@pytest.mark.parametrize(("dtype", "mode"), [("float32", "reload"), ("bfloat16", "live")])
def test_tensor_parallel_2(scenario, tmp_path: Path, dtype: str, mode: str) -> None:
    """Two ranks on two cores: each patches its own slices; the reference is a fresh TP=2 engine."""
    sc = scenario(False, dtype)
    fresh = run_engine_process(tmp_path / "fresh", sc.new_dir, dtype, tp=2, mode=mode)
    res = run_engine_process(tmp_path / "patched", sc.base_dir, dtype, tp=2, mode=mode,
                             patch=delta_object(sc.base, sc.new, tmp_path / "stream"))
    check_engine_process(res, sc, fresh["tokens"], mode, 2)


def test_sealed_write_lands_the_reference_bits_and_checksums() -> None:
    """A sealed step (checksums computed before the pause from the bits held and the patch) writes exactly
    ``old ^ xor`` and carries this rank's parts as the FORMAT.md reference computes them from the new bits,
    also for the slices of a fused parameter and for a tensor-parallel shard; a seal older than the last write
    writes nothing; a rollback restores the bits and the parts. No engine: a hand-built rank state."""
    import numpy as np

    from rollout_loader.routing import Route
    from rollout_loader.vllm.state import (
        Target,
        WorkerState,
        checksums,
        rollback,
        seal,
        stage,
        write,
        write_sealed,
    )
    from tests.test_reference import ref_checksum

    def route(*values: object) -> Route:
        keys = ("hf_name", "hf_shape", "param_name", "param_shape", "hf_start", "param_start", "extent")
        return Route(**dict(zip(keys, values, strict=True)))  # type: ignore[arg-type]

    rng = np.random.default_rng(7)
    fused = torch.from_numpy(rng.integers(-2**15, 2**15, (6, 40), dtype=np.int16)).view(torch.bfloat16)
    shard = torch.from_numpy(rng.integers(-2**15, 2**15, (4, 40), dtype=np.int16)).view(torch.bfloat16)
    routes = {  # "a" and "b" share one fused parameter; this rank holds rows 4..7 of "c" (it owns them)
        "a": route("a", (4, 40), "fused", (6, 40), (0, 0), (0, 0), (4, 40)),
        "b": route("b", (2, 40), "fused", (6, 40), (0, 0), (4, 0), (2, 40)),
        "c": route("c", (8, 40), "shard", (4, 40), (4, 0), (0, 0), (4, 40)),
    }
    params = {"fused": fused, "shard": shard}
    targets = {n: Target(routes=(r,), bits=params[r.param_name].view(torch.int16).reshape(-1), host=False, modules=())
               for n, r in routes.items()}
    state = WorkerState(model=torch.nn.Module(), reload=lambda w: None, table=None, mode="live", targets=targets)  # type: ignore[arg-type]

    def held(name: str) -> tuple[np.ndarray, np.ndarray]:
        """This rank's elements of checkpoint tensor ``name`` (unsigned bits) and their global flat indices."""
        r = routes[name]
        rows = params[r.param_name].view(torch.int16).numpy().view(np.uint16)[r.param_start[0]:r.param_start[0] + r.extent[0]]
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

    checksums(state)  # the running parts incremental verification starts from
    before = {n: held(n) for n in routes}
    step1 = [patch("a", 0.3), patch("b", 0.5), patch("c", 0.2)]  # "c": positions on both ranks' rows
    want = reference(step1)
    staged = stage(state, step1)
    sealed = seal(state, staged)
    assert {n: held(n)[0].tolist() for n in routes} == {n: b.tolist() for n, (b, _) in before.items()}  # sealing writes nothing
    sums = write_sealed(state, staged, sealed)
    assert sums == {n: s for n, (_, s) in want.items()}
    assert {n: held(n)[0].tolist() for n in routes} == {n: b.tolist() for n, (b, _) in want.items()}

    assert rollback(state)
    assert {n: held(n)[0].tolist() for n in routes} == {n: b.tolist() for n, (b, _) in before.items()}
    assert {n: state.sums[n] for n in routes} == {n: ref_checksum(b, i) for n, (b, i) in before.items()}
    assert write_sealed(state, staged, sealed) is None  # the rollback moved the bits since the seal: stale
    assert {n: held(n)[0].tolist() for n in routes} == {n: b.tolist() for n, (b, _) in before.items()}

    # sealed again against the bits held now; another write in between makes it stale, and nothing is written
    sealed = seal(state, staged)
    other = [patch("a", 0.1)]
    after_other = reference(other)
    write(state, stage(state, other))
    assert write_sealed(state, staged, sealed) is None
    assert held("a")[0].tolist() == after_other["a"][0].tolist()
    assert state.sums["a"] == after_other["a"][1]

    # one patch of a sealed step fails its check (written on the pool beside the others): nothing stays written
    import dataclasses

    from deltasync import TensorMismatchError

    now = {n: held(n)[0].tolist() for n in routes}
    staged = stage(state, [patch("a", 0.3), patch("b", 0.5), patch("c", 0.2)])
    sealed = seal(state, staged)
    bad = dataclasses.replace(staged[1], idx=staged[1].idx + 10**6)  # past the end of its target
    with pytest.raises(TensorMismatchError):
        write_sealed(state, [staged[0], bad, staged[2]], sealed)
    assert {n: held(n)[0].tolist() for n in routes} == now
