"""Routing from checkpoint tensors to (fused, tensor-parallel) engine parameters, without an engine.

The expected local parameters are built the way vLLM's weight loaders slice them (q by rank, k/v by
``rank // replicas``, row-parallel by column block, vocab padded then split), independently of the
routing code, and compared element for element with what the routes scatter.
"""

from __future__ import annotations

import pytest
import torch

from deltasync.format.checksum import add, checksum_elements
from deltasync.format.checksum import tensor_checksum as checksum_tensor
from rollout_loader.routing import ParamSpec, RoutingError, Shard, build_routing_table, packed_resolver

H, HEADS, KV, HD, INTER, VOCAB, PAD = 64, 4, 2, 16, 96, 100, 64
PACKED = {"qkv_proj": ["q_proj", "k_proj", "v_proj"], "gate_up_proj": ["gate_proj", "up_proj"]}
P = "model.layers.0."


def checkpoint(tie: bool = False) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    shapes = {
        "model.embed_tokens.weight": (VOCAB, H),
        P + "self_attn.q_proj.weight": (HEADS * HD, H),
        P + "self_attn.k_proj.weight": (KV * HD, H),
        P + "self_attn.v_proj.weight": (KV * HD, H),
        P + "self_attn.q_proj.bias": (HEADS * HD,),
        P + "self_attn.k_proj.bias": (KV * HD,),
        P + "self_attn.v_proj.bias": (KV * HD,),
        P + "self_attn.o_proj.weight": (H, HEADS * HD),
        P + "mlp.gate_proj.weight": (INTER, H),
        P + "mlp.up_proj.weight": (INTER, H),
        P + "mlp.down_proj.weight": (H, INTER),
        P + "input_layernorm.weight": (H,),
        "model.norm.weight": (H,),
    }
    if not tie:
        shapes["lm_head.weight"] = (VOCAB, H)
    return {k: torch.randn(*s, generator=g).bfloat16() for k, s in shapes.items()}


