"""Every model family follows a stream bit-exactly, judged against a fresh vLLM engine loaded from the same step.

For each family (dense, tied, fused-checkpoint, MoE, MLA + MoE + shared experts, Kimi-K2's DeepSeek-V3 with its
shared router bias, gpt-oss's permuted experts, Qwen3-Next's widened ``A_log``, a tied head the checkpoint stores) a
run where *every* tensor changes (attention, experts, router, shared experts, norms, embeddings, ``kv_b_proj``) is
published: two deltas and an anchor. A real vLLM engine follows it through the deltasync weight-transfer engine;
after each step every parameter and buffer it holds (what vLLM derived after loading too: prepacked CPU experts,
MLA's ``W_UK_T``/``W_UV``) and its greedy output are recorded. Then a fresh engine is started from each step's
replayed checkpoint: everything must be bit-equal. "stock" keeps vLLM's CPU kernels (linears repacked, so shadowed
and re-loaded); "live" keeps CPU linear weights live (written in place); MoE experts are shadowed on CPU either way
(their CPU kernel prepacks them).
"""

from __future__ import annotations

import gc
from pathlib import Path

import pytest
import torch

from deltasync import DeltaPublisher, replay_to_folder
from tests.integration.conftest import generate, load_state, perturb, save_like, update_to
from tests.integration.families import FAMILY_CASES, OUTSIDE_CI, TIED, build_family
from tests.integration.fp8 import fp8_stand_in

pytest.importorskip("vllm")
pytestmark = pytest.mark.vllm

STEPS = (1, 2, 3)  # 1, 2: deltas; 3: an anchor (anchor_every=3)
COMPARED = (2, 3)  # a delta on a delta, and an anchor: each against a fresh engine
CASES = [pytest.param(*case, marks=pytest.mark.outside_ci) if case in OUTSIDE_CI else case for case in FAMILY_CASES]


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().reshape(-1).contiguous().view(torch.uint8).clone()


def _held(llm) -> dict[str, tuple[str, tuple[int, ...], torch.Tensor]]:
    """Every parameter and buffer of the (in-process) engine's model: dtype, shape and bits."""
    model = llm.collective_rpc(lambda worker: worker.model_runner.model)[0]
    tensors = [*model.named_parameters(), *(("buffer:" + n, b) for n, b in model.named_buffers())]
    return {n: (str(t.dtype), tuple(t.shape), _bits(t)) for n, t in tensors}


def _start(path: Path, live: bool, *, quantization: str | None = None, load_format: str = "auto"):
    from rollout_loader.vllm import start_engine

    return start_engine(str(path), in_process=True, live_cpu_weights=live, dtype="bfloat16", enforce_eager=True,
                        max_model_len=512, seed=0, quantization=quantization, load_format=load_format)


def _close(llm) -> None:
    """Shut an in-process engine down now: a reference kept elsewhere (an error's traceback) would otherwise let the
    garbage collector do it later, tearing down the distributed state of the next in-process engine."""
    finalizer = getattr(getattr(llm.llm_engine, "engine_core", None), "_finalizer", None)
    if finalizer is not None:
        finalizer()


def _publish(model_dir: Path, url: str, *, tied: dict[str, str] | None = None, share: bool = True,
             steps: tuple[int, ...] = STEPS) -> None:
    """Step 0 is the checkpoint; each later step changes ~2% of every tensor. ``tied``: {alias: target} the model
    ties (a trainer's tied head): kept equal, published once (``share``: one tensor under both names) or as two
    tensors with the same bits (a pushed checkpoint folder that stores both)."""
    tied = tied or {}
    loaded = load_state(model_dir)
    state = {n: t for n, t in loaded.items() if n not in tied}  # the tied ones last, as a model's state dict lists
    state.update({alias: state[target] if share else loaded[alias] for alias, target in tied.items()})
    names = sorted(n for n in state if n not in tied)
    with DeltaPublisher(url, state, anchor_every=3) as pub:
        pub.publish(0)
        for step in steps:
            for name, t in perturb(state, names, seed=100 + step, density=0.02).items():
                state[name].copy_(t)
            for alias, target in tied.items():
                state[alias].copy_(state[target])
            pub.publish(step)
        pub.flush()


@pytest.fixture
def cpu_env(monkeypatch):
    from vllm import envs

    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "1")
    yield
    envs.disable_envs_cache()


