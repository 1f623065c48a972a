"""Routes learned from a loader's copies, without an engine.

A small loader written the way vLLM's weight loaders work (views of the checkpoint tensor narrowed by rank,
copied into views of the parameter: q/k/v stacked, kv heads replicated across ranks, a padded vocabulary with
its padding filled, MoE experts selected then narrowed) runs once over meta tensors under
:class:`CopyRecorder`. The routes it yields must put every element where an independent formulation of the
same layout (``torch.cat``/``chunk`` of real tensors) puts it, element for element.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from deltasync.format.checksum import add, checksum_elements
from deltasync.format.checksum import tensor_checksum as checksum_tensor
from rollout_loader.routing import CopyRecorder, RoutingError, RoutingTable, assign_owners, build_routing_table

H, HEADS, KV, HD, INTER, VOCAB, PAD, EXPERTS, MOE = 64, 4, 2, 16, 96, 100, 64, 4, 32
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
        P + "moe.gate.weight": (EXPERTS, H),
        P + "input_layernorm.weight": (H,),
        "model.norm.weight": (H,),
    }
    for e in range(EXPERTS):
        for n, s in (("gate_proj", (MOE, H)), ("up_proj", (MOE, H)), ("down_proj", (H, MOE))):
            shapes[f"{P}moe.experts.{e}.{n}.weight"] = s
    if not tie:
        shapes["lm_head.weight"] = (VOCAB, H)
    return {k: torch.randn(*s, generator=g).bfloat16() for k, s in shapes.items()}


def param_shapes(tp: int, tie: bool = False) -> dict[str, tuple[int, ...]]:
    kv_local = max(1, KV // tp) * HD
    qkv_rows = HEADS * HD // tp + 2 * kv_local
    padded = -(-VOCAB // PAD) * PAD
    out = {
        "model.embed_tokens.weight": (padded // tp, H),
        P + "self_attn.qkv_proj.weight": (qkv_rows, H),
        P + "self_attn.qkv_proj.bias": (qkv_rows,),
        P + "self_attn.o_proj.weight": (H, HEADS * HD // tp),
        P + "mlp.gate_up_proj.weight": (2 * INTER // tp, H),
        P + "mlp.down_proj.weight": (H, INTER // tp),
        P + "moe.gate.weight": (EXPERTS, H),
        P + "moe.experts.w13_weight": (EXPERTS, 2 * MOE // tp, H),
        P + "moe.experts.w2_weight": (EXPERTS, H, MOE // tp),
        P + "input_layernorm.weight": (H,),
        "model.norm.weight": (H,),
    }
    if not tie:
        out["lm_head.weight"] = (padded // tp, H)
    return out


def load(params: dict[str, torch.Tensor], ckpt: dict[str, torch.Tensor], tp: int, rank: int) -> None:
    """Fill ``params`` from ``ckpt`` the way vLLM's loaders do: views and copy_ only."""
    rep = max(1, tp // KV)
    for name, w in ckpt.items():
        mod, _, leaf = name.rpartition(".")
        last = mod.rpartition(".")[2]
        if last in ("q_proj", "k_proj", "v_proj"):
            p = params[f"{mod.rpartition('.')[0]}.qkv_proj.{leaf}"]
            q_local, kv_local = HEADS * HD // tp, max(1, KV // tp) * HD
            shard_rank = rank if last == "q_proj" else rank // rep
            size = q_local if last == "q_proj" else kv_local
            offset = {"q_proj": 0, "k_proj": q_local, "v_proj": q_local + kv_local}[last]
            p.narrow(0, offset, size).copy_(w.narrow(0, shard_rank * size, size))
        elif last in ("gate_proj", "up_proj") and ".experts." not in name:
            p = params[P + "mlp.gate_up_proj.weight"]
            size = INTER // tp
            p.narrow(0, size * (last == "up_proj"), size).copy_(w.narrow(0, rank * size, size))
        elif last in ("o_proj", "down_proj") and ".experts." not in name:
            size = w.shape[1] // tp
            params[name].copy_(w.narrow(1, rank * size, size))
        elif ".experts." in name:
            e, kind = int(name.split(".experts.")[1].split(".")[0]), last
            if kind == "down_proj":
                size = MOE // tp
                params[P + "moe.experts.w2_weight"][e].copy_(w.narrow(1, rank * size, size))
            else:
                size = MOE // tp
                expert = params[P + "moe.experts.w13_weight"][e]
                expert.narrow(0, size * (kind == "up_proj"), size).copy_(w.narrow(0, rank * size, size))
        elif name in ("model.embed_tokens.weight", "lm_head.weight"):
            p = params[name]
            rows = p.shape[0]
            start = rank * rows
            n = max(0, min(rows, VOCAB - start))
            p[:n].copy_(w.narrow(0, min(start, VOCAB), n))
            p[n:].fill_(0)
        else:
            params[name].copy_(w)


def expected_local(ckpt: dict[str, torch.Tensor], tp: int, rank: int) -> dict[str, torch.Tensor]:
    """The local parameters, formulated independently (cat and chunk of whole tensors; padding rows zero)."""
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

    def expert(e: int, n: str) -> torch.Tensor:
        return ckpt[f"{P}moe.experts.{e}.{n}.weight"]

    out = {
        "model.embed_tokens.weight": vocab(ckpt["model.embed_tokens.weight"]),
        P + "self_attn.qkv_proj.weight": qkv("weight"),
        P + "self_attn.qkv_proj.bias": qkv("bias"),
        P + "self_attn.o_proj.weight": ckpt[P + "self_attn.o_proj.weight"].chunk(tp, dim=1)[rank],
        P + "mlp.gate_up_proj.weight": torch.cat(
            [col(ckpt[P + "mlp.gate_proj.weight"], tp, rank), col(ckpt[P + "mlp.up_proj.weight"], tp, rank)]
        ),
        P + "mlp.down_proj.weight": ckpt[P + "mlp.down_proj.weight"].chunk(tp, dim=1)[rank],
        P + "moe.gate.weight": ckpt[P + "moe.gate.weight"],
        P + "moe.experts.w13_weight": torch.stack([
            torch.cat([col(expert(e, "gate_proj"), tp, rank), col(expert(e, "up_proj"), tp, rank)])
            for e in range(EXPERTS)]),
        P + "moe.experts.w2_weight": torch.stack([expert(e, "down_proj").chunk(tp, dim=1)[rank]
                                                  for e in range(EXPERTS)]),
        P + "input_layernorm.weight": ckpt[P + "input_layernorm.weight"],
        "model.norm.weight": ckpt["model.norm.weight"],
    }
    if "lm_head.weight" in ckpt:
        out["lm_head.weight"] = vocab(ckpt["lm_head.weight"])
    return out


def table(tp: int, rank: int, tie: bool = False, ckpt: dict | None = None, loader: Callable = load,
          shapes: dict | None = None, **kw) -> RoutingTable:
    """The routing table recorded from ``loader`` over meta tensors (no data)."""
    ckpt = ckpt if ckpt is not None else checkpoint(tie)
    shapes = shapes or param_shapes(tp, tie)
    params = {n: torch.empty(s, dtype=torch.bfloat16, device="meta") for n, s in shapes.items()}
    sources = {n: torch.empty(t.shape, dtype=t.dtype, device="meta") for n, t in ckpt.items()}
    with CopyRecorder(params, sources) as rec:
        loader(params, sources, tp, rank)
    tied = {"lm_head.weight": "model.embed_tokens.weight"} if tie else {}
    return build_routing_table({k: list(v.shape) for k, v in ckpt.items()}, rec.copies, shapes, fills=rec.fills,
                               problems=rec.problems, tied=tied, unfed_ok=tied, tp_rank=rank, tp_size=tp, **kw)


def scatter(ckpt: dict[str, torch.Tensor], t: RoutingTable, tp: int, tie: bool) -> dict[str, torch.Tensor]:
    """Local parameters filled through the routing table."""
    local = {n: torch.zeros(s, dtype=torch.bfloat16) for n, s in param_shapes(tp, tie).items()}
    for name, pieces in t.routes.items():
        for route in pieces:
            local[route.param_name].view(-1)[route.param_indices()] = ckpt[name].reshape(-1)[route.hf_indices()]
    return local


@pytest.mark.parametrize("tie", [False, True])
@pytest.mark.parametrize(("tp", "rank"), [(1, 0), (2, 0), (2, 1), (4, 0), (4, 1), (4, 2), (4, 3)])
def test_routes_place_every_element_where_the_loaders_do(tp: int, rank: int, tie: bool) -> None:
    ckpt = checkpoint(tie)
    got, want = scatter(ckpt, table(tp, rank, tie), tp, tie), expected_local(ckpt, tp, rank)
    loaded = {n: torch.zeros(s, dtype=torch.bfloat16) for n, s in param_shapes(tp, tie).items()}
    load(loaded, ckpt, tp, rank)  # the test's loader on real data agrees with the reference too
    assert got.keys() == want.keys() - ({"lm_head.weight"} if tie else set())
    for name in got:
        assert torch.equal(got[name], want[name]), name
        assert torch.equal(loaded[name], want[name]), name


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_owned_boxes_partition_each_tensor_and_checksums_add_up(tp: int) -> None:
    """Replicated blocks count on one rank only, so per-rank checksums sum to the whole tensor's."""
    ckpt = checkpoint()
    raw = [table(tp, r) for r in range(tp)]
    tables = [assign_owners(t, [t.boxes() for t in raw]) for t in raw]
    for name, t in ckpt.items():
        owned = torch.cat([r.hf_indices() for tb in tables for r in tb.routes[name] if r.owner])
        assert torch.equal(owned.sort().values, torch.arange(t.numel())), name
        parts = []
        for rank, tb in enumerate(tables):
            for route in tb.routes[name]:
                local = expected_local(ckpt, tp, rank)[route.param_name]
                if route.owner:
                    parts.append(checksum_elements(local.reshape(-1)[route.param_indices()], route.hf_indices()))
        assert add(*parts) == checksum_tensor(t), name


@pytest.mark.parametrize(("tp", "rank"), [(1, 0), (2, 1), (4, 1), (4, 3)])
def test_localize_agrees_with_the_box(tp: int, rank: int) -> None:
    ckpt = checkpoint()
    g = torch.Generator().manual_seed(1)
    for name, (route,) in table(tp, rank).routes.items():
        n = ckpt[name].numel()
        pos = torch.randperm(n, generator=g)[: n // 3].sort().values
        keep, idx = route.localize(pos)
        held = dict(zip(route.hf_indices().tolist(), route.param_indices().tolist(), strict=True))
        kept = [True] * pos.numel() if keep is None else keep.tolist()  # None: every position is held
        assert kept == [p in held for p in pos.tolist()], name
        assert idx.tolist() == [held[p] for p in pos.tolist() if p in held], name


def test_tp1_routes_are_identity_fused_or_expert_offsets() -> None:
    t = table(1, 0)
    (q,), (k,), (v,) = (t[P + f"self_attn.{n}_proj.weight"] for n in "qkv")
    assert (q.param_start, k.param_start, v.param_start) == ((0, 0), (HEADS * HD, 0), ((HEADS + KV) * HD, 0))
    assert all(r.whole for pieces in t.routes.values() for r in pieces)
    (up,) = t[f"{P}moe.experts.2.up_proj.weight"]
    assert (up.param_start, up.param_extent, up.extent) == ((2, MOE, 0), (1, MOE, H), (MOE, H))
    assert len(t.by_param()[P + "moe.experts.w13_weight"]) == 2 * EXPERTS


def test_vocab_rank_past_the_vocabulary_holds_only_padding() -> None:
    """Rows past the vocabulary are padding the loader fills: fed by no checkpoint element, yet not missing."""
    t = table(4, 3)  # 128 padded rows, 32 per rank: rank 3 holds rows 96..127, of which 96..99 are real
    (route,) = t["model.embed_tokens.weight"]
    assert (route.hf_start, route.extent) == ((96, 0), (4, H))


def test_tied_embeddings_need_no_route() -> None:
    t = table(1, 0, tie=True)
    assert dict(t.tied) == {"lm_head.weight": "model.embed_tokens.weight"}
    assert "lm_head.weight" not in t.routes


def _transposing(params, ckpt, tp, rank):
    load(params, {k: v for k, v in ckpt.items() if k != P + "moe.gate.weight"}, tp, rank)
    params[P + "moe.gate.weight"].t().copy_(ckpt[P + "moe.gate.weight"].t())  # same elements, transposed views


def _computed(params, ckpt, tp, rank):
    load(params, ckpt, tp, rank)
    params["model.norm.weight"].copy_(ckpt["model.norm.weight"] * 2)  # not a view of the checkpoint tensor


def _scaled(params, ckpt, tp, rank):
    load(params, ckpt, tp, rank)
    params["model.norm.weight"].mul_(2)


def _twice(params, ckpt, tp, rank):
    load(params, ckpt, tp, rank)
    params[P + "input_layernorm.weight"].copy_(ckpt["model.norm.weight"])


def _skipping(name):
    def loader(params, ckpt, tp, rank):
        load(params, {k: v for k, v in ckpt.items() if k != name}, tp, rank)
    return loader


@pytest.mark.parametrize(
    ("loader", "match"),
    [
        (_transposing, r"'model.layers.0.moe.gate.weight' -> .*transposed, strided or broadcast"),
        (_computed, "'model.norm.weight': copied from something other than a view"),
        (_scaled, r"'model.norm.weight': written by aten.mul_"),
        (_twice, r"'model.norm.weight': copied into 2 parameters"),
        (_skipping(P + "self_attn.k_proj.weight"), r"drops this tensor(.|\n)*qkv_proj.weight': 1024 of its 4096"),
        (_skipping("model.norm.weight"), "'model.norm.weight' is fed by no checkpoint tensor"),
    ],
)
def test_unroutable_loaders_fail_at_build_time_naming_the_tensor(loader, match: str) -> None:
    with pytest.raises(RoutingError, match=match):
        table(2, 1, loader=loader)


def test_checkpoint_tensors_the_engine_drops_are_named_unless_ignored() -> None:
    ckpt = {**checkpoint(), "model.rotary_emb.inv_freq": torch.zeros(8)}
    with pytest.raises(RoutingError, match="'model.rotary_emb.inv_freq': the engine drops this tensor"):
        table(1, 0, ckpt=ckpt, loader=lambda p, c, tp,
              r: load(p, {k: v for k, v in c.items() if "rotary" not in k}, tp, r))
    t = table(1, 0, ckpt=ckpt, ignore=["model.rotary_emb.inv_freq"],
              loader=lambda p, c, tp, r: load(p, {k: v for k, v in c.items() if "rotary" not in k}, tp, r))
    assert "model.rotary_emb.inv_freq" not in t.routes


def test_ranks_holding_overlapping_unequal_boxes_have_no_owner() -> None:
    t = table(2, 1)
    name = "model.norm.weight"
    with pytest.raises(RoutingError, match="overlapping, unequal parts"):
        assign_owners(t, [{name: [((0,), (H // 2 + 1,))]}, {}])


def test_a_fused_checkpoint_tensor_split_by_the_loader_routes_in_pieces() -> None:
    """A checkpoint that keeps q, k and v fused (Phi-3) or experts fused (transformers 5): the loader narrows the
    one tensor into several places of one parameter; each place is a piece, and together they place it."""
    fused = P + "self_attn.qkv_proj.weight"
    ckpt = checkpoint()
    qkv = {n: ckpt.pop(P + f"self_attn.{n}_proj.weight") for n in "qkv"}
    ckpt[fused] = torch.cat(list(qkv.values()))

    def loader(params, c, tp, rank):
        rows = [HEADS * HD, KV * HD, KV * HD]
        parts = dict(zip("qkv", c[fused].split(rows), strict=True))  # views of the fused tensor
        load(params, {**{k: v for k, v in c.items() if k != fused},
                      **{P + f"self_attn.{n}_proj.weight": t for n, t in parts.items()}}, tp, rank)

    for tp, rank in ((1, 0), (2, 1), (4, 3)):
        t = table(tp, rank, ckpt=ckpt, loader=loader)
        assert len(t[fused]) == 3
        got = scatter(ckpt, t, tp, False)
        want = expected_local({**ckpt, **{P + f"self_attn.{n}_proj.weight": v for n, v in qkv.items()}}, tp, rank)
        assert torch.equal(got[fused], want[fused])


def test_experts_other_ranks_hold_route_nowhere_here() -> None:
    """Under expert parallelism a rank's loader skips the experts of other ranks: no piece here, and no error,
    as long as some rank copies them."""
    def loader(params, c, tp, rank):
        load(params, {k: v for k, v in c.items() if ".experts.3." not in k}, tp, rank)

    elsewhere = {f"{P}moe.experts.3.{n}.weight" for n in ("gate_proj", "up_proj", "down_proj")}
    local = {**param_shapes(1), P + "moe.experts.w13_weight": (EXPERTS - 1, 2 * MOE, H),
             P + "moe.experts.w2_weight": (EXPERTS - 1, H, MOE)}  # this rank's experts 0..2
    with pytest.raises(RoutingError, match=r"experts.3.gate_proj.weight': the engine drops this tensor"):
        table(1, 0, loader=loader, shapes=local)
    t = table(1, 0, loader=loader, shapes=local, held_elsewhere=elsewhere)
    assert all(t[n] == () for n in elsewhere)
