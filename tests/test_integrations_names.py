"""canonical_names: the names of wrapped models (DDP, torch.compile, activation checkpointing) become the plain
model's own names, checked against real wrappers' state dicts and a hand-written table."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from deltasync.errors import ConfigError
from deltasync.integrations import canonical_name, canonical_names


def small_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Sequential(nn.Linear(8, 2)))


@pytest.mark.parametrize(
    ("wrapped", "plain"),
    [
        ("module.layers.0.weight", "layers.0.weight"),  # DDP
        ("_orig_mod.layers.0.weight", "layers.0.weight"),  # torch.compile
        ("module._orig_mod.lm_head.weight", "lm_head.weight"),  # DDP(compile(model))
        ("_orig_mod.module.lm_head.weight", "lm_head.weight"),  # compile(DDP(model))
        ("model.layers.3._orig_mod.mlp.weight", "model.layers.3.mlp.weight"),  # one block compiled
        ("_fsdp_wrapped_module.model.layers.1._fsdp_wrapped_module.q.weight", "model.layers.1.q.weight"),
        ("model.layers.0._checkpoint_wrapped_module.mlp.up.weight", "model.layers.0.mlp.up.weight"),
        ("encoder.module.weight", "encoder.module.weight"),  # a submodule really called "module" stays
        ("module", "module"),  # a top-level tensor called "module" is not a prefix
        ("lm_head.weight", "lm_head.weight"),
    ],
)
def test_wrapper_prefixes_are_removed(wrapped, plain):
    assert canonical_name(wrapped) == plain


def test_real_wrappers_give_the_plain_models_names_and_the_same_tensors():
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
        checkpoint_wrapper,
    )

    model = small_model()
    plain = model.state_dict()
    compiled = torch.compile(model)  # nothing is compiled until it is called
    assert all(k.startswith("_orig_mod.") for k in compiled.state_dict())
    got = canonical_names(compiled.state_dict())
    assert list(got) == list(plain)
    assert all(got[k].data_ptr() == plain[k].data_ptr() for k in plain)  # the same tensors, not copies

    # its state_dict() hides the wrapper, its parameters do not (a trainer may publish those)
    inner = small_model()
    inner[2] = checkpoint_wrapper(inner[2])
    params = dict(inner.named_parameters())
    assert any("_checkpoint_wrapped_module" in n for n in params)
    assert list(canonical_names(params)) == [n for n, _ in small_model().named_parameters()]


def test_ddp_names(tmp_path):
    """A real DistributedDataParallel (gloo, world size 1) publishes the plain model's names."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        model = small_model()
        ddp = nn.parallel.DistributedDataParallel(model)
        assert all(k.startswith("module.") for k in ddp.state_dict())
        assert list(canonical_names(ddp.state_dict())) == list(model.state_dict())
    finally:
        dist.destroy_process_group()


def test_names_hook_maps_after_stripping():
    sd = {"module.model.embed.weight": 1, "module.head.weight": 2}
    got = canonical_names(sd, names=lambda n: n.replace("model.", "backbone.", 1))
    assert got == {"backbone.embed.weight": 1, "head.weight": 2}


def test_two_tensors_with_one_canonical_name_are_refused():
    with pytest.raises(ConfigError, match=r"'module\.w' and '_orig_mod\.w' both become 'w'"):
        canonical_names({"module.w": 1, "_orig_mod.w": 2})
    with pytest.raises(ConfigError, match="names= is applied"):
        canonical_names({"a": 1, "b": 2}, names=lambda n: "same")


@pytest.mark.parametrize("bad", ["", None, 3])
def test_names_hook_must_return_a_name(bad):
    with pytest.raises(ConfigError, match=r"mapped 'w' to"):
        canonical_names({"w": 1}, names=lambda n: bad)


def test_a_transformers_moe_publishes_its_checkpoint_layout_not_its_fused_experts(tmp_path):
    """transformers 5 holds a Qwen3-MoE layer's experts fused (``experts.gate_up_proj`` [E, 2I, H]); a stream of
    the module must carry what ``save_pretrained`` writes (one tensor per expert), the names every engine loads:
    checked against the saved file, names, shapes and bits, also after a step that changes one expert."""
    tf = pytest.importorskip("transformers")
    from safetensors.torch import load_file

    from deltasync import DeltaPublisher, StreamReader

    cfg = tf.Qwen3MoeConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                            num_key_value_heads=1, head_dim=16, intermediate_size=64, moe_intermediate_size=16,
                            num_experts=4, num_experts_per_tok=2)
    torch.manual_seed(0)
    model = tf.Qwen3MoeForCausalLM(cfg).bfloat16()
    assert any("experts.gate_up_proj" in n for n in model.state_dict())  # fused in memory
    url = str(tmp_path / "stream")
    with DeltaPublisher(url, model, anchor_every=100) as pub:
        pub.publish(0)
        with torch.no_grad():
            model.model.layers[1].mlp.experts.gate_up_proj[2, 20, 3] += 1  # expert 2's up_proj, row 4
        pub.publish(1)
    model.save_pretrained(tmp_path / "saved")
    saved = load_file(str(tmp_path / "saved" / "model.safetensors"))
    with StreamReader(url) as reader:
        got = reader.state_dict(1)
        changed = {n for n, t in reader.open(1).header.tensors.items() if t.changed}
    assert got.keys() == saved.keys()
    assert all(torch.equal(got[n].view(torch.int16), saved[n].view(torch.int16)) for n in saved)
    assert changed == {"model.layers.1.mlp.experts.2.up_proj.weight"}