@pytest.mark.parametrize(("family", "kernels", "served"), CASES)
def test_family_follows_a_stream_bit_exact_against_fresh_engines(family, kernels, served, tmp_path, cpu_env) -> None:
    """``served``: "bf16", or "fp8": a bf16 stream served by an engine started with ``quantization="fp8"``, whose
    linears hold float8 weights and scales computed from the bf16 values (shadowed: re-quantized by vLLM)."""
    live = kernels == "live"
    quantization = "fp8" if served == "fp8" else None
    if quantization:
        stand_in = fp8_stand_in()
        stand_in.__enter__()
    model_dir = build_family(family, tmp_path / family)
    url = str(tmp_path / "stream")
    _publish(model_dir, url, tied=TIED.get(family))
    followed, tokens = {}, {}
    try:
        _follow_and_compare(model_dir, url, live, quantization, followed, tokens, tmp_path)
    finally:
        if quantization:
            stand_in.__exit__(None, None, None)


def _follow_and_compare(model_dir, url, live, quantization, followed, tokens, tmp_path, *, steps=STEPS,
                        compared=COMPARED, before=None, check=None, verify="all", start=None, held=0,
                        load_format="auto") -> None:
    """Follow ``steps`` with one engine, then compare it at each of ``compared`` with a fresh engine loaded from
    that step's replayed checkpoint. ``before(llm)``: run on the engine before it initialises deltasync;
    ``check(engine)``: on its weight-transfer engine once it followed. ``start``: the folder the following engine
    loads (default ``model_dir``, step 0's checkpoint), ``load_format`` how ("dummy": random weights), ``held``:
    the step its ``init_info`` says it holds (None: says nothing, so the first update writes an anchor)."""
    llm = _start(start or model_dir, live, quantization=quantization, load_format=load_format)
    try:
        if before is not None:
            before(llm)
        info = {"url": url, "verify": verify} | ({} if held is None else {"step": held})
        llm.init_weight_transfer_engine({"init_info": info})
        for step in steps:
            update_to(llm, step)
            if step in compared:  # generation first: it converts caches (gpt-oss's fp32 rope cache) as a fresh one's
                tokens[step] = generate(llm)
                followed[step] = _held(llm)
        engine = llm.collective_rpc(lambda worker: worker.weight_transfer_engine)[0]
        assert engine.held_step == steps[-1]
        if check is not None:
            check(engine)
        if quantization:  # the engine really serves float8 weights (and the test compares them)
            assert any("float8" in dtype for dtype, _, _ in followed[compared[-1]].values())
    finally:
        _close(llm)
        del llm
        gc.collect()
    for step in compared:
        replayed = replay_to_folder(url, step, str(tmp_path / f"replay{step}"))
        fresh_dir = save_like(model_dir, tmp_path / f"fresh{step}", load_state(Path(replayed.path)))
        fresh = _start(fresh_dir, live, quantization=quantization)
        try:
            want_tokens = generate(fresh)
            want = _held(fresh)
        finally:
            _close(fresh)
            del fresh
            gc.collect()
        got = followed[step]
        assert got.keys() == want.keys(), (step, sorted(got.keys() ^ want.keys()))
        differ = [n for n in want if got[n][:2] != want[n][:2] or not torch.equal(got[n][2], want[n][2])]
        assert not differ, f"step {step}: {len(differ)} of {len(want)} tensors differ from a fresh engine: {differ[:6]}"
        assert tokens[step] == want_tokens, step


def _patch_loader(llm, module: str, loader) -> tuple[object, object]:
    """Give ``module``'s checkpoint-format weight (vLLM's record, which its loader and reload use) another loader;
    returns what to restore."""
    from vllm.model_executor.model_loader.reload.layerwise import LAYERWISE_INFO

    model = llm.collective_rpc(lambda worker: worker.model_runner.model)[0]
    recorded = LAYERWISE_INFO[model.get_submodule(module)].restore_metadata[0]["weight"]
    original = getattr(recorded, "weight_loader", None)
    recorded.weight_loader = loader
    return recorded, original