def specs(tp: int, tie: bool = False) -> list[ParamSpec]:
    """This rank's parameters, as the worker describes a Qwen-style model under tensor parallelism."""
    rep = max(1, tp // KV)
    kv_local = max(1, KV // tp) * HD
    qkv = (Shard(size=HEADS * HD), Shard(size=KV * HD, replicas=rep), Shard(size=KV * HD, replicas=rep))
    qkv_rows = HEADS * HD // tp + 2 * kv_local
    padded = -(-VOCAB // PAD) * PAD
    vocab = (Shard(size=VOCAB, padded_size=padded),)
    out = [
        ParamSpec(name="model.embed_tokens.weight", shape=(padded // tp, H), split_dim=0, shards=vocab),
        ParamSpec(name=P + "self_attn.qkv_proj.weight", shape=(qkv_rows, H), split_dim=0, shards=qkv),
        ParamSpec(name=P + "self_attn.qkv_proj.bias", shape=(qkv_rows,), split_dim=0, shards=qkv),
        ParamSpec(name=P + "self_attn.o_proj.weight", shape=(H, HEADS * HD // tp), split_dim=1),
        ParamSpec(
            name=P + "mlp.gate_up_proj.weight",
            shape=(2 * INTER // tp, H),
            split_dim=0,
            shards=(Shard(size=INTER), Shard(size=INTER)),
        ),
        ParamSpec(name=P + "mlp.down_proj.weight", shape=(H, INTER // tp), split_dim=1),
        ParamSpec(name=P + "input_layernorm.weight", shape=(H,)),
        ParamSpec(name="model.norm.weight", shape=(H,)),
    ]
    if not tie:
        out.append(ParamSpec(name="lm_head.weight", shape=(padded // tp, H), split_dim=0, shards=vocab))
    return out


def table(tp: int, rank: int, tie: bool = False, ckpt: dict | None = None, **kw):
    ckpt = ckpt if ckpt is not None else checkpoint(tie)
    tied = {"lm_head.weight": "model.embed_tokens.weight"} if tie else None
    return build_routing_table(
        {k: list(v.shape) for k, v in ckpt.items()},
        specs(tp, tie),
        resolve=packed_resolver(PACKED),
        tp_rank=rank,
        tp_size=tp,
        tied=tied,
        **kw,
    )


def expected_local(ckpt: dict[str, torch.Tensor], tp: int, rank: int) -> dict[str, torch.Tensor]:
    """The local parameters as vLLM's loaders would fill them (padding rows zero)."""
    rep = max(1, tp // KV)

    def col(t: torch.Tensor, blocks: int, block: int) -> torch.Tensor:
        return t.chunk(blocks, dim=0)[block]

    def qkv(suffix: str) -> torch.Tensor:
        q, k, v = (ckpt[P + f"self_attn.{n}_proj.{suffix}"] for n in "qkv")
        return torch.cat([col(q, tp, rank), col(k, tp // rep, rank // rep), col(v, tp // rep, rank // rep)])

    def vocab(t: torch.Tensor) -> torch.Tensor:
        padded = torch.zeros(-(-VOCAB // PAD) * PAD, H, dtype=t.dtype)
        padded[:VOCAB] = t
        return col(padded, tp, rank)

    out = {
        "model.embed_tokens.weight": vocab(ckpt["model.embed_tokens.weight"]),
        P + "self_attn.qkv_proj.weight": qkv("weight"),
        P + "self_attn.qkv_proj.bias": qkv("bias"),
        P + "self_attn.o_proj.weight": ckpt[P + "self_attn.o_proj.weight"].chunk(tp, dim=1)[rank],
        P + "mlp.gate_up_proj.weight": torch.cat(
            [col(ckpt[P + "mlp.gate_proj.weight"], tp, rank), col(ckpt[P + "mlp.up_proj.weight"], tp, rank)]
        ),
        P + "mlp.down_proj.weight": ckpt[P + "mlp.down_proj.weight"].chunk(tp, dim=1)[rank],
        P + "input_layernorm.weight": ckpt[P + "input_layernorm.weight"],
        "model.norm.weight": ckpt["model.norm.weight"],
    }
    if "lm_head.weight" in ckpt:
        out["lm_head.weight"] = vocab(ckpt["lm_head.weight"])
    return out


def scatter(ckpt: dict[str, torch.Tensor], tp: int, rank: int, tie: bool = False) -> dict[str, torch.Tensor]:
    """Local parameters filled through the routing table."""
    t = table(tp, rank, tie, ckpt)
    local = {s.name: torch.zeros(s.shape, dtype=torch.bfloat16) for s in specs(tp, tie)}
    for name, route in t.routes.items():
        local[route.param_name].view(-1)[route.param_indices()] = ckpt[name].reshape(-1)[route.hf_indices()]
    return local


@pytest.mark.parametrize("tie", [False, True])
@pytest.mark.parametrize(("tp", "rank"), [(1, 0), (2, 0), (2, 1), (4, 0), (4, 1), (4, 2), (4, 3)])
def test_routes_place_every_element_where_the_loaders_do(tp: int, rank: int, tie: bool) -> None:
    ckpt = checkpoint(tie)
    got, want = scatter(ckpt, tp, rank, tie), expected_local(ckpt, tp, rank)
    assert got.keys() == want.keys()
    for name in want:
        assert torch.equal(got[name], want[name]), name


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_owned_boxes_partition_each_tensor_and_checksums_add_up(tp: int) -> None:
    """Replicated blocks count on one rank only, so per-rank checksums sum to the whole tensor's."""
    ckpt = checkpoint()
    tables = [table(tp, r) for r in range(tp)]
    for name, t in ckpt.items():
        owned = torch.cat([tb.routes[name].hf_indices() for tb in tables if tb.routes[name].owner])
        assert torch.equal(owned.sort().values, torch.arange(t.numel())), name
        parts = []
        for r, tb in enumerate(tables):
            route = tb.routes[name]
            local = expected_local(ckpt, tp, r)[route.param_name]
            if route.owner:
                parts.append(checksum_elements(local.reshape(-1)[route.param_indices()], route.hf_indices()))
        assert add(*parts) == checksum_tensor(t), name


@pytest.mark.parametrize(("tp", "rank"), [(1, 0), (4, 1), (4, 3)])
def test_localize_agrees_with_the_box(tp: int, rank: int) -> None:
    ckpt = checkpoint()
    g = torch.Generator().manual_seed(1)
    for name, route in table(tp, rank).routes.items():
        n = ckpt[name].numel()
        pos = torch.randperm(n, generator=g)[: n // 3].sort().values
        keep, idx = route.localize(pos)
        held = dict(zip(route.hf_indices().tolist(), route.param_indices().tolist(), strict=True))
        kept = [True] * pos.numel() if keep is None else keep.tolist()  # None: every position is held
        assert kept == [p in held for p in pos.tolist()], name
        assert idx.tolist() == [held[p] for p in pos.tolist() if p in held], name


def test_tp1_routes_are_identity_or_fused_offsets() -> None:
    t = table(1, 0)
    q, k, v = (t[P + f"self_attn.{n}_proj.weight"] for n in "qkv")
    assert (q.param_start, k.param_start, v.param_start) == ((0, 0), (HEADS * HD, 0), ((HEADS + KV) * HD, 0))
    assert all(r.whole and r.owner for r in t.routes.values())
    assert t[P + "mlp.up_proj.weight"].param_start == (INTER, 0)
    assert t["lm_head.weight"].param_name == "lm_head.weight"
    assert len(t.by_param()[P + "self_attn.qkv_proj.weight"]) == 3


def test_vocab_rank_past_the_vocabulary_holds_only_padding() -> None:
    shapes = {"embed.weight": [VOCAB, 8]}
    spec = [ParamSpec(name="embed.weight", shape=(16, 8), split_dim=0, shards=(Shard(size=VOCAB, padded_size=128),))]
    ident = packed_resolver({})
    last = build_routing_table(shapes, spec, resolve=ident, tp_rank=7, tp_size=8)["embed.weight"]
    assert last.numel == 0 and last.hf_indices().numel() == 0
    six = build_routing_table(shapes, spec, resolve=ident, tp_rank=6, tp_size=8)["embed.weight"]
    assert (six.hf_start, six.extent) == ((96, 0), (4, 8))


def test_tied_embeddings() -> None:
    t = table(1, 0, tie=True)
    assert dict(t.tied) == {"lm_head.weight": "model.embed_tokens.weight"}
    assert "lm_head.weight" not in t.routes
    with pytest.raises(RoutingError, match="tied to 'model.embed_tokens.weight'"):
        table(1, 0, tie=True, ckpt={**checkpoint(tie=True), "lm_head.weight": torch.zeros(VOCAB, H)})
    assert (
        "lm_head.weight"
        not in table(
            1,
            0,
            tie=True,
            ckpt={**checkpoint(tie=True), "lm_head.weight": torch.zeros(VOCAB, H)},
            ignore=["lm_head.weight"],
        ).routes
    )


def test_resolver_renames_then_unpacks() -> None:
    resolve = packed_resolver(PACKED, rename=lambda n: None if "rotary" in n else n.replace("language_model.", ""))
    assert resolve("language_model.model.layers.3.self_attn.v_proj.weight") == (
        "model.layers.3.self_attn.qkv_proj.weight",
        2,
    )
    assert resolve("model.layers.3.mlp.up_proj.bias") == ("model.layers.3.mlp.gate_up_proj.bias", 1)
    assert resolve("model.norm.weight") == ("model.norm.weight", None)
    assert resolve("model.rotary_emb.inv_freq") is None


@pytest.mark.parametrize(
    ("change", "match"),
    [
        (
            lambda c: c.update({"model.layers.9.mlp.up_proj.weight": torch.zeros(INTER, H)}),
            "no engine parameter 'model.layers.9",
        ),
        (lambda c: c.pop(P + "self_attn.k_proj.weight"), r"shards \[1\] are fed by no checkpoint tensor"),
        (lambda c: c.pop("model.norm.weight"), "'model.norm.weight' is fed by no checkpoint tensor"),
        (
            lambda c: c.update({P + "mlp.up_proj.weight": torch.zeros(INTER + 1, H)}),
            "dim 0 is 97, the parameter expects 96",
        ),
        (lambda c: c.update({P + "mlp.down_proj.weight": torch.zeros(H, INTER, 1)}), "differ in rank"),
        (
            lambda c: c.update({"model.norm.weight": torch.zeros(H + 1)}),
            r"shape \[65\] does not fit parameter shape \[64\]",
        ),
        (
            lambda c: c.update({"model.rotary_emb.inv_freq": torch.zeros(8)}),
            "no engine parameter 'model.rotary_emb.inv_freq'",
        ),
    ],
)
def test_unroutable_checkpoints_fail_at_build_time(change, match: str) -> None:
    ckpt = checkpoint()
    change(ckpt)
    with pytest.raises(RoutingError, match=match):
        table(2, 1, ckpt=ckpt)


def test_bad_parallel_layouts_fail_at_build_time() -> None:
    with pytest.raises(RoutingError, match="outside world size"):
        table(2, 2)
    with pytest.raises(RoutingError, match="equal blocks|does not fit"):
        build_routing_table(
            {"w": [10, 4]},
            [ParamSpec(name="w", shape=(3, 4), split_dim=0)],
            resolve=packed_resolver({}),
            tp_rank=0,
            tp_size=3,
        )
    with pytest.raises(RoutingError, match="both feed"):
        build_routing_table(
            {"a.weight": [4], "b.weight": [4]},
            [ParamSpec(name="a.weight", shape=(4,))],
            resolve=lambda n: ("a.weight", None),
        )
    with pytest.raises(RoutingError, match="engine drops"):
        build_routing_table({"x": [1]}, [], resolve=lambda n: None)
