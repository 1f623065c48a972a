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
          shapes: dict | None = None, dtypes: dict | None = None, **kw) -> RoutingTable:
    """The routing table recorded from ``loader`` over meta tensors (no data)."""
    ckpt = ckpt if ckpt is not None else checkpoint(tie)
    shapes = shapes or param_shapes(tp, tie)
    params = {n: torch.empty(s, dtype=(dtypes or {}).get(n, torch.bfloat16), device="meta") for n, s in shapes.items()}
    sources = {n: torch.empty(t.shape, dtype=t.dtype, device="meta") for n, t in ckpt.items()}
    with CopyRecorder(params, sources) as rec:
        loader(params, sources, tp, rank)
    tied = kw.pop("tied", {"lm_head.weight": "model.embed_tokens.weight"} if tie else {})
    unfed = kw.pop("unfed_ok", tied)
    return build_routing_table({k: list(v.shape) for k, v in ckpt.items()}, rec.copies, shapes, fills=rec.fills,
                               problems=rec.problems, untraced=rec.untraced, tied=tied, unfed_ok=unfed, tp_rank=rank,
                               tp_size=tp, **kw)


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


def _computed(params, ckpt, tp, rank):
    load(params, ckpt, tp, rank)
    params["model.norm.weight"].copy_(ckpt["model.norm.weight"] * 2)  # computed: no element map


def _scaled(params, ckpt, tp, rank):
    load(params, ckpt, tp, rank)
    params["model.norm.weight"].mul_(2)


def _twice(params, ckpt, tp, rank):
    load(params, ckpt, tp, rank)
    params[P + "input_layernorm.weight"].copy_(ckpt["model.norm.weight"])


def _broadcast(params, ckpt, tp, rank):
    load(params, {k: v for k, v in ckpt.items() if k != "model.norm.weight"}, tp, rank)
    params["model.norm.weight"].copy_(ckpt["model.norm.weight"][:1].expand(H))


def _replicas(params, ckpt, tp, rank):
    """Expert 0's gate in slots 0 and 1 (a redundant expert), expert 1's gate nowhere."""
    load(params, {k: v for k, v in ckpt.items() if k != f"{P}moe.experts.1.gate_proj.weight"}, tp, rank)
    params[P + "moe.experts.w13_weight"][1].narrow(0, 0, MOE).copy_(ckpt[f"{P}moe.experts.0.gate_proj.weight"])


def _skipping(name):
    def loader(params, ckpt, tp, rank):
        load(params, {k: v for k, v in ckpt.items() if k != name}, tp, rank)
    return loader


NO_RECORD = "vLLM keeps no checkpoint-format record of this parameter, so its module cannot be re-loaded alone"


@pytest.mark.parametrize(
    ("loader", "match"),
    [
        (_computed, r"'model.norm.weight': copied from values the loader computed from \['model.norm.weight'\] with "
                    f"no exact element map.*{NO_RECORD}"),
        (_scaled, rf"'model.norm.weight': written by aten.mul_.*{NO_RECORD}"),
        (_twice, r"'model.norm.weight': copied into 2 parameters"),
        (_replicas, r"experts.0.gate_proj.weight': the same elements are copied into 2 places of "
                    r"'model.layers.0.moe.experts.w13_weight'; replicas of one tensor \(redundant experts\)"),
        (_broadcast, r"'model.norm.weight': the loader broadcasts elements of \['model.norm.weight'\] into it"),
        (_skipping(P + "self_attn.k_proj.weight"), r"drops this tensor(.|\n)*qkv_proj.weight': 1024 of its 4096"),
        (_skipping("model.norm.weight"), "'model.norm.weight' is fed by no checkpoint tensor"),
    ],
)
def test_unroutable_loaders_fail_at_build_time_naming_the_tensor(loader, match: str) -> None:
    with pytest.raises(RoutingError, match=match):
        table(1 if loader is _replicas else 2, 0 if loader is _replicas else 1, loader=loader)


@pytest.mark.parametrize("loader", [_computed, _scaled])
def test_a_parameter_the_loader_computes_is_untraced_where_its_module_can_be_reloaded(loader) -> None:
    """No element map, but vLLM can re-load the module alone: the parameter is untraced (the engine re-loads its
    module from host copies of the tensors feeding it), not an error."""
    t = table(2, 1, loader=loader, reloadable=["model.norm.weight"])
    assert dict(t.untraced) == {"model.norm.weight": ("model.norm.weight",)}


