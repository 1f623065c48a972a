"""Which mutations to try: first the cases issue 8 names (the same in every run), then random cases drawn
from ``(seed, index)`` alone, so that a case id ``SEED-INDEX`` always means the same mutation of the
same corpus. Random cases cycle through the mutators so that a short run covers each of them.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .edits import TRAVERSAL, TYPE_GROUPS, ZSTD_FRAMES, SafetensorsFile, get, json_type, paths
from .mutations import (
    BYTE_MUTATORS,
    JSON_KINDS,
    KINDS,
    ROOT_VALUES,
    Document,
    documents,
    other_type_values,
    read_document,
    region_bytes,
)

# mutator -> the document kinds it applies to
MUTATORS: dict[str, tuple[str, ...]] = {
    **{m: KINDS for m in BYTE_MUTATORS},
    **{m: (*JSON_KINDS, "object") for m in ("json_type", "json_number", "json_deep", "json_utf8", "json_remove",
                                            "json_dupkey")},
    "json_path": ("manifest", "files_index", "heartbeat", "lease", "object"),
    "json_root": JSON_KINDS,
    "header_edit": ("object",),
    "st_edit": ("object",),
    "zstd_bomb": ("object",),
    "huge_header": ("object",),
}
HEADER_EDITS = (
    "base_step = step", "base_step = step + 1", "base_step = -1", "base_step = null", "base_step = 0",
    'base_step = "1"',
    "base_step = 1.0", "kind flipped", 'kind = "full"', "step + 1", "step = -1", "step = 10**12", "step = 2**63",
    "format_version = 2", 'format_version = "1"', 'checksum_algorithm = "crc32"', "state_checksum = 64 zeros",
    'state_checksum = "x"', "tensors = []", "tensors = {}", "aliases = list", "aliases = null",
    "alias -> missing tensor",
    "alias -> itself", "alias -> alias", "alias = a stored name", "alias name = ../../x", "alias added",
)
TENSOR_EDITS = (
    "changed + 1", "changed - 1", "changed = 0", "changed = numel", "changed = numel + 1", "changed = -1",
    "changed = 2**63", "changed = true", "changed = 1.0", "shape = [2**45]", "shape = [2**15, 2**30]", "shape = [-1]",
    "shape reversed", "shape = []", "shape = [0]", "shape[0] + 1", "shape = [2**63]", 'shape = "4"',
    "dtype = F32", "dtype = BF16", "dtype = F64", "dtype = U8", "dtype = BOOL", "dtype = I64", "dtype = F8_E4M3",
    "dtype = U64", "dtype = bf16", "dtype = Q4_0", 'dtype = ""', "dtype = null", "dtype = 5",
    "checksum + 1", 'checksum = "0x12"', "checksum = 5", "checksum upper-case", "entry = []", "entry gains a field",
    "tensor removed", "tensor renamed", "tensor renamed to ../../x", "tensor duplicated under a new name",
)
CHAIN_EDITS = (
    'positions = ["dense"]', 'positions = ["gap16"]', 'positions = ["gap16", "zstd", "shuffle"]',
    'positions = ["gap16", "shuffle", "zstd", "zstd"]', "positions = []", 'positions = ["lz4"]', 'positions = "gap16"',
    "positions = null", 'positions = ["zstd", "gap16"]', 'values = ["xor"]', 'values = ["xor", "zstd"]',
    'values = ["xor", "shuffle", "zstd", "shuffle"]', 'values = ["add"]', "values = []", "values = null",
    'values = ["zstd", "xor"]', "positions and values removed",
)
ST_EDITS = (
    "offsets overlap the previous tensor", "offsets end past the data", "offsets reversed", "offsets = [0, 2**63]",
    "offsets = [-8, end]", "dtype of the entry changed", "dtype of the entry = Q4", "entry shape flattened",
    "entry shape = [2**45]", "entry removed", "entry added", "entry duplicated", "__metadata__ removed",
    "step header as a JSON object, not a string", "step header removed",
)
INTERESTING_BYTES = (0x00, 0xFF, 0x7F, 0x80, 0x20, 0x22, 0x5C, 0x7B, 0x7D, 0x5B, 0x5D, 0x2C, 0x3A, 0x2D, 0x31, 0x39)
NAME_FIELDS = {"manifest": [("object",)], "heartbeat": [("consumer_id",)], "lease": [("owner",)]}


@dataclass
class Pristine:
    """The corpus stream's documents as published (what mutations are drawn from)."""

    stream: Path
    docs: list[Document]
    raw: dict[str, bytes]

    @classmethod
    def load(cls, stream: Path) -> Pristine:
        docs = documents(stream)
        return cls(stream=stream, docs=docs, raw={d.rel: read_document(stream, d.rel) for d in docs})

    def doc(self, kind: str, step: int | None = None) -> Document:
        return next(d for d in self.docs if d.kind == kind and (step is None or d.step == step))

    def step_header(self, doc: Document) -> dict[str, Any]:
        return json.loads(SafetensorsFile.parse(self.raw[doc.rel]).step_header)

    def zstd_blobs(self, doc: Document) -> list[str]:
        h = self.step_header(doc)
        return [f"{name}:{part}" for name, t in h["tensors"].items() if t["changed"] and h["kind"] == "delta"
                for part in ("positions", "values") if "zstd" in (t.get(part) or ())]


