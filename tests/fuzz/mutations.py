"""Applying a mutation to a copy of the stream: which document, which part of it, what change.

A mutation is a small JSON-able dict (``doc``, ``kind``, ``mutator``, ``region``, ``args``, ``resha``,
``restate``) so that a case can be printed, stored and replayed. ``resha`` rewrites the manifest's
``object_bytes`` and digest (``object_digest``, ``object_sha256`` in older streams; or the ``files.json``
entry of a model file) to match the mutated bytes, so that the mutation gets past the digest check and reaches
the parsers; ``restate`` also makes the step header's ``state_checksum`` (and the manifest's) agree with its
tensor checksums.
"""

from __future__ import annotations

import json
import os
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .edits import (
    TYPE_GROUPS,
    VALUES,
    ZSTD_FRAMES,
    Dup,
    Raw,
    SafetensorsFile,
    dump,
    get,
    json_type,
    object_digest,
    sha256,
    state_checksum,
    with_root,
)

JSON_KINDS = ("manifest", "latest", "lease", "heartbeat", "files_index", "stream")
KINDS = ("object", *JSON_KINDS, "model_file")
STREAM_JSON = b'{"format_version": 1, "created_unix_s": 1700000000.0}'  # written when the library wrote none
REGIONS = {"length": "header length", "st_header": "safetensors header", "step_header": "step header", "data": "data",
           "whole": "whole"}
ROOT_VALUES = {
    "empty file": b"",
    "null": b"null",
    "[]": b"[]",
    '"x"': b'"x"',
    "1": b"1",
    "{}": b"{}",
    "[] nested 100000 deep": VALUES["[] nested 100000 deep"],
    "{} nested 100000 deep": VALUES["{} nested 100000 deep"],
    "invalid UTF-8": b"\xff\xfe{\x80}",
    "UTF-8 BOM + document": None,  # computed from the original
    "document twice": None,
    "document + trailing garbage": None,
}


@dataclass(frozen=True)
class Document:
    rel: str
    kind: str
    step: int | None = None


def documents(stream: Path) -> list[Document]:
    """Every stored document of the stream, plus ``stream.json`` when the library wrote none."""
    out = []
    for p in sorted(stream.rglob("*")):
        if not p.is_file():
            continue
        rel = p.relative_to(stream).as_posix()
        parts = rel.split("/")
        if parts[0] == "steps":
            out.append(Document(rel, "manifest" if parts[-1] == "manifest.json" else "object", int(parts[1])))
        elif parts[0] == "files":
            out.append(Document(rel, "model_file"))
        elif parts[0] == "consumers":
            out.append(Document(rel, "heartbeat"))
        else:
            kind = {"latest.json": "latest", "writer.json": "lease", "files.json": "files_index",
                    "stream.json": "stream"}
            if rel in kind:
                out.append(Document(rel, kind[rel]))
    if not any(d.kind == "stream" for d in out):
        out.append(Document("stream.json", "stream"))
    return out


def read_document(stream: Path, doc: str) -> bytes:
    path = stream / doc
    return path.read_bytes() if path.exists() else STREAM_JSON if doc == "stream.json" else b""


def region_bytes(raw: bytes, kind: str, region: str) -> bytes:
    if kind != "object" or region == "whole":
        return raw
    st = SafetensorsFile.parse(raw)
    regions = {"length": raw[:8], "st_header": raw[8 : 8 + st.header_len], "step_header": st.step_header,
               "data": st.data}
    return regions[region]


# --- applying ---


def apply(spec: dict[str, Any], stream: Path, root: Path) -> None:
    """Write the mutated document into ``stream`` (a copy); ``root`` replaces ``{ROOT}`` in names."""
    doc = spec["doc"]
    raw = read_document(stream, doc)
    updates: dict[str, Any] = {}
    new = mutate(raw, spec, str(root), updates)
    (stream / doc).parent.mkdir(parents=True, exist_ok=True)
    (stream / doc).write_bytes(new)
    if spec["kind"] == "object" and (spec["resha"] or updates):
        if spec["resha"]:
            manifest = json.loads((stream / f"steps/{spec['doc'].split('/')[1]}/manifest.json").read_bytes())
            updates.update(object_bytes=len(new), **object_digest(manifest, new))
        _update_json(stream / f"steps/{spec['doc'].split('/')[1]}/manifest.json", updates)
    elif spec["kind"] == "model_file" and spec["resha"]:
        index = stream / "files.json"
        d = json.loads(index.read_bytes())
        d["files"][doc.split("/", 1)[1]] = {"bytes": len(new), "sha256": sha256(new)}
        index.write_text(json.dumps(d, indent=1))
    if spec["mutator"] == "json_path" and spec["kind"] in ("files_index", "manifest"):
        _plant(spec, stream, root)


