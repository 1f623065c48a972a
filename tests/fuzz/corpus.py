"""The fuzzer's seed corpus: a small real stream published with ``DeltaPublisher``, and the truth it holds.

Every stored document kind is present: anchors and deltas (sparse and dense changes, zstd and raw blobs),
a tied alias, model files (``files=``), a consumer heartbeat, a writer lease and the ``latest.json`` hint.
The tensors have different dtypes and odd sizes, and by default their changes include each tensor's last
elements (the tail past the last whole 8-byte word). The stream is byte-for-byte the same on every build
(timestamps are normalised), so that a case id names the same bytes in every run.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch

from .edits import hex16, object_digest

STEPS = tuple(range(6))
ANCHOR_EVERY = 3  # anchors at 0 and 3; deltas 1, 2, 4, 5
CONSUMER_ID = "rollout-0"
CONSUMER_STEP = 4
LEASE_OWNER = "fuzz-writer-0"
FAR_FUTURE_UNIX_S = 4102444800.0  # 2100-01-01: the heartbeat stays recent and the lease live in every run
CREATED_UNIX_S = 1_700_000_000.0
MODEL_FILES = {
    "config.json": b'{"model_type": "fuzz", "hidden_size": 40, "tie_word_embeddings": true}\n',
    "tokenizer.json": b'{"version": "1.0", "model": {"vocab": {"a": 0, "b": 1}}}\n',
    "generation_config.json": b'{"do_sample": false}\n',
}
TIED = {"lm_head.weight": "model.embed_tokens.weight"}
# the layer each tensor belongs to, written out by hand (an independent reference for layer_density)
LAYER_OF = {
    "model.embed_tokens.weight": "model.embed_tokens",
    "model.layers.0.mlp.weight": "model.layers.0",
    "model.layers.0.norm.weight": "model.layers.0",
    "model.layers.1.attn.weight": "model.layers.1",
    "model.layers.1.bias": "model.layers.1",
    "model.layers.1.scale": "model.layers.1",
    "model.extra.u8": "model.extra",
    "model.extra.mask": "model.extra",
    "model.extra.counts": "model.extra",
    "model.extra.q": "model.extra",
    "model.extra.empty": "model.extra",
    "model.extra.scalar": "model.extra",
    "model.extra.frozen": "model.extra",
}


@dataclass(frozen=True, kw_only=True)
class Corpus:
    """A published stream (``stream``) and the weights every step must replay to (``truth``, step -> name -> tensor,
    aliases included)."""

    stream: Path
    truth: dict[int, dict[str, torch.Tensor]]
    names: tuple[str, ...]  # stored tensors in the trainer's order (aliases left out)
    digest: str  # SHA-256 over every stored path and its bytes
    tail_changes: bool

    @property
    def steps(self) -> tuple[int, ...]:
        return STEPS

    @property
    def last(self) -> int:
        return STEPS[-1]


def _initial_state(gen: torch.Generator) -> dict[str, torch.Tensor]:
    emb = torch.randn(67, 40, generator=gen).bfloat16()
    return {
        "model.embed_tokens.weight": emb,
        "model.layers.0.mlp.weight": torch.randn(33, 31, generator=gen),
        "model.layers.0.norm.weight": torch.randn(129, generator=gen).half(),
        "model.layers.1.attn.weight": torch.randn(96, 64, generator=gen).bfloat16(),
        "model.layers.1.bias": torch.randn(3, generator=gen),
        "model.layers.1.scale": torch.randn(9, 8, generator=gen).double(),
        "model.extra.u8": torch.randint(0, 256, (300,), generator=gen, dtype=torch.uint8),
        "model.extra.mask": torch.zeros(13, dtype=torch.bool),
        "model.extra.counts": torch.arange(11, dtype=torch.int64),
        "model.extra.q": torch.randint(-128, 128, (17,), generator=gen, dtype=torch.int8),
        "model.extra.empty": torch.zeros(0, 3),
        "model.extra.scalar": torch.tensor(0.5),
        "model.extra.frozen": torch.randn(8, generator=gen).half(),
        "lm_head.weight": emb,  # tied: the same storage, published once as an alias
    }


# name -> (random positions per step, fixed positions per step); "all" = a dense change of every element
_CHANGES: dict[str, tuple[int, tuple[int, ...] | str]] = {
    "model.embed_tokens.weight": (120, (-1,)),
    "model.layers.0.mlp.weight": (40, (-1,)),
    "model.layers.0.norm.weight": (0, (7, -1)),
    "model.layers.1.attn.weight": (110, ()),
    "model.layers.1.bias": (0, (-1,)),
    "model.layers.1.scale": (0, "all"),
    "model.extra.u8": (130, ()),
    "model.extra.mask": (0, (-1,)),
    "model.extra.counts": (0, (-1,)),
    "model.extra.q": (0, (3, -1)),
    "model.extra.scalar": (0, (0,)),
}


def _change(state: dict[str, torch.Tensor], gen: torch.Generator, *, tail_changes: bool) -> None:
    """Flip low bits of some elements of each tensor in place (floats stay finite; bools stay 0 or 1)."""
    for name, (n_random, fixed) in _CHANGES.items():
        t = state[name]
        numel = t.numel()
        # without tail changes, only elements in whole 8-byte words change (the defect-1 workaround)
        limit = (numel * t.element_size() // 8) * 8 // t.element_size() if not tail_changes else numel
        if limit == 0:
            continue
        if fixed == "all":
            pos = torch.arange(limit)
        else:
            picked = [p % numel for p in fixed]
            pos = torch.cat([torch.randint(0, limit, (n_random,), generator=gen),
                             torch.tensor(picked, dtype=torch.int64)])
            pos = torch.unique(pos[pos < limit])
        bits = t.reshape(-1).view(torch.uint8).view(-1, t.element_size())  # element-major bytes
        bits[pos, 0] ^= 1 if t.dtype == torch.bool else torch.randint(1, 8, (pos.numel(),), generator=gen,
                                                                      dtype=torch.uint8)


def build_corpus(root: Path, *, tail_changes: bool = True) -> Corpus:
    """Publish the seed stream under ``root/stream`` (``root`` must exist) and return it with its truth."""
    from deltasync import DeltaPublisher, Store
    from deltasync.engine import write_heartbeat

    stream = root / "stream"
    spool = root / "spool"
    spool.mkdir()
    gen = torch.Generator().manual_seed(20261122)
    state = _initial_state(gen)
    truth: dict[int, dict[str, torch.Tensor]] = {}
    try:
        with DeltaPublisher(
            str(stream), state, anchor_every=ANCHOR_EVERY, on_backlog="block", files=MODEL_FILES, spool_dir=spool,
            writer_id=LEASE_OWNER,
        ) as pub:
            for step in STEPS:
                if step:
                    _change(state, gen, tail_changes=tail_changes)
                truth[step] = {name: t.clone() for name, t in state.items()}
                pub.publish(step)
    finally:
        shutil.rmtree(spool, ignore_errors=True)
    store = Store(str(stream))
    write_heartbeat(store, CONSUMER_ID, CONSUMER_STEP)
    _normalise(stream)
    names = tuple(n for n in state if n not in TIED)
    return Corpus(stream=stream, truth=truth, names=names, digest=tree_digest(stream), tail_changes=tail_changes)


def _canonical_object(raw: bytes) -> bytes:
    """The object with its safetensors header metadata in a fixed order (safetensors writes it from a hash map)."""
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8 : 8 + n])
    meta = header["__metadata__"]
    header["__metadata__"] = {k: meta[k] for k in sorted(meta)}
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return len(text).to_bytes(8, "little") + text + raw[8 + n :]


def _normalise(stream: Path) -> None:
    """Fix everything that varies between builds so that the stream's bytes are the same in every build
    (timestamps, the order of safetensors metadata, object names made of their digest); write the lease (a
    closed publisher released it) as a live one."""
    for path in sorted(stream.glob("steps/*/manifest.json")):
        d = json.loads(path.read_bytes())
        step = d["step"]
        obj = path.parent / d["object"]
        data = _canonical_object(obj.read_bytes())
        digest = object_digest(d, data)
        name = d["object"]
        if name == f"{d['kind']}-{hex16(d)}.safetensors":  # named by its digest: keep it so
            name = f"{d['kind']}-{hex16(digest)}.safetensors"
        obj.unlink()
        (path.parent / name).write_bytes(data)
        d.update(object=name, object_bytes=len(data), **digest)
        if d.get("delta"):  # an anchor's own delta object (docs/FORMAT.md section 5)
            dobj = path.parent / d["delta"]["object"]
            ddata = _canonical_object(dobj.read_bytes())
            ddigest = object_digest(d, ddata)
            dobj.unlink()
            dname = f"delta-{hex16(ddigest)}.safetensors"
            (path.parent / dname).write_bytes(ddata)
            d["delta"].update(object=dname, object_bytes=len(ddata), **ddigest)
        d["created_unix_s"] = CREATED_UNIX_S + step
        for key in ("capture_s", "encode_s", "upload_s", "diff_s"):
            if key in d.get("stats", {}):
                d["stats"][key] = 0.001
        path.write_text(json.dumps(d, indent=1))
    for path in stream.glob("consumers/*.json"):
        d = json.loads(path.read_bytes())
        d["updated_unix_s"] = FAR_FUTURE_UNIX_S
        path.write_text(json.dumps(d))
    latest = stream / "latest.json"
    if latest.exists():  # when it was written, and the writer's cadence (docs/FORMAT.md section 5c)
        d = json.loads(latest.read_bytes())
        d.update(committed_unix_s=CREATED_UNIX_S + d["step"], interval_s=1.0)
        latest.write_text(json.dumps(d))
    info = stream / "stream.json"
    if info.exists():
        d = json.loads(info.read_bytes())
        if "created_unix_s" in d:
            d["created_unix_s"] = CREATED_UNIX_S
        if d.get("stream_id"):  # random at creation: fixed here, like the timestamps
            d["stream_id"] = "f" * 32
        info.write_text(json.dumps(d))
    (stream / "writer.json").write_text(json.dumps({"owner": LEASE_OWNER, "expires_unix_s": FAR_FUTURE_UNIX_S}))
    for leftover in stream.rglob("*.tmp-*"):
        leftover.unlink()


def tree_digest(folder: Path) -> str:
    h = hashlib.sha256()
    for path in sorted(p for p in folder.rglob("*") if p.is_file()):
        h.update(str(path.relative_to(folder)).encode() + b"\0" + hashlib.sha256(path.read_bytes()).digest())
    return h.hexdigest()


def save_truth(corpus: Corpus, path: Path) -> None:
    torch.save({"truth": corpus.truth, "names": corpus.names, "digest": corpus.digest,
                "tail_changes": corpus.tail_changes, "stream": str(corpus.stream)}, path)


def load_truth(path: Path) -> Corpus:
    d = torch.load(path, weights_only=True)
    return Corpus(stream=Path(d["stream"]), truth=d["truth"], names=tuple(d["names"]), digest=d["digest"],
                  tail_changes=d["tail_changes"])
