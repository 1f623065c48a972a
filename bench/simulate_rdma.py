"""Predict per-step weight-sync time over RDMA for big models, dense vs delta, from the static schedule.

The model: every trainer GPU serves whole tensors (round-robin by size after the gather an FSDP trainer does
for publishing), every inference GPU (an engine rank) needs its tensor-parallel slice of each non-expert
tensor and the experts its expert-parallel rank holds. ``deltasync.rdma.schedule.plan`` decides who reads
what from whom (the same function the controller runs); a step then takes

    max(busiest inference NIC in, busiest trainer NIC out) / NIC bandwidth
      + reads of the busiest consumer x per-read cost + fixed per-step cost (announce, acks)

Dense mode moves each consumer's slice at the inference dtype's width; delta mode moves, for every tensor a
consumer holds any slice of, the whole tensor's encoded delta (positions are global): density x elements x
bytes per changed element. Calibrate ``--nic-gbps``/``--per-read-us``/``--fixed-ms`` with measured loopback
runs (bench/README.md); the defaults describe a 50 GB/s-per-GPU RDMA cluster.

    .venv/bin/python bench/simulate_rdma.py --model kimi-k2 --json bench/results/simulate_rdma.json
"""

from __future__ import annotations

import argparse
import heapq
import json
import sys
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from deltasync.rdma.schedule import Consumer, TensorInfo, TensorSlice, TrainerRank, plan


@dataclass(frozen=True)
class Tensor:
    name: str
    numel: int
    expert: int | None = None  # routed expert index, None for every other tensor


def qwen3_235b() -> Iterator[Tensor]:
    """Qwen3-235B-A22B (config.json: 94 layers, hidden 4096, 64 q / 4 kv heads of 128, 128 experts of 1536)."""
    h, v, hd, e, m = 4096, 151936, 128, 128, 1536
    yield from (Tensor("model.embed_tokens.weight", v * h), Tensor("lm_head.weight", v * h),
                Tensor("model.norm.weight", h))
    for i in range(94):
        p = f"model.layers.{i}."
        yield from (Tensor(p + "self_attn.q_proj.weight", 64 * hd * h),
                    Tensor(p + "self_attn.k_proj.weight", 4 * hd * h),
                    Tensor(p + "self_attn.v_proj.weight", 4 * hd * h),
                    Tensor(p + "self_attn.o_proj.weight", h * 64 * hd),
                    Tensor(p + "self_attn.q_norm.weight", hd), Tensor(p + "self_attn.k_norm.weight", hd),
                    Tensor(p + "input_layernorm.weight", h), Tensor(p + "post_attention_layernorm.weight", h),
                    Tensor(p + "mlp.gate.weight", e * h))
        for x in range(e):
            for w in ("gate_proj", "up_proj", "down_proj"):
                yield Tensor(f"{p}mlp.experts.{x}.{w}.weight", m * h, expert=x)


def kimi_k2() -> Iterator[Tensor]:
    """Kimi-K2 (DeepSeek-V3 shape: 61 layers, hidden 7168, MLA q_lora 1536 / kv_lora 512, 64 heads,
    first layer dense 18432, then 384 routed experts of 2048 plus one shared expert)."""
    h, v, e, m, heads = 7168, 163840, 384, 2048, 64
    yield from (Tensor("model.embed_tokens.weight", v * h), Tensor("lm_head.weight", v * h),
                Tensor("model.norm.weight", h))
    for i in range(61):
        p = f"model.layers.{i}."
        yield from (Tensor(p + "self_attn.q_a_proj.weight", 1536 * h),
                    Tensor(p + "self_attn.q_a_layernorm.weight", 1536),
                    Tensor(p + "self_attn.q_b_proj.weight", heads * (128 + 64) * 1536),
                    Tensor(p + "self_attn.kv_a_proj_with_mqa.weight", (512 + 64) * h),
                    Tensor(p + "self_attn.kv_a_layernorm.weight", 512),
                    Tensor(p + "self_attn.kv_b_proj.weight", heads * (128 + 128) * 512),
                    Tensor(p + "self_attn.o_proj.weight", h * heads * 128),
                    Tensor(p + "input_layernorm.weight", h), Tensor(p + "post_attention_layernorm.weight", h))
        if i == 0:
            yield from (Tensor(p + f"mlp.{w}.weight", 18432 * h) for w in ("gate_proj", "up_proj", "down_proj"))
            continue
        yield from (Tensor(p + "mlp.gate.weight", e * h), Tensor(p + "mlp.gate.e_score_correction_bias", e))
        yield from (Tensor(p + f"mlp.shared_experts.{w}.weight", m * h) for w in ("gate_proj", "up_proj", "down_proj"))
        for x in range(e):
            for w in ("gate_proj", "up_proj", "down_proj"):
                yield Tensor(f"{p}mlp.experts.{x}.{w}.weight", m * h, expert=x)