def _plant(spec: dict[str, Any], stream: Path, root: Path) -> None:
    """Store the renamed file under its new name too, as a hostile store would (an S3 key may be
    ``files/../../x``), so that the name reaches the code that writes or reads by it; only where the
    name resolves inside the case folder (``root``)."""
    a = spec["args"]
    name = with_root(a["name"], str(root))
    if spec["kind"] == "files_index":
        src, dest = stream / "files" / a["path"][-1], f"{stream}/files/{name}"
    else:  # the manifest names another object: the step's own object, under that name
        folder = stream / f"steps/{spec['step']:012d}"
        src, dest = next(folder.glob("*.safetensors"), folder), f"{folder}/{name}"
    try:
        if not src.is_file() or not os.path.realpath(dest).startswith(f"{os.path.realpath(root)}/"):
            return
        os.makedirs(os.path.dirname(dest), exist_ok=True)
        with open(dest, "xb") as f:
            f.write(src.read_bytes())
    except (OSError, ValueError):  # a name no file system takes (NUL, too long): the name alone is the test
        return


def _update_json(path: Path, updates: dict[str, Any]) -> None:
    d = json.loads(path.read_bytes())
    d.update(updates)
    path.write_text(json.dumps(d, indent=1))


def mutate(raw: bytes, spec: dict[str, Any], root: str, manifest_updates: dict[str, Any]) -> bytes:
    """The mutated bytes of one document; fills ``manifest_updates`` for header edits that keep the manifest in step."""
    m, region, args = spec["mutator"], spec["region"], spec["args"]
    if spec["kind"] != "object":
        return byte_edit(raw, m, args) if m in BYTE_MUTATORS else json_edit(raw, m, args, root)
    st = SafetensorsFile.parse(raw)
    if m in BYTE_MUTATORS and region != "step_header":
        start = {"length": 0, "st_header": 8, "data": 8 + st.header_len}[region]
        size = {"length": 8, "st_header": st.header_len, "data": len(st.data)}[region]
        if m == "truncate":
            return raw[: start + args["length"]]
        if m == "extend":
            if region == "st_header":  # garbage inside the header: the length field grows with it
                n = st.header_len + args["size"]
                return n.to_bytes(8, "little") + raw[8 : 8 + st.header_len] + garbage(args) + st.data
            return raw + garbage(args)
        return raw[:start] + byte_edit(raw[start : start + size], m, args) + raw[start + size :]
    if region == "step_header":
        text = st.step_header
        if m in BYTE_MUTATORS:
            return st.build(step_header=byte_edit(text, m, args))
        if m in JSON_MUTATORS:
            return st.build(step_header=json_edit(text, m, args, root))
        h = json.loads(text)
        if m == "header_edit":
            manifest_updates.update(header_edit(h, args["edit"], args.get("tensor"), root))
            if not args.get("sync_manifest"):
                manifest_updates.clear()
        elif m == "huge_header":
            pad = "a" * (args["mib"] << 20)
            if args["how"] == "padding":
                h["padding"] = pad
            else:  # many aliases of one tensor: a header that looks like a huge model
                target = next(iter(h["tensors"]))
                h.setdefault("aliases", {}).update({f"alias.{i}.{pad[:40]}": target
                                                    for i in range((args["mib"] << 20) // 64)})
        if spec["restate"]:
            _restate(h, manifest_updates)
        return st.build(step_header=json.dumps(h).encode())
    if region == "st_header":
        if m in JSON_MUTATORS:
            text = json_edit(raw[8 : 8 + st.header_len].rstrip(b" "), m, args, root)
            text += b" " * (-len(text) % 8)
            return len(text).to_bytes(8, "little") + text + st.data
        return st.build(header=st_edit(st, args["edit"], args["key"]))
    if m == "zstd_bomb":
        return st.build(blobs={args["blob"]: ZSTD_FRAMES[args["frame"]]()})
    raise ValueError(f"no way to apply {m} to region {region}")


def _restate(h: dict[str, Any], manifest_updates: dict[str, Any]) -> None:
    try:
        value = state_checksum({n: t["checksum"] for n, t in h["tensors"].items()})
    except (TypeError, KeyError, AttributeError):
        return  # the edit broke the tensors table itself: nothing to agree with
    h["state_checksum"] = value
    manifest_updates["state_checksum"] = value


# --- byte mutators ---

BYTE_MUTATORS = ("bitflip", "bitflips", "byteset", "truncate", "extend")


def garbage(args: dict[str, Any]) -> bytes:
    rng = random.Random(args["seed"])
    style = args["style"]
    if style == "zeros":
        return b"\0" * args["size"]
    if style == "json":
        return (b', "x": [1, {"y": null}], ' * (args["size"] // 24 + 1))[: args["size"]]
    return bytes(rng.randrange(256) for _ in range(args["size"]))


def byte_edit(data: bytes, m: str, args: dict[str, Any]) -> bytes:
    b = bytearray(data)
    if m == "bitflip":
        b[args["offset"]] ^= 1 << args["bit"]
    elif m == "bitflips":
        for offset, bit in args["flips"]:
            b[offset] ^= 1 << bit
    elif m == "byteset":
        b[args["offset"] : args["offset"] + len(args["values"])] = bytes(args["values"])
    elif m == "truncate":
        del b[args["length"] :]
    elif m == "extend":
        b += garbage(args)
    return bytes(b)


# --- JSON mutators ---

JSON_MUTATORS = ("json_type", "json_number", "json_deep", "json_utf8", "json_remove", "json_dupkey", "json_path",
                 "json_root",
                 "json_set")


def json_edit(text: bytes, m: str, args: dict[str, Any], root: str) -> bytes:
    if m == "json_root":
        name = args["value"]
        special = {"UTF-8 BOM + document": b"\xef\xbb\xbf" + text, "document twice": text + text,
                   "document + trailing garbage": text + b"\x00garbage"}
        return special.get(name) or ROOT_VALUES[name] or b""
    doc = json.loads(text)
    path = tuple(args["path"])
    parent, key = get(doc, path[:-1]), path[-1]
    if m in ("json_type", "json_number", "json_deep"):
        parent[key] = Raw(VALUES[args["value"]])
    elif m == "json_set":
        parent[key] = Raw(args["raw"].encode())
    elif m == "json_remove":
        del parent[key]
    elif m == "json_utf8":
        if args["where"] == "key" and isinstance(parent, dict):
            doc = _replace(doc, path[:-1], Dup([(Raw(b'"' + str(k).encode() + b'\xff"') if k == key else k, v)
                                                for k, v in parent.items()]))
        else:
            parent[key] = Raw(VALUES["invalid UTF-8 string"])
    elif m == "json_dupkey":
        items: list[tuple[Any, Any]] = []
        for k, v in parent.items():
            if k == key and args["first"]:
                items.append((k, Raw(VALUES[args["value"]])))
            items.append((k, v))
            if k == key and not args["first"]:
                items.append((k, Raw(VALUES[args["value"]])))
        doc = _replace(doc, path[:-1], Dup(items))
    elif m == "json_path":
        name = with_root(args["name"], root)
        if args["rename"]:
            doc = _replace(doc, path[:-1], {(name if k == key else k): v for k, v in parent.items()})
        else:
            parent[key] = name
    return dump(doc)


def _replace(doc: Any, path: tuple, value: Any) -> Any:
    """``doc`` with the value at ``path`` replaced (the root itself when ``path`` is empty)."""
    if not path:
        return value
    get(doc, path[:-1])[path[-1]] = value
    return doc


# --- step header edits (the document inside an object's safetensors metadata) ---

def header_edit(h: dict[str, Any], edit: str, tensor: str | None, root: str) -> dict[str, Any]:
    """Apply one named edit to a parsed step header; returns the manifest fields that would agree with it."""
    step = h["step"]
    t = h["tensors"][tensor] if tensor else None
    numel = 1
    for n in (t or {}).get("shape", []):
        numel *= n
    simple: dict[str, tuple[str, Any]] = {
        "base_step = step": ("base_step", step), "base_step = step + 1": ("base_step", step + 1),
        "base_step = -1": ("base_step", -1), "base_step = null": ("base_step", None), "base_step = 0": ("base_step", 0),
        'base_step = "1"': ("base_step", "1"), "base_step = 1.0": ("base_step", 1.0),
        "step + 1": ("step", step + 1), "step = -1": ("step", -1), "step = 10**12": ("step", 10**12),
        "step = 2**63": ("step", 2**63), 'kind = "full"': ("kind", "full"), "format_version = 2": ("format_version", 2),
        'format_version = "1"': ("format_version", "1"),
        'checksum_algorithm = "crc32"': ("checksum_algorithm", "crc32"),
        "state_checksum = 64 zeros": ("state_checksum", "0" * 64), 'state_checksum = "x"': ("state_checksum", "x"),
        "tensors = []": ("tensors", []), "tensors = {}": ("tensors", {}), "aliases = list": ("aliases", [["a", "b"]]),
        "aliases = null": ("aliases", None),
    }
    if edit in simple:
        key, value = simple[edit]
        h[key] = value
        return {key: value} if key in ("base_step", "step", "kind", "state_checksum") else {}
    if edit == "kind flipped":
        h["kind"], h["base_step"] = ("anchor", None) if h["kind"] == "delta" else ("delta", max(step - 1, 0))
        return {"kind": h["kind"], "base_step": h["base_step"]}
    if edit.startswith("changed"):
        values = {"changed + 1": t["changed"] + 1, "changed - 1": t["changed"] - 1, "changed = 0": 0,
                  "changed = numel": numel, "changed = numel + 1": numel + 1, "changed = -1": -1,
                  "changed = 2**63": 2**63, "changed = true": True, "changed = 1.0": 1.0}
        t["changed"] = values[edit]
    elif edit.startswith("shape"):
        shapes = {"shape = [2**45]": [2**45], "shape = [2**15, 2**30]": [2**15, 2**30], "shape = [-1]": [-1],
                  "shape reversed": t["shape"][::-1] + [1], "shape = []": [], "shape = [0]": [0],
                  "shape[0] + 1": [t["shape"][0] + 1, *t["shape"][1:]] if t["shape"] else [2],
                  "shape = [2**63]": [2**63], 'shape = "4"': "4"}
        t["shape"] = shapes[edit]
    elif edit.startswith("dtype = "):
        value = edit[len("dtype = ") :]
        try:
            t["dtype"] = json.loads(value)  # "", null, 5
        except ValueError:
            t["dtype"] = value  # a name: F32, bf16, Q4_0
    elif edit.startswith("checksum"):
        c = t["checksum"]
        t["checksum"] = {"checksum + 1": f"0x{(int(c, 16) + 1) % (1 << 64):016x}", 'checksum = "0x12"': "0x12",
                         "checksum = 5": 5, "checksum upper-case": c.upper()}[edit]
    elif edit.startswith(("positions", "values")):
        field, _, chain = edit.partition(" = ")
        if edit == "positions and values removed":
            t.pop("positions", None)
            t.pop("values", None)
        else:
            t[field] = json.loads(chain)
    elif edit == "entry = []":
        h["tensors"][tensor] = []
    elif edit == "entry gains a field":
        t["extra"] = {"a": 1}
    elif edit == "tensor removed":
        del h["tensors"][tensor]
    elif edit in ("tensor renamed", "tensor renamed to ../../x"):
        new = "renamed." + tensor if edit == "tensor renamed" else with_root("../../x", root)
        h["tensors"] = {(new if k == tensor else k): v for k, v in h["tensors"].items()}
    elif edit == "tensor duplicated under a new name":
        h["tensors"]["copy." + tensor] = dict(t)
    elif edit.startswith("alias"):
        aliases = h.setdefault("aliases", {}) or {}
        first = next(iter(h["tensors"]))
        alias_edits = {"alias -> missing tensor": ("lm_head.weight", "no.such.tensor"),
                       "alias -> itself": ("lm_head.weight", "lm_head.weight"),
                       "alias -> alias": ("alias.of.alias", "lm_head.weight"),
                       "alias = a stored name": (first, first if tensor is None else tensor),
                       "alias name = ../../x": (with_root("../../x", root), first),
                       "alias added": ("lm_head.extra", first)}
        name, target = alias_edits[edit]
        aliases[name] = target
        h["aliases"] = aliases
    else:
        raise ValueError(f"unknown header edit {edit!r}")
    return {}


# --- safetensors header edits ---

def st_edit(st: SafetensorsFile, edit: str, key: str) -> Any:
    h = json.loads(json.dumps(st.header))  # a deep copy
    keys = st.blob_keys()
    entry = h[key] if key in h else None
    size = len(st.data)
    if edit == "offsets overlap the previous tensor":
        i = keys.index(key)
        begin = h[keys[i - 1]]["data_offsets"][0] if i else 0
        entry["data_offsets"] = [begin, begin + entry["data_offsets"][1] - entry["data_offsets"][0]]
    elif edit == "offsets end past the data":
        entry["data_offsets"][1] = size + 8
    elif edit == "offsets reversed":
        entry["data_offsets"] = entry["data_offsets"][::-1]
    elif edit == "offsets = [0, 2**63]":
        entry["data_offsets"] = [0, 2**63]
    elif edit == "offsets = [-8, end]":
        entry["data_offsets"][0] = -8
    elif edit == "dtype of the entry changed":
        entry["dtype"] = "F32" if entry["dtype"] != "F32" else "I32"
    elif edit == "dtype of the entry = Q4":
        entry["dtype"] = "Q4"
    elif edit == "entry shape flattened":
        n = 1
        for d in entry["shape"]:
            n *= d
        entry["shape"] = [n] if len(entry["shape"]) != 1 else [1, n]
    elif edit == "entry shape = [2**45]":
        entry["shape"] = [2**45]
    elif edit == "entry removed":
        del h[key]
    elif edit == "entry added":
        h["bogus.tensor"] = {"dtype": "U8", "shape": [0], "data_offsets": [size, size]}
    elif edit == "entry duplicated":
        return Dup([*h.items(), (key, entry)])
    elif edit == "__metadata__ removed":
        del h["__metadata__"]
    elif edit == "step header as a JSON object, not a string":
        h["__metadata__"]["deltasync"] = json.loads(h["__metadata__"]["deltasync"])
    elif edit == "step header removed":
        del h["__metadata__"]["deltasync"]
    else:
        raise ValueError(f"unknown safetensors edit {edit!r}")
    return h


# --- what a case did, in one line ---

def jsonpath(path: list | tuple) -> str:
    out = "$"
    for k in path:
        out += f"[{k}]" if isinstance(k, int) else f".{k}" if str(k).replace("_", "").isalnum() else f"[{str(k)!r}]"
    return out


def describe(spec: dict[str, Any]) -> str:
    m, a = spec["mutator"], spec["args"]
    what = {
        "bitflip": lambda: f"flip bit {a.get('bit')} of byte {a.get('offset')}",
        "bitflips": lambda: f"flip {len(a.get('flips', []))} bits at bytes "
                            f"{sorted(o for o, _ in a.get('flips', []))[:6]}",
        "byteset": lambda: f"set bytes {a.get('offset')}.. to {bytes(a.get('values', [])).hex()}",
        "truncate": lambda: f"truncate to {a.get('length')} bytes",
        "extend": lambda: f"append {a.get('size')} bytes of {a.get('style')} garbage",
        "json_type": lambda: f"{jsonpath(a['path'])} := {a['value']}",
        "json_number": lambda: f"{jsonpath(a['path'])} := {a['value']}",
        "json_deep": lambda: f"{jsonpath(a['path'])} := {a['value']}",
        "json_set": lambda: f"{jsonpath(a['path'])} := {a['raw']}",
        "json_utf8": lambda: f"invalid UTF-8 in the {a['where']} at {jsonpath(a['path'])}",
        "json_remove": lambda: f"remove {jsonpath(a['path'])}",
        "json_dupkey": lambda: f"duplicate key {jsonpath(a['path'])} := {a['value']} "
                               f"{'before' if a['first'] else 'after'} it",
        "json_path": lambda: (f"rename {jsonpath(a['path'])} to {a['name']!r}" if a["rename"]
                              else f"{jsonpath(a['path'])} := {a['name']!r}"),
        "json_root": lambda: f"whole document := {a['value']}",
        "header_edit": lambda: f"{a['edit']}" + (f" (tensor {a['tensor']})" if a.get("tensor") else "")
        + (" (manifest kept in step)" if a.get("sync_manifest") else ""),
        "st_edit": lambda: f"{a['edit']} (entry {a['key']})",
        "zstd_bomb": lambda: f"blob {a['blob']} := zstd frame, {a['frame']}",
        "huge_header": lambda: f"{a['mib']} MiB step header ({a['how']})",
    }[m]()
    region = f" [{REGIONS[spec['region']]}]" if spec["kind"] == "object" else ""
    extra = (" +resha" if spec["resha"] else "") + (" +restate" if spec["restate"] else "")
    return f"{spec['doc']}{region}: {m}: {what}{extra}"


def other_type_values(value: Any) -> list[str]:
    current = json_type(value)
    return [v for group, names in TYPE_GROUPS.items() if group != current for v in names]