def case(seed: int, index: int, pristine: Pristine) -> dict[str, Any]:
    """Case ``index`` of the run with ``seed``: a directed case, or a random one."""
    directed = directed_cases(pristine)
    if index < len(directed):
        spec = directed[index]
    else:
        k = index - len(directed)
        order = sorted(MUTATORS)
        random.Random(seed).shuffle(order)
        spec = random_case(random.Random(f"{seed}:{index}"), order[k % len(order)], pristine)
    return {"id": f"{seed}-{index}", **spec}


def _spec(doc: Document, mutator: str, region: str, args: dict[str, Any], *, resha: bool = False,
          restate: bool = False, directed: str | None = None) -> dict[str, Any]:
    return {"doc": doc.rel, "kind": doc.kind, "step": doc.step, "mutator": mutator, "region": region, "args": args,
            "resha": resha, "restate": restate, "directed": directed}


def directed_cases(p: Pristine) -> list[dict[str, Any]]:
    """The damage issue 8 names, one case each, always run first."""
    m4, o4, o3 = p.doc("manifest", 4), p.doc("object", 4), p.doc("object", 3)
    files, beat = p.doc("files_index"), p.doc("heartbeat")
    bomb = p.zstd_blobs(o4)[0]
    hdr = {"resha": True, "restate": True}
    return [
        _spec(m4, "json_set", "whole", {"path": ["base_step"], "raw": "4"}, directed="manifest base_step == step"),
        _spec(m4, "json_set", "whole", {"path": ["base_step"], "raw": "5"},
              directed="manifests in a cycle 4 -> 5 -> 4"),
        _spec(o4, "header_edit", "step_header", {"edit": "base_step = step", "sync_manifest": True}, **hdr,
              directed="step header base_step == step"),
        _spec(m4, "json_utf8", "whole", {"path": ["object"], "where": "value"}, directed="invalid UTF-8"),
        _spec(m4, "json_number", "whole", {"path": ["object_bytes"], "value": "1e400"}, directed="1e400"),
        _spec(m4, "json_number", "whole", {"path": ["step"], "value": "10**5000"}, directed="5000 digits"),
        _spec(m4, "json_deep", "whole", {"path": ["stats"], "value": "[] nested 100000 deep"}, directed="deep nesting"),
        _spec(o4, "header_edit", "step_header", {"edit": "tensors = []"}, **hdr, directed="non-dict tensors"),
        *[_spec(files, "json_path", "whole", {"path": ["files", "config.json"], "name": name, "rename": True},
                directed="files.json name traversal") for name in ("../../x", "{ROOT}/abs", "x/../../F")],
        _spec(m4, "json_path", "whole", {"path": ["object"], "name": "x/../../F", "rename": False},
              directed="manifest object traversal"),
        _spec(beat, "json_path", "whole", {"path": ["consumer_id"], "name": "../../x", "rename": False},
              directed="consumer id traversal"),
        *[_spec(o4, "zstd_bomb", "data", {"blob": bomb, "frame": frame}, resha=True, directed="zstd bomb")
          for frame in ("1 GiB of zeros, size declared", "18 bytes declaring 1 TiB",
                        "1 GiB of zeros, no size declared")],
        _spec(o4, "huge_header", "step_header", {"mib": 85, "how": "padding"}, resha=True,
              directed="85 MiB step header"),
        _spec(o4, "header_edit", "step_header", {"edit": "shape = [2**45]", "tensor": "model.embed_tokens.weight"},
              **hdr,
              directed="shape of 2**45 elements (delta)"),
        _spec(o3, "header_edit", "step_header", {"edit": "shape = [2**45]", "tensor": "model.layers.1.attn.weight"},
              **hdr,
              directed="shape of 2**45 elements (anchor)"),
        _spec(o3, "st_edit", "st_header", {"edit": "entry shape flattened", "key": "model.layers.1.attn.weight"},
              resha=True, directed="anchor layout disagrees with its header"),
        _spec(o4, "header_edit", "step_header", {"edit": "dtype = F32", "tensor": "model.embed_tokens.weight"}, **hdr,
              directed="dtype changed"),
        _spec(o4, "header_edit", "step_header", {"edit": "alias added"}, resha=True,
              directed="a delta's aliases differ from its anchor's"),
        _spec(p.doc("latest"), "json_number", "whole", {"path": ["step"], "value": "10**5000"}, directed="hint"),
        _spec(p.doc("lease"), "json_deep", "whole", {"path": ["owner"], "value": "{} nested 100000 deep"},
              directed="lease"),
        _spec(p.doc("stream"), "json_root", "whole", {"value": "[] nested 100000 deep"}, directed="stream.json"),
    ]