def test_a_tensor_the_loader_refuses_names_the_loader_and_why() -> None:
    with pytest.raises(RoutingError, match=r"'model.norm.weight' \[64\]: vLLM's loader for this model raised on a meta "
                                           r"stand-in of it \(ValueError: boom\).*needs the tensor's values"):
        table(1, 0, refused={"model.norm.weight": "ValueError: boom"})


def test_checkpoint_tensors_the_engine_drops_are_named_unless_ignored() -> None:
    ckpt = {**checkpoint(), "model.rotary_emb.inv_freq": torch.zeros(8)}
    with pytest.raises(RoutingError, match=r"'model.rotary_emb.inv_freq': the engine drops this tensor \(vLLM's loader "
                                           r"(.|\n)*Leave it out of the engine's checkpoint and of the stream"):
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
    with pytest.raises(RoutingError, match=r"experts.3.gate_proj.weight': the engine drops this tensor \(vLLM"):
        table(1, 0, loader=loader, shapes=local)
    t = table(1, 0, loader=loader, shapes=local, held_elsewhere=elsewhere)
    assert all(t[n] == () for n in elsewhere)


# --- exact transformations on the way into a parameter (rollout_loader/lineage.py) ---

E, HH, II = 3, 8, 6  # gpt-oss-like experts: gate_up stored [E, H, 2I], down [E, I, H]


def transforming_checkpoint() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    shapes = {"experts.gate_up_proj": (E, HH, 2 * II), "experts.down_proj": (E, II, HH), "experts.down_bias": (E, HH),
              "A_log": (4,), "q": (4, 5), "k": (4, 5), "s0": (4, 5), "s1": (4, 5), "t0": (4, 5), "t1": (4, 5),
              "flat": (4, 5), "interleaved": (3, 8), "transposed": (4, 5)}
    return {n: torch.randn(*s, generator=g).bfloat16() for n, s in shapes.items()}