MODELS = {"qwen3-235b": qwen3_235b, "kimi-k2": kimi_k2}


@dataclass(frozen=True)
class Topology:
    trainer_gpus: int = 256
    inference_gpus: int = 128
    engine_gpus: int = 16  # one engine: expert-parallel over all its GPUs
    attention_tp: int = 8  # non-expert tensors are cut this many ways inside an engine
    nic_gbps: float = 50.0  # GB/s per GPU NIC, each direction
    per_read_us: float = 20.0  # cost of one prepared multi-descriptor READ (post + completion)
    fixed_ms: float = 2.0  # announce + acknowledgements per step
    max_part: int = 1 << 26  # a trainer GPU serves tensors in parts of at most this many elements
    consumer_gbps: float = 0.0  # the consumer's per-byte work (e.g. the object digest) rate; 0: not modelled
    consumer_overlap: bool = False  # that work runs while the bytes land (pieced READs): max, not sum


@dataclass(frozen=True)
class Prediction:
    model: str
    mode: str
    params: int
    consumer_gb: float
    trainer_gb: float
    reads: int
    seconds: float


def predict(tensors: list[Tensor], topo: Topology, *, model: str, density: float, bytes_per_change: float,
            dense_width: float) -> tuple[Prediction, Prediction]:
    """Dense and delta predictions for one model and topology (``plan`` balances trainer load)."""
    infos = {t.name: TensorInfo(t.numel, 2) for t in tensors}
    by_name = {t.name: t for t in tensors}
    trainers = [[] for _ in range(topo.trainer_gpus)]
    heap = [(0, r) for r in range(topo.trainer_gpus)]
    for t in sorted(tensors, key=lambda t: -t.numel):  # parts of at most max_part elements, largest first
        pieces = -(-t.numel // topo.max_part)
        for k in range(pieces):  # onto the least loaded GPU
            n, r = heapq.heappop(heap)
            a, b = t.numel * k // pieces, t.numel * (k + 1) // pieces
            trainers[r].append(TensorSlice(t.name, a, b))
            heapq.heappush(heap, (n + b - a, r))
    # consumers with the same expert-parallel rank need the same tensors; one of each suffices for the maximum
    ep = topo.engine_gpus
    consumers = []
    for rank in range(ep):
        needs = frozenset(t.name for t in tensors if t.expert is None or t.expert % ep == rank)
        consumers.append(Consumer(f"ep{rank}", "engine0", needs))
    schedule = plan(infos, [TrainerRank(r, f"t{r}", tuple(p)) for r, p in enumerate(trainers)], consumers)
    engines = topo.inference_gpus // topo.engine_gpus

    def mode_bytes(name: str, dense: bool) -> float:
        t = by_name[name]
        if not dense:
            return density * t.numel * bytes_per_change
        return t.numel * dense_width / (1 if t.expert is not None else topo.attention_tp)

    def part_bytes(p: TensorSlice, dense: bool) -> float:
        return mode_bytes(p.name, dense) * p.numel / by_name[p.name].numel

    out = []
    for mode in ("dense", "delta"):
        per_consumer = {c.id: sum(part_bytes(p, mode == "dense") for r in schedule.reads[c.id] for p in r.parts)
                        for c in consumers}
        trainer_out = [0.0] * topo.trainer_gpus
        for c in consumers:  # every engine has one consumer per ep rank; every consumer reads the same way
            for r in schedule.reads[c.id]:
                trainer_out[r.rank] += engines * sum(part_bytes(p, mode == "dense") for p in r.parts)
        reads = max(len(schedule.reads[c.id]) for c in consumers)
        busiest = max(max(per_consumer.values()), max(trainer_out))
        wire = busiest / (topo.nic_gbps * 1e9)
        work = max(per_consumer.values()) / (topo.consumer_gbps * 1e9) if topo.consumer_gbps > 0 else 0.0
        seconds = (max(wire, work) if topo.consumer_overlap else wire + work) + reads * topo.per_read_us * 1e-6 \
            + topo.fixed_ms * 1e-3
        out.append(Prediction(model, mode, sum(t.numel for t in tensors), max(per_consumer.values()) / 1e9,
                              max(trainer_out) / 1e9, reads, seconds))
    return out[0], out[1]


def loopback(object_bytes: int, topo: Topology) -> tuple[float, float]:
    """Predicted (raw read, read + consumer work) seconds for one object of ``object_bytes`` moved between one
    trainer and one consumer (the loopback runs of bench/bench_rdma.py): the schedule of a one-tensor model at one
    byte per element, without and with the consumer's own work (``consumer_gbps``, overlapped or not)."""
    one = Topology(**{**asdict(topo), "trainer_gpus": 1, "inference_gpus": 1, "engine_gpus": 1, "attention_tp": 1})
    tensors = [Tensor("object", object_bytes)]
    kw = {"model": "loopback", "density": 1.0, "bytes_per_change": 1.0, "dense_width": 1.0}
    raw, _ = predict(tensors, Topology(**{**asdict(one), "consumer_gbps": 0.0}), **kw)
    pipeline, _ = predict(tensors, one, **kw)
    return raw.seconds, pipeline.seconds


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", choices=sorted(MODELS), action="append")
    ap.add_argument("--density", type=float, default=0.02)
    ap.add_argument("--bytes-per-change", type=float, default=1.4)
    ap.add_argument("--dense-width", type=float, default=1.0, help="bytes per element on the inference side (FP8: 1)")
    for f, v in asdict(Topology()).items():
        if isinstance(v, bool):
            ap.add_argument("--" + f.replace("_", "-"), action=argparse.BooleanOptionalAction, default=v)
        else:
            ap.add_argument("--" + f.replace("_", "-"), type=type(v), default=v)
    ap.add_argument("--json", type=Path)
    a = ap.parse_args()
    topo = Topology(**{f: getattr(a, f) for f in asdict(Topology())})
    rows = []
    for name in a.model or sorted(MODELS):
        t0 = time.perf_counter()
        tensors = list(MODELS[name]())
        dense, delta = predict(tensors, topo, model=name, density=a.density, bytes_per_change=a.bytes_per_change,
                               dense_width=a.dense_width)
        rows += [dense, delta]
        print(f"{name}: {sum(t.numel for t in tensors) / 1e9:,.0f}B params, "
              f"planned in {time.perf_counter() - t0:.1f} s", file=sys.stderr)
    print("| model | mode | GB into busiest inference GPU | GB out of busiest trainer GPU | reads | predicted s |")
    print("|---|---|---|---|---|---|")
    for p in rows:
        print(f"| {p.model} | {p.mode} | {p.consumer_gb:.2f} | {p.trainer_gb:.2f} | {p.reads} | {p.seconds:.3f} |")
    if a.json:
        a.json.parent.mkdir(parents=True, exist_ok=True)
        a.json.write_text(json.dumps({"topology": asdict(topo), "density": a.density,
                                      "rows": [asdict(p) for p in rows]}, indent=1))


if __name__ == "__main__":
    main()