def random_case(rng: random.Random, mutator: str, p: Pristine) -> dict[str, Any]:
    candidates = [d for d in p.docs if d.kind in MUTATORS[mutator]]
    if mutator == "zstd_bomb":
        candidates = [d for d in candidates if p.zstd_blobs(d)]
    kinds = sorted({d.kind for d in candidates})
    kind = rng.choice(kinds)
    doc = rng.choice([d for d in candidates if d.kind == kind])
    if kind != "object":
        region = "whole"
    elif mutator in BYTE_MUTATORS:
        region = rng.choice(["length", "st_header", "step_header", "data"])
    elif mutator in ("header_edit", "huge_header", "json_path"):
        region = "step_header"
    elif mutator.startswith("json_"):
        region = "step_header" if rng.random() < 0.7 else "st_header"
    elif mutator == "st_edit":
        region = "st_header"
    else:
        region = "data"
    target = region_bytes(p.raw[doc.rel], kind, region)
    args = _args(rng, mutator, doc, region, target, p)
    structured = mutator not in BYTE_MUTATORS
    resha = kind in ("object", "model_file") and rng.random() < (0.75 if structured else 0.5)
    restate = resha and mutator == "header_edit" and rng.random() < 0.5
    return _spec(doc, mutator, region, args, resha=resha, restate=restate)