def transforming_params(tp: int) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    bf16 = torch.bfloat16
    return {"w13": ((E, 2 * II // tp, HH), bf16), "w2": ((E, HH, II // tp), bf16), "w2_bias": ((E, HH), bf16),
            "A_log": ((4,), torch.float32), "qk": ((8, 5), bf16), "stacked": ((2, 4, 5), bf16),
            "via_temporary": ((8, 5), bf16), "flat": ((20,), bf16), "split": ((3, 8), bf16),
            "transposed": ((4, 5), bf16)}


def transforming_load(params, ck, tp: int, rank: int) -> None:
    """Copies the way vLLM's loaders transform checkpoint tensors on their way (gpt-oss, Qwen3-Next, temporaries)."""
    per = II // tp
    gate_up = ck["experts.gate_up_proj"][:, :, 2 * rank * per:2 * (rank + 1) * per]  # gpt-oss: narrow, permute, copy
    params["w13"].copy_(gate_up.permute(0, 2, 1).contiguous())
    params["w2"].copy_(ck["experts.down_proj"][:, rank * per:(rank + 1) * per, :].permute(0, 2, 1).contiguous())
    bias = ck["experts.down_bias"]
    if rank != 0:
        bias.zero_()  # gpt-oss adds the down bias on rank 0 only: the other ranks zero the tensor they read
    params["w2_bias"].copy_(bias)
    params["A_log"].copy_(ck["A_log"])  # Qwen3-Next: a bf16 tensor widened into an fp32 parameter
    params["qk"].copy_(torch.cat([ck["q"], ck["k"]]))
    params["stacked"].copy_(torch.stack([ck["s0"], ck["s1"]]))
    tmp = torch.empty(8, 5, dtype=torch.bfloat16, device=ck["q"].device)
    tmp[:4].copy_(ck["t0"])
    tmp[4:].copy_(ck["t1"])
    params["via_temporary"].copy_(tmp)
    params["flat"].copy_(ck["flat"].reshape(-1))
    params["split"][:, :4].copy_(ck["interleaved"][:, ::2])  # interleaved gate/up into halves
    params["split"][:, 4:].copy_(ck["interleaved"][:, 1::2])
    params["transposed"].t().copy_(ck["transposed"].t())  # the same elements through transposed views


def transforming_table(tp: int, rank: int) -> RoutingTable:
    ck = transforming_checkpoint()
    shapes = transforming_params(tp)
    params = {n: torch.empty(s, dtype=d, device="meta") for n, (s, d) in shapes.items()}
    sources = {n: torch.empty(t.shape, dtype=t.dtype, device="meta") for n, t in ck.items()}
    with CopyRecorder(params, sources) as rec:
        transforming_load(params, sources, tp, rank)
    assert not rec.problems and not rec.untraced
    return build_routing_table({k: list(v.shape) for k, v in ck.items()}, rec.copies,
                               {n: s for n, (s, _) in shapes.items()}, fills=rec.fills, tp_rank=rank, tp_size=tp,
                               held_elsewhere=["experts.down_bias"] if rank else ())


@pytest.mark.parametrize(("tp", "rank"), [(1, 0), (2, 0), (2, 1), (3, 2)])
def test_transformed_copies_route_every_element_where_the_loader_puts_it(tp: int, rank: int) -> None:
    """A permute made contiguous, a concatenation, a stack, a temporary filled by copies, a reshape, stepped slices,
    transposed views and a dtype widening are exact element maps: the routes (with their casts) put every checkpoint
    element where the same loader puts it running on real data, and localize agrees with them."""
    ck = transforming_checkpoint()
    t = transforming_table(tp, rank)
    shapes = transforming_params(tp)
    want = {n: torch.zeros(s, dtype=d) for n, (s, d) in shapes.items()}
    transforming_load(want, {k: v.clone() for k, v in ck.items()}, tp, rank)
    got = {n: torch.zeros(s, dtype=d) for n, (s, d) in shapes.items()}
    g = torch.Generator().manual_seed(5)
    for name, pieces in t.routes.items():
        for r in pieces:
            values = ck[name].reshape(-1)[r.hf_indices()]
            for dtype in r.casts:
                values = values.to(dtype)
            got[r.param_name].view(-1)[r.param_indices()] = values
            pos = torch.randperm(ck[name].numel(), generator=g)[:9].sort().values
            keep, idx = r.localize(pos)
            held = dict(zip(r.hf_indices().tolist(), r.param_indices().tolist(), strict=True))
            kept = [True] * pos.numel() if keep is None else keep.tolist()
            assert kept == [p in held for p in pos.tolist()], name
            assert idx.tolist() == [held[p] for p in pos.tolist() if p in held], name
    for name in shapes:
        assert torch.equal(got[name], want[name]), name
    (gate_up,) = t["experts.gate_up_proj"]
    assert gate_up.axes == (0, 2, 1) and gate_up.extent == (E, HH, 2 * II // tp)  # [E, H, 2I/tp] -> [E, 2I/tp, H]
    assert t["A_log"][0].casts == (torch.float32,)
    assert [r.param_start for r in t["interleaved"]] == [(0, 0), (0, 4)] and t["interleaved"][0].hf_grid == (3, 4, 2)
    assert t["experts.down_bias"] == (() if rank else t["experts.down_bias"])  # zeroed on the other ranks: a fill


def test_transformed_routes_own_each_element_once_across_ranks() -> None:
    """Owners across tensor-parallel ranks of permuted and stepped pieces: each checkpoint element counted once."""
    ck = transforming_checkpoint()
    raw = [transforming_table(2, r) for r in range(2)]
    tables = [assign_owners(t, [t.boxes() for t in raw]) for t in raw]
    for name, tensor in ck.items():
        owned = torch.cat([r.hf_indices() for tb in tables for r in tb.routes[name] if r.owner])
        assert torch.equal(owned.sort().values, torch.arange(tensor.numel())), name


def test_a_tied_head_the_checkpoint_stores_is_discarded_not_refused() -> None:
    """A tied checkpoint that also stores ``lm_head.weight`` (vLLM's loader writes it into the head it ties, or
    skips it): discarded, tied to the tensor feeding the shared parameter, with no route; a head of another shape
    is refused naming the disagreement."""
    ckpt = {**checkpoint(tie=True), "lm_head.weight": torch.zeros(VOCAB, H).bfloat16()}
    shapes = {**param_shapes(1, tie=True), "lm_head.weight": param_shapes(1)["lm_head.weight"]}
    for loader in (load, _skipping("lm_head.weight")):
        t = table(1, 0, ckpt=ckpt, shapes=shapes, loader=loader, tied={"lm_head.weight": "model.embed_tokens.weight"},
                  unfed_ok=["lm_head.weight"])
        assert dict(t.discarded) == {"lm_head.weight": "model.embed_tokens.weight"}
        assert "lm_head.weight" not in t.routes
    ckpt["lm_head.weight"] = torch.zeros(VOCAB, 2 * H).bfloat16()
    with pytest.raises(RoutingError, match=r"'lm_head.weight': the engine ties the parameter it feeds to "
                                           r"'model.embed_tokens.weight', and no checkpoint tensor of the same shape"):
        table(1, 0, ckpt=ckpt, shapes=shapes, loader=_skipping("lm_head.weight"),
              tied={"lm_head.weight": "model.embed_tokens.weight"}, unfed_ok=["lm_head.weight"])
