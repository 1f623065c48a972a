"""FP8 plans and the trainer-side quantizer (rollout_loader/vllm/fp8.py), without an engine.

The engine's side, and the quantizer's bits against a real FP8 engine's, are tests/integration/test_vllm_fp8.py.
Here: the plan as data (JSON, validation, the stream's layout, the model files a replayed step needs), and the
quantizer's structure (names, dtypes, shapes, a group's one scale, blocks sliced to their members) checked by what
the format says an FP8 tensor means: dequantized, each member is its weights to FP8's precision.
"""

from __future__ import annotations

import json
import math

import pytest
import torch

from deltasync.errors import ConfigError, TensorMismatchError
from rollout_loader.routing import Route, RoutingError
from rollout_loader.vllm.fp8 import Fp8Group, Fp8Plan, Fp8Quantizer, fp8_plan

Q, K, V, OUT = (f"model.layers.0.self_attn.{p}_proj.weight" for p in "qkvo")
NORM = "model.norm.weight"


def _plan(scheme: str = "per_tensor", block: tuple[int, int] | None = None,
          rows: tuple[int, int, int] = (256, 128, 128), cols: int = 256) -> Fp8Plan:
    tensors = {Q: ("BF16", (rows[0], cols)), K: ("BF16", (rows[1], cols)), V: ("BF16", (rows[2], cols)),
               OUT: ("BF16", (cols, sum(rows) // 2)), NORM: ("BF16", (cols,))}
    return Fp8Plan(groups=(Fp8Group(module="model.layers.0.self_attn.qkv_proj", members=(Q, K, V), scheme=scheme,
                                     block=block),
                           Fp8Group(module="model.layers.0.self_attn.o_proj", members=(OUT,), scheme=scheme,
                                    block=block)),
                   tensors=tensors)


def test_a_plan_is_data_its_json_round_trips_and_names_the_stream_layout():
    plan = _plan()
    assert Fp8Plan.from_json(plan.to_json()) == plan
    layout = plan.layout()
    assert list(layout) == [Q, Q.replace(".weight", ".weight_scale"), K, K.replace(".weight", ".weight_scale"), V,
                            V.replace(".weight", ".weight_scale"), OUT, OUT.replace(".weight", ".weight_scale"), NORM]
    assert layout[Q] == ("F8_E4M3", (256, 256)) and layout[Q.replace("weight", "weight_scale")] == ("F32", ())
    assert layout[NORM] == ("BF16", (256,))
    assert _plan("per_channel").layout()[K.replace("weight", "weight_scale")] == ("F32", (128, 1))
    block = _plan("per_block", (128, 128), rows=(256, 128, 100), cols=200).layout()
    assert block[V.replace("weight", "weight_scale_inv")] == ("F32", (1, 2))  # ceil(100/128), ceil(200/128)
    assert plan.group_of(K).module.endswith("qkv_proj") and plan.group_of(NORM) is None


def test_a_bad_plan_is_refused_naming_what_is_wrong():
    with pytest.raises(ConfigError, match="scheme must be one of"):
        Fp8Group(module="m", members=(Q,), scheme="per_row")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="a block size goes with scheme 'per_block' only"):
        Fp8Group(module="m", members=(Q,), scheme="per_tensor", block=(128, 128))
    with pytest.raises(ConfigError, match="members must be checkpoint tensors named '<layer>.weight'"):
        Fp8Group(module="m", members=("model.layers.0.mlp.experts.gate_up_proj",), scheme="per_tensor")
    tensors = {Q: ("BF16", (8, 8)), NORM: ("BF16", (8,))}
    with pytest.raises(ConfigError, match="is in two groups"):
        Fp8Plan(groups=(Fp8Group(module="a", members=(Q,), scheme="per_tensor"),
                        Fp8Group(module="b", members=(Q,), scheme="per_tensor")), tensors=tensors)
    with pytest.raises(ConfigError, match=r"'model.norm.weight' is not a 2-D checkpoint tensor"):
        Fp8Plan(groups=(Fp8Group(module="a", members=(NORM,), scheme="per_tensor"),), tensors=tensors)
    with pytest.raises(ConfigError, match="already holds .*weight_scale.*an FP8 checkpoint"):
        Fp8Plan(groups=(Fp8Group(module="a", members=(Q,), scheme="per_tensor"),),
                tensors={**tensors, Q.replace("weight", "weight_scale"): ("F32", ())})
    with pytest.raises(ConfigError, match=r"tensors \['model.norm.weight'\] have no dtype name"):
        Fp8Plan(groups=(), tensors={NORM: ("bfloat16", (8,))})
    with pytest.raises(ConfigError, match=r"members start at rows \[0, 256, 320\], not on multiples of the block's"):
        _plan("per_block", (128, 128), rows=(256, 64, 64))
    for text in ("{", json.dumps({"format": "other"}), json.dumps({"format": "deltasync.fp8-plan/1"}),
                 "x" * (65 << 20)):
        with pytest.raises(ConfigError, match="FP8 plan"):
            Fp8Plan.from_json(text)


def test_model_files_carry_the_quantization_a_replayed_step_needs(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    (tmp_path / "tokenizer.json").write_text("{}")
    (tmp_path / "model.safetensors").write_bytes(b"weights: not a model file")
    files = _plan().model_files(tmp_path)
    assert sorted(files) == ["config.json", "tokenizer.json"]
    assert json.loads(files["config.json"])["quantization_config"] == {"quant_method": "fp8",
                                                                       "activation_scheme": "dynamic"}
    block = json.loads(_plan("per_block", (128, 128)).model_files(tmp_path)["config.json"])
    assert block["quantization_config"]["weight_block_size"] == [128, 128]
    assert "quantization_config" not in json.loads(_plan("per_channel").model_files(tmp_path)["config.json"])


@pytest.fixture
def stand_in():
    pytest.importorskip("vllm")
    from tests.integration.fp8 import fp8_stand_in

    with fp8_stand_in():
        yield


def _weights(plan: Fp8Plan, dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {n: (torch.randn(s, generator=g) * 0.05).to(dtype) for n, (_, s) in plan.tensors.items()}


def _dequantized(plan: Fp8Plan, out: dict[str, torch.Tensor], name: str) -> torch.Tensor:
    group = plan.group_of(name)
    assert group is not None
    q = out[name].float()
    if group.scheme == "per_block":
        s = out[name.replace("weight", "weight_scale_inv")]
        b0, b1 = group.block  # type: ignore[misc]
        s = s.repeat_interleave(b0, 0).repeat_interleave(b1, 1)[: q.shape[0], : q.shape[1]]
    else:
        s = out[name.replace("weight", "weight_scale")]
    return q * s


@pytest.mark.parametrize(("scheme", "block"), [("per_tensor", None), ("per_channel", None), ("per_block", (128, 128))])
def test_the_quantizer_gives_the_stream_layout_and_each_member_dequantizes_to_its_weights(scheme, block, stand_in):
    plan = _plan(scheme, block, rows=(256, 128, 100) if block else (256, 128, 128), cols=200)
    weights = _weights(plan)  # fp32 master weights: converted to the plan's bf16 first, as the engine's loader does
    out = Fp8Quantizer(plan).quantize(weights)
    assert {n: (t.dtype, tuple(t.shape)) for n, t in out.items()} == {
        n: ({"F8_E4M3": torch.float8_e4m3fn, "F32": torch.float32, "BF16": torch.bfloat16}[d], s)
        for n, (d, s) in plan.layout().items()}
    if scheme == "per_tensor":  # one scale for the group: the largest member's amax over FP8's maximum
        scales = [out[m.replace("weight", "weight_scale")] for m in (Q, K, V)]
        assert all(torch.equal(s, scales[0]) for s in scales)
        amax = max(float(weights[m].bfloat16().abs().max()) for m in (Q, K, V))
        assert float(scales[0]) == pytest.approx(amax / 448.0, rel=1e-6)
    for m in (Q, K, V, OUT):
        w = weights[m].bfloat16().float()
        err = (_dequantized(plan, out, m) - w).abs()
        assert float(err.max()) <= float(w.abs().max()) / 8, m  # e4m3: 3 mantissa bits
    assert torch.equal(out[NORM], weights[NORM].bfloat16())


def test_a_publisher_takes_the_pairs_as_it_takes_the_state(stand_in, tmp_path):
    """``publish(step, weights=quantizer.pairs(...))`` (one group held at a time) commits the same tensors as the
    quantized state dict: the same step checksum."""
    from deltasync import DeltaPublisher, StreamReader

    plan = _plan()
    weights = _weights(plan)
    quantizer = Fp8Quantizer(plan)
    with DeltaPublisher(str(tmp_path / "state"), quantizer.quantize(weights)) as pub:
        pub.publish(0)
    with DeltaPublisher(str(tmp_path / "pairs"), None) as pub:
        pub.publish(0, weights=quantizer.pairs(weights.items()))
    with StreamReader(str(tmp_path / "state")) as a, StreamReader(str(tmp_path / "pairs")) as b:
        assert a.manifest(0).state_checksum == b.manifest(0).state_checksum


def test_the_quantizer_streams_pairs_and_writes_in_place(stand_in):
    plan = _plan()
    weights = _weights(plan, torch.bfloat16)
    quantizer = Fp8Quantizer(plan)
    state = quantizer.quantize(weights)
    tensors = {n: t for n, t in state.items()}
    order = [OUT, K, NORM, V, Q]  # members of a group arrive apart: the group goes out once the last one did
    pairs = list(quantizer.pairs((n, weights[n]) for n in order))
    assert [n for n, _ in pairs][:3] == [OUT, OUT.replace("weight", "weight_scale"), NORM]
    assert all(torch.equal(t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t,
                           state[n].view(torch.uint8) if t.dtype == torch.float8_e4m3fn else state[n])
               for n, t in pairs)
    changed = {n: t * 1.5 for n, t in weights.items()}
    quantizer.quantize(changed, out=state)
    assert all(state[n] is tensors[n] for n in state)  # the publisher's tensors, written in place
    assert not torch.equal(state[Q].view(torch.uint8), quantizer.quantize(weights)[Q].view(torch.uint8))
    with pytest.raises(TensorMismatchError, match=r"missing \['model.norm.weight'\]"):
        quantizer.quantize({n: t for n, t in weights.items() if n != NORM})
    with pytest.raises(TensorMismatchError, match="the weights end before every member of a group arrived"):
        list(quantizer.pairs((n, weights[n]) for n in (Q, K)))
    with pytest.raises(TensorMismatchError, match=r"'model.norm.weight' is \[3\], the plan's checkpoint has \[256\]"):
        list(quantizer.pairs([(NORM, torch.zeros(3))]))
    with pytest.raises(TensorMismatchError, match="is not a checkpoint tensor of the plan"):
        list(quantizer.pairs([("lm_head.weight", torch.zeros(3))]))
    with pytest.raises(TensorMismatchError, match=r"out\['model.norm.weight'\] is not a torch.bfloat16"):
        quantizer.quantize(weights, out={**state, NORM: torch.zeros(256)})


def test_a_quantizer_where_vllm_s_op_is_a_stub_says_so():
    pytest.importorskip("vllm")
    from tests.integration.fp8 import _works

    if _works():
        pytest.skip("vLLM's FP8 op works here")
    with pytest.raises(ConfigError, match="vLLM's FP8 quantization failed in this process .* empty stub"):
        Fp8Quantizer(_plan()).quantize(_weights(_plan()))


def test_scale_routes_follow_their_weight_s_rows_and_blocks():
    from rollout_loader.vllm.plan import _scale_route

    g = Fp8Group(module="m", members=(Q,), scheme="per_block", block=(128, 128))
    # rank 1 of 2 holding rows 128..256 of Q (column parallel), all 256 columns
    rows = Route(hf_name=Q, hf_shape=(256, 256), param_name="m.weight", param_shape=(128, 256), hf_start=(128, 0),
                 param_start=(0, 0), extent=(128, 256))
    r = _scale_route(rows, g, "s", "m.weight_scale_inv", (1, 2), (256, 256))
    assert (r.hf_shape, r.hf_start, r.extent, r.param_start) == ((2, 2), (1, 0), (1, 2), (0, 0))
    odd = Route(hf_name=Q, hf_shape=(256, 256), param_name="m.weight", param_shape=(192, 256), hf_start=(64, 0),
                param_start=(0, 0), extent=(192, 256))
    with pytest.raises(RoutingError, match="not on the 128x128 blocks of FP8 layer 'm'"):
        _scale_route(odd, g, "s", "m.weight_scale_inv", (2, 2), (256, 256))
    one = _scale_route(rows, Fp8Group(module="m", members=(Q,), scheme="per_tensor"), "s", "m.weight_scale", (1,),
                       (256, 256))
    assert one.hf_indices().tolist() == [0] and one.param_indices().tolist() == [0] and one.hf_numel == 1
    channel = _scale_route(rows, Fp8Group(module="m", members=(Q,), scheme="per_channel"), "s", "m.weight_scale",
                           (128, 1), (256, 256))
    assert channel.hf_indices().tolist() == list(range(128, 256)) and channel.param_indices().tolist() == \
        list(range(128))
    assert math.prod(channel.hf_shape) == 256


def test_a_plan_that_vllm_cannot_build_is_a_config_error(tmp_path):
    pytest.importorskip("vllm")
    with pytest.raises(ConfigError, match="vLLM could not build the engine's model"):
        fp8_plan(tmp_path / "no-model", quantization="fp8")