def _args(rng: random.Random, m: str, doc: Document, region: str, target: bytes, p: Pristine) -> dict[str, Any]:
    n = len(target)
    if m == "bitflip":
        return {"offset": rng.randrange(n), "bit": rng.randrange(8)}
    if m == "bitflips":
        return {"flips": [[rng.randrange(n), rng.randrange(8)] for _ in range(rng.randint(2, 32))]}
    if m == "byteset":
        values = [rng.choice(INTERESTING_BYTES) if rng.random() < 0.7 else rng.randrange(256)
                  for _ in range(rng.randint(1, 8))]
        offset = rng.randrange(max(1, n - len(values) + 1))
        return {"offset": offset, "values": values[: n - offset]}
    if m == "truncate":
        return {"length": rng.choice([0, 1, n // 2, n - 1, rng.randrange(n)])}
    if m == "extend":
        return {"size": rng.choice([1, 7, 64, 4096, rng.randint(1, 1 << 16)]), "seed": rng.randrange(1 << 32),
                "style": rng.choice(["random", "zeros", "json"])}
    if m == "json_root":
        return {"value": rng.choice(sorted(ROOT_VALUES))}
    if m == "header_edit":
        h = p.step_header(doc)
        changed = [name for name, t in h["tensors"].items() if t["changed"]]
        pool = HEADER_EDITS + TENSOR_EDITS + (CHAIN_EDITS if changed else ())
        edit = rng.choice(pool)
        tensor = None
        if edit in TENSOR_EDITS:
            tensor = rng.choice(sorted(h["tensors"]))
        elif edit in CHAIN_EDITS or edit.startswith("alias = "):
            tensor = rng.choice(changed or sorted(h["tensors"]))
        return {"edit": edit, "tensor": tensor, "sync_manifest": rng.random() < 0.5}
    if m == "st_edit":
        st = SafetensorsFile.parse(p.raw[doc.rel])
        return {"edit": rng.choice(ST_EDITS), "key": rng.choice(st.blob_keys())}
    if m == "zstd_bomb":
        return {"blob": rng.choice(p.zstd_blobs(doc)), "frame": rng.choice(sorted(ZSTD_FRAMES))}
    if m == "huge_header":
        return {"mib": rng.choice([1, 16, 85]), "how": rng.choice(["padding", "aliases"])}
    return _json_args(rng, m, doc, region, json.loads(target))


def _json_args(rng: random.Random, m: str, doc: Document, region: str, value: Any) -> dict[str, Any]:
    all_paths = paths(value)
    keyed = [pa for pa in all_paths if isinstance(get(value, pa[:-1]), dict)]
    if m == "json_path":
        if region == "step_header":
            h = value
            options = [("tensors", k) for k in h["tensors"]] + [("aliases", k) for k in h.get("aliases") or {}]
            return {"path": list(rng.choice(options)), "name": rng.choice(TRAVERSAL), "rename": True}
        if doc.kind == "files_index":
            return {"path": ["files", rng.choice(sorted(value["files"]))], "name": rng.choice(TRAVERSAL),
                    "rename": True}
        return {"path": list(rng.choice(NAME_FIELDS[doc.kind])), "name": rng.choice(TRAVERSAL), "rename": False}
    path = list(rng.choice(keyed if m in ("json_remove", "json_dupkey", "json_utf8") else all_paths))
    current = get(value, tuple(path))
    if m == "json_type":
        return {"path": path, "value": rng.choice(other_type_values(current))}
    if m == "json_number":
        numeric = [pa for pa in all_paths if json_type(get(value, pa)) == "number"]
        if numeric and rng.random() < 0.7:
            path = list(rng.choice(numeric))
        return {"path": path, "value": rng.choice(TYPE_GROUPS["number"])}
    if m == "json_deep":
        return {"path": path, "value": rng.choice(["[] nested 100000 deep", "{} nested 100000 deep"])}
    if m == "json_utf8":
        strings = [pa for pa in keyed if isinstance(get(value, pa), str)]
        where = "key" if rng.random() < 0.3 else "value"
        return {"path": list(rng.choice(strings)) if where == "value" and strings else path, "where": where}
    if m == "json_remove":
        return {"path": path}
    if m == "json_dupkey":
        return {"path": path, "value": rng.choice(other_type_values(current)), "first": rng.random() < 0.5}
    raise ValueError(f"unknown mutator {m!r}")
