"""Byte-level tools the mutators need: a JSON writer that can say what ``json.dumps`` refuses to (huge
integers as digits, ``1e400``, duplicate keys, invalid UTF-8, 100000-deep nesting), safetensors files
taken apart and put back together, zstd frames built by hand, and the ``state_checksum`` of FORMAT.md
section 2 (written here from the spec, not imported from the library).
"""

from __future__ import annotations

import hashlib
import json
import struct
from dataclasses import dataclass, field
from typing import Any

import blake3

DEEP = 100_000

# symbolic JSON values, grouped by JSON type; rendered only when a mutation is applied (a case stays small)
VALUES: dict[str, bytes] = {
    "null": b"null",
    "true": b"true",
    "false": b"false",
    "0": b"0",
    "-1": b"-1",
    "2**63": str(2**63).encode(),
    "2**64": str(2**64).encode(),
    "-2**63-1": str(-(2**63) - 1).encode(),
    "10**5000": b"1" + b"0" * 5000,
    "-10**5000": b"-1" + b"0" * 5000,
    "1e400": b"1e400",
    "-1e400": b"-1e400",
    "NaN": b"NaN",
    "Infinity": b"Infinity",
    "1.5": b"1.5",
    "-0.0": b"-0.0",
    '""': b'""',
    '"x"': b'"x"',
    '"12"': b'"12"',
    '"a"*1MiB': b'"' + b"a" * (1 << 20) + b'"',
    "invalid UTF-8 string": b'"ab\xff\xfe\xc3("',
    "lone surrogate": b'"\\udcff"',
    "NUL string": b'"a\\u0000b"',
    "[]": b"[]",
    "[1, 2]": b"[1, 2]",
    "[] nested 100000 deep": b"[" * DEEP + b"]" * DEEP,
    "{}": b"{}",
    '{"a": 1}': b'{"a": 1}',
    "{} nested 100000 deep": b'{"a":' * DEEP + b"0" + b"}" * DEEP,
}
TYPE_GROUPS: dict[str, tuple[str, ...]] = {
    "null": ("null",),
    "bool": ("true", "false"),
    "number": ("0", "-1", "2**63", "2**64", "-2**63-1", "10**5000", "-10**5000", "1e400", "-1e400", "NaN", "Infinity",
               "1.5", "-0.0"),
    "string": ('""', '"x"', '"12"', '"a"*1MiB', "invalid UTF-8 string", "lone surrogate", "NUL string"),
    "array": ("[]", "[1, 2]", "[] nested 100000 deep"),
    "object": ("{}", '{"a": 1}', "{} nested 100000 deep"),
}
# names that must never leave their folder; {ROOT} is the case's own folder (an absolute path we watch)
TRAVERSAL = ("../../x", "{ROOT}/abs", "x/../../F", "../../../../../../../../../{ROOT}/up", "a/b", "..", ".", "",
             "x\u0000y", "x" * 300, ".hidden")