def test_refusals_name_their_cause_and_the_engine_keeps_serving(tmp_path, cpu_env) -> None:
    """A loader that reads the router's checkpoint tensor and writes none of it (fills the parameter instead): init
    is refused with a RoutingError naming the tensor and the remedy, and the engine's weights and output are
    untouched. An engine whose norm moved since it loaded its checkpoint: refused naming both possible causes."""
    from rollout_loader.routing import RoutingError

    model_dir = build_family("qwen3_moe", tmp_path / "m")
    url = str(tmp_path / "stream")
    _publish(model_dir, url, steps=(1,))
    llm = _start(model_dir, True)
    try:
        before, before_tokens = _held(llm), generate(llm)
        recorded, original = _patch_loader(llm, "model.layers.1.mlp.gate", lambda param, w: param.data.zero_())
        try:
            with pytest.raises(RoutingError) as raised:
                llm.init_weight_transfer_engine({"init_info": {"url": url, "step": 0}})
        finally:
            recorded.weight_loader = original
        text = str(raised.value)
        del raised  # its traceback holds the engine
        assert "'model.layers.1.mlp.gate.weight': the engine drops this tensor (vLLM's loader for this model writes " \
               "none of its elements into a parameter" in text
        assert "Leave it out of the engine's checkpoint and of the stream" in text
        after = _held(llm)
        assert all(torch.equal(after[n][2], before[n][2]) for n in before) and generate(llm) == before_tokens
        # weights that moved since the engine loaded its checkpoint (a norm: no post-load processing to redo)
        model = llm.collective_rpc(lambda worker: worker.model_runner.model)[0]
        norm = model.get_submodule("model.norm").weight
        with torch.no_grad():
            norm.add_(1)
        try:
            with pytest.raises(RoutingError) as raised:
                llm.init_weight_transfer_engine({"init_info": {"url": url, "step": 0}})
            text = str(raised.value)
            del raised
        finally:
            with torch.no_grad():
                norm.sub_(1)
        assert "engine parameter 'model.norm.weight' holds other bits than 'model.norm.weight' in the engine's " \
               "checkpoint" in text
        assert "either the engine's weights changed since it loaded that checkpoint" in text
    finally:
        _close(llm)
        del llm
        gc.collect()


def _untraced_norm(llm) -> None:
    """The final norm's loader computes its weight (``w * 1``, the same bits) instead of copying it: no element
    map, so its module is shadowed and re-loaded through vLLM (it has no quantization method)."""
    _patch_loader(llm, "model.norm", lambda param, w: param.data.copy_(w * 1))


def _round_2_check(family: str):
    def check(engine) -> None:
        state = engine._state
        if family == "deepseek_v3_bf16_bias":
            from rollout_loader.vllm.layout import param_owners

            name = "model.layers.1.mlp.gate.e_score_correction_bias"
            home = state.homes[name]
            assert home.host and home.mirror and home.mirror[0].casts == (torch.float32,)  # widened, not re-loaded
            owners = {m for m, _ in param_owners(state.model)[name]}
            assert {"model.layers.1.mlp.gate", "model.layers.1.mlp.experts.routed_experts"} <= owners
            assert "model.layers.1.mlp.experts.routed_experts" in state.feeds  # the shadowed owner
        elif family == "gpt_oss":
            (route,) = state.table.routes["model.layers.1.mlp.experts.gate_up_proj"]
            assert route.axes == (0, 2, 1)  # [E, H, 2I] into w13 [E, 2I, H]: the loader's permute, routed
        else:
            assert state.aliases == {"lm_head.weight": "model.embed_tokens.weight"}  # the tied head, stored
            assert "model.norm.weight" in state.table.untraced and "model.norm" in state.feeds
    return check


@pytest.mark.parametrize("family", ["deepseek_v3_bf16_bias", "gpt_oss", "tied_head"])
def test_round_2_mechanisms_follow_a_delta_bit_exact(family, tmp_path, cpu_env) -> None:
    """CI's sibling of the round-2 family cases (outside CI), one delta each, against a fresh engine:
    ``deepseek_v3_bf16_bias``: the router's ``e_score_correction_bias``, one parameter the router and the
    (shadowed) experts share, published in bf16 and widened by the loader into fp32. ``gpt_oss``: experts the loader
    permutes before copying. ``tied_head``: a tied head the checkpoint stores and the stream carries as a second
    tensor with the same bits (checked, never written), and a module whose loader computes its weight (no element
    map: re-loaded through vLLM, though it has no quantization method)."""
    model_dir = build_family(family, tmp_path / family)
    url = str(tmp_path / "stream")
    _publish(model_dir, url, tied=TIED.get(family), share=False, steps=(1,))
    _follow_and_compare(model_dir, url, True, None, {}, {}, tmp_path, steps=(1,), compared=(1,),
                        before=_untraced_norm if family == "tied_head" else None, check=_round_2_check(family),
                        verify="incremental")


def test_expert_load_balancing_is_refused_by_name(tmp_path, cpu_env) -> None:
    """EPLB moves experts at run time; routes follow the placement at load: an engine with it is refused."""
    model_dir = build_family("qwen3_moe", tmp_path / "m")
    url = str(tmp_path / "stream")
    _publish(model_dir, url)
    llm = _start(model_dir, True)
    try:
        engine = llm.collective_rpc(lambda worker: worker.weight_transfer_engine)[0]
        parallel = engine.vllm_config.parallel_config
        parallel.enable_eplb = True  # what `--enable-eplb` sets (vLLM's CPU build cannot start with it)
        try:
            with pytest.raises(Exception, match="enable_eplb"):
                llm.init_weight_transfer_engine({"init_info": {"url": url, "step": 0}})
        finally:
            parallel.enable_eplb = False
    finally:
        _close(llm)
        del llm
        gc.collect()


_TP_SCRIPT = """
import hashlib, json, sys
import torch

def digest(worker):
    model = worker.model_runner.model
    tensors = [*model.named_parameters(), *(("buffer:" + n, b) for n, b in model.named_buffers())]
    out = {}
    for name, t in tensors:
        flat = t.detach().reshape(-1).contiguous()
        data = flat.view(torch.uint8).numpy().tobytes() if flat.numel() else b""
        out[name] = [str(t.dtype), list(t.shape), hashlib.sha256(data).hexdigest()]
    return out

def prefetch_role(worker):
    # whether this rank's prefetcher watches the stream, and how many stage plans it heard from the one that does
    p = worker.weight_transfer_engine._prefetcher
    return [p.watch is not None, None if p.feed is None else p.feed.received]

if __name__ == "__main__":
    from rollout_loader.vllm import start_engine
    from tests.integration.conftest import generate, update_to
    model, url, steps, out = sys.argv[1], sys.argv[2], json.loads(sys.argv[3]), sys.argv[4]
    llm = start_engine(model, dtype="bfloat16", enforce_eager=True,
                       max_model_len=512, seed=0, tensor_parallel_size=2)
    if steps:
        llm.init_weight_transfer_engine({"init_info": {"url": url, "verify": "all", "step": 0}})
        for step in steps:
            update_to(llm, step)
    roles = llm.collective_rpc(prefetch_role) if steps else None
    json.dump({"held": llm.collective_rpc(digest), "tokens": generate(llm), "prefetch": roles}, open(out, "w"))
"""


@pytest.mark.outside_ci  # two TP=2 multiprocess engines: ~2.5 min of CI's budget (./run.sh test -m outside_ci)
def test_moe_tensor_parallel_2_bit_exact_against_a_fresh_engine(tmp_path) -> None:
    """Qwen3-MoE with tensor parallelism 2 (multiprocess engine, one core per rank): each rank holds its slices
    of q/k/v, o, the experts' intermediate dimension; after a delta and an anchor every rank's parameters and
    buffers equal a fresh TP=2 engine's, and so does greedy output."""
    import json
    import os
    import subprocess
    import sys

    model_dir = build_family("qwen3_moe", tmp_path / "m")
    url = str(tmp_path / "stream")
    _publish(model_dir, url)
    replayed = replay_to_folder(url, STEPS[-1], str(tmp_path / "replay"))
    fresh_dir = save_like(model_dir, tmp_path / "fresh", load_state(Path(replayed.path)))
    script = tmp_path / "tp.py"
    script.write_text(_TP_SCRIPT)
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": "0|1",
           "DELTASYNC_CPU_LIVE_WEIGHTS": "1", "VLLM_ALLOW_INSECURE_SERIALIZATION": "1",  # the digest function
           "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    results = {}
    for name, model, steps in (("followed", model_dir, list(STEPS)), ("fresh", fresh_dir, [])):
        out = tmp_path / f"{name}.json"
        r = subprocess.run([sys.executable, str(script), str(model), url, json.dumps(steps), str(out)], env=env,
                           capture_output=True, text=True, timeout=540)
        assert r.returncode == 0, r.stderr[-3000:]
        results[name] = json.loads(out.read_text())
    got, want = results["followed"]["held"], results["fresh"]["held"]
    assert len(want) == 2
    for rank in range(2):
        assert got[rank].keys() == want[rank].keys()
        differ = [n for n in want[rank] if got[rank][n] != want[rank][n]]
        assert not differ, f"rank {rank}: {len(differ)} tensors differ from a fresh engine: {differ[:6]}"
    assert results["followed"]["tokens"] == results["fresh"]["tokens"]
    # one watcher per engine: rank 0's prefetcher watches the stream and tells rank 1 what to stage
    (watches_0, _), (watches_1, heard_1) = results["followed"]["prefetch"]
    assert watches_0 and not watches_1 and heard_1 >= 1, results["followed"]["prefetch"]