def json_type(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "bool"
    if isinstance(value, (int, float)):
        return "number"
    if isinstance(value, str):
        return "string"
    return "array" if isinstance(value, list) else "object"


class Raw(bytes):
    """JSON text written as it is."""


@dataclass
class Dup:
    """A JSON object written with exactly these (possibly repeated) keys, in order."""

    items: list[tuple[Any, Any]] = field(default_factory=list)


def dump(value: Any) -> bytes:
    if isinstance(value, Raw):
        return bytes(value)
    if isinstance(value, (dict, Dup)):
        items = value.items if isinstance(value, Dup) else list(value.items())
        return b"{" + b", ".join(_key(k) + b": " + dump(v) for k, v in items) + b"}"
    if isinstance(value, list):
        return b"[" + b", ".join(dump(v) for v in value) + b"]"
    return json.dumps(value).encode()


def _key(k: Any) -> bytes:
    return bytes(k) if isinstance(k, Raw) else json.dumps(str(k)).encode()


def paths(value: Any, prefix: tuple = ()) -> list[tuple]:
    """Every path to a value inside ``value`` (the root excluded), parents before children."""
    out = []
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for k, v in items:
        out.append((*prefix, k))
        out += paths(v, (*prefix, k))
    return out


def get(value: Any, path: tuple) -> Any:
    for k in path:
        value = value[k]
    return value


def with_root(text: str, root: str) -> str:
    return text.replace("{ROOT}", root.lstrip("/")) if text.startswith("../") else text.replace("{ROOT}", root)


def json_string(text: bytes) -> bytes:
    """``text`` as a JSON string literal: escaped when it is UTF-8, else with its invalid bytes kept raw."""
    try:
        return json.dumps(text.decode("utf-8")).encode()
    except UnicodeDecodeError:
        out = bytearray(b'"')
        for byte in text:
            if byte in (0x22, 0x5C):
                out += b"\\" + bytes([byte])
            elif byte < 0x20:
                out += b"\\u%04x" % byte
            else:
                out.append(byte)
        return bytes(out + b'"')


# --- safetensors files ---


@dataclass
class SafetensorsFile:
    """A safetensors file taken apart: its header (``__metadata__`` included) and data buffer."""

    header: dict[str, Any]
    data: bytes
    header_len: int

    @classmethod
    def parse(cls, raw: bytes) -> SafetensorsFile:
        n = int.from_bytes(raw[:8], "little")
        return cls(header=json.loads(raw[8 : 8 + n]), data=raw[8 + n :], header_len=n)

    @property
    def step_header(self) -> bytes:
        return self.header["__metadata__"]["deltasync"].encode("utf-8", "surrogatepass")

    def blob_keys(self) -> list[str]:
        """Tensor keys in the order of their data."""
        return sorted((k for k in self.header if k != "__metadata__"), key=lambda k: self.header[k]["data_offsets"][0])

    def blob(self, key: str) -> bytes:
        begin, end = self.header[key]["data_offsets"]
        return self.data[begin:end]

    def build(self, *, step_header: bytes | None = None, blobs: dict[str, bytes] | None = None,
              header: Any = None) -> bytes:
        """The file with a new step header text, new blobs (offsets recomputed) or a whole new header value."""
        h = self.header if header is None else header
        data = self.data
        if blobs:
            h = dict(h)
            parts, offset = [], 0
            for key in self.blob_keys():
                b = blobs.get(key, self.blob(key))
                h[key] = {**h[key], "data_offsets": [offset, offset + len(b)]}
                if key in blobs and h[key]["dtype"] == "U8":  # a delta's blob: a 1-D byte tensor of its length
                    h[key]["shape"] = [len(b)]
                parts.append(b)
                offset += len(b)
            data = b"".join(parts)
        if step_header is not None:
            h = dict(h)
            h["__metadata__"] = {**h["__metadata__"], "deltasync": Raw(json_string(step_header))}
        text = dump(h)
        text += b" " * (-len(text) % 8)
        return len(text).to_bytes(8, "little") + text + data


# --- zstd frames ---


def zstd_rle_frame(total: int, *, claim: int | None) -> bytes:
    """A zstd frame of ``total`` zero bytes made of RLE blocks (4 bytes per 128 KiB), declaring ``claim`` as
    its content size (None: no content size in the frame header)."""
    out = bytearray(struct.pack("<I", 0xFD2FB528))
    if claim is None:
        out += bytes([0b00000000, 0x58])  # no content size; window descriptor (2 MiB)
    else:
        out += bytes([0b11000000, 0x58]) + struct.pack("<Q", claim)  # 8-byte content size
    left = total
    while True:
        n = min(128 * 1024, left)
        left -= n
        out += ((1 if left == 0 else 0) | (1 << 1) | (n << 3)).to_bytes(3, "little") + b"\0"
        if left == 0:
            return bytes(out)


ZSTD_FRAMES = {
    "1 GiB of zeros, size declared": lambda: zstd_rle_frame(1 << 30, claim=1 << 30),
    "1 GiB of zeros, no size declared": lambda: zstd_rle_frame(1 << 30, claim=None),
    "18 bytes declaring 1 TiB": lambda: zstd_rle_frame(16, claim=1 << 40),
    "1 MiB of zeros declaring 1 TiB": lambda: zstd_rle_frame(1 << 20, claim=1 << 40),
}


def state_checksum(checksums: dict[str, str]) -> str:
    """FORMAT.md section 2: SHA-256 of ``NAME<TAB>CHECKSUM<LF>`` per tensor, names sorted."""
    text = "".join(f"{name}\t{checksums[name]}\n" for name in sorted(checksums))
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def object_digest(manifest: dict[str, Any], data: bytes) -> dict[str, str]:
    """FORMAT.md section 1b: the field that gives ``data``'s digest in ``manifest``'s own algorithm (``object_sha256``
    for versions 1 and 2, ``object_digest`` ``"blake3:<hex>"`` for version 3 naming blake3)."""
    if manifest.get("format_version") == 3 and manifest.get("digest") == "blake3":
        return {"object_digest": "blake3:" + blake3.blake3(data).hexdigest()}
    return {"object_sha256": sha256(data)}


def hex16(entry: dict[str, Any]) -> str:
    """The first 16 hex digits of an entry's digest, whichever field holds it (what its object's name carries)."""
    return str(entry.get("object_sha256") or str(entry.get("object_digest", "")).removeprefix("blake3:"))[:16]
