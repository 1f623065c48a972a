"""The object format (docs/FORMAT.md): step headers, and writing/reading delta and anchor objects.

Objects are written to local files first (then uploaded or renamed into place) so that a large anchor is
never held twice in memory, and read through ``safetensors.safe_open`` (memory-mapped).
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

import numpy as np
import safetensors
import safetensors.numpy
import safetensors.torch
import torch

from ._bits import DTYPES, dtype_from_name
from .checksum import ALGORITHM, parse_checksum
from .codecs import EncodedTensor, decode_change, parallel_map
from .errors import FormatError

FORMAT_VERSION = 1
METADATA_KEY = "deltasync"
Kind = Literal["delta", "anchor"]


@dataclass(frozen=True, kw_only=True)
class TensorHeader:
    """One tensor's entry in a step header: its state after the step, and how its change is encoded."""

    dtype: str
    shape: tuple[int, ...]
    changed: int
    checksum: str
    positions: tuple[str, ...] | None = None
    values: tuple[str, ...] | None = None

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    def to_json(self) -> dict[str, Any]:
        d: dict[str, Any] = {"dtype": self.dtype, "shape": list(self.shape), "changed": self.changed, "checksum": self.checksum}
        if self.positions is not None:
            d["positions"] = list(self.positions)
            d["values"] = list(self.values or ())
        return d


@dataclass(frozen=True, kw_only=True)
class StepHeader:
    """The self-description of one object (docs/FORMAT.md section 2)."""

    kind: Kind
    step: int
    base_step: int | None
    state_checksum: str
    tensors: dict[str, TensorHeader]
    aliases: dict[str, str] = field(default_factory=dict)
    format_version: int = FORMAT_VERSION
    checksum_algorithm: str = ALGORITHM

    @property
    def numel(self) -> int:
        return sum(t.numel for t in self.tensors.values())

    @property
    def changed(self) -> int:
        return sum(t.changed for t in self.tensors.values())

    def checksums(self) -> dict[str, str]:
        return {name: t.checksum for name, t in self.tensors.items()}

    def to_json(self) -> str:
        d = {k: v for k, v in asdict(self).items() if k != "tensors"}
        d["tensors"] = {name: t.to_json() for name, t in self.tensors.items()}
        return json.dumps(d, separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str, *, where: str) -> StepHeader:
        """Parse and validate; every problem is a ``FormatError`` that names ``where``."""
        try:
            d = json.loads(text)
        except json.JSONDecodeError as e:
            raise FormatError(f"{where}: step header is not valid JSON ({e})") from None
        if not isinstance(d, dict):
            raise FormatError(f"{where}: step header must be a JSON object")
        version = d.get("format_version")
        if version != FORMAT_VERSION:
            raise FormatError(f"{where}: format version {version!r} is not supported (this library reads {FORMAT_VERSION})")
        if d.get("checksum_algorithm") != ALGORITHM:
            raise FormatError(f"{where}: unknown checksum algorithm {d.get('checksum_algorithm')!r}")
        try:
            kind, step, base = d["kind"], d["step"], d["base_step"]
            if kind not in ("delta", "anchor") or not isinstance(step, int) or step < 0:
                raise ValueError(f"bad kind {kind!r} or step {step!r}")
            if kind == "anchor" and base is not None:
                raise ValueError("an anchor has no base step")
            if kind == "delta" and not (isinstance(base, int) and 0 <= base < step):
                raise ValueError(f"a delta's base step must be an integer below its step, got {base!r}")
            tensors = {name: _tensor_from_json(t, kind) for name, t in d["tensors"].items()}
            aliases = dict(d.get("aliases") or {})
            for alias, target in aliases.items():
                if target not in tensors or alias in tensors:
                    raise ValueError(f"alias {alias!r} -> {target!r} does not name exactly one stored tensor")
            return cls(
                kind=kind,
                step=step,
                base_step=base,
                state_checksum=str(d["state_checksum"]),
                tensors=tensors,
                aliases=aliases,
            )
        except (KeyError, TypeError, ValueError) as e:
            raise FormatError(f"{where}: invalid step header ({type(e).__name__}: {e})") from None


def _tensor_from_json(d: dict[str, Any], kind: str) -> TensorHeader:
    dtype_from_name(d["dtype"])
    shape = tuple(d["shape"])
    if not all(isinstance(s, int) and s >= 0 for s in shape):
        raise ValueError(f"bad shape {shape!r}")
    changed = d["changed"]
    if not isinstance(changed, int) or not 0 <= changed <= math.prod(shape):
        raise ValueError(f"bad changed count {changed!r} for shape {shape}")
    parse_checksum(d["checksum"])
    pos, val = d.get("positions"), d.get("values")
    if kind == "delta" and changed and (pos is None or val is None):
        raise ValueError("a changed tensor needs positions and values codec chains")
    return TensorHeader(
        dtype=d["dtype"],
        shape=shape,
        changed=changed,
        checksum=d["checksum"],
        positions=tuple(pos) if pos is not None else None,
        values=tuple(val) if val is not None else None,
    )


def blob_names(name: str) -> tuple[str, str]:
    return f"{name}:positions", f"{name}:values"


def write_delta(path: str | Path, header: StepHeader, encoded: Mapping[str, EncodedTensor]) -> None:
    """Write a delta object: the header plus the positions/values blobs of each changed tensor."""
    blobs: dict[str, np.ndarray] = {}
    for name, enc in encoded.items():
        pos_name, val_name = blob_names(name)
        if enc.positions is not None:
            blobs[pos_name] = np.frombuffer(enc.positions, np.uint8)
        blobs[val_name] = np.frombuffer(enc.values, np.uint8)
    safetensors.numpy.save_file(blobs, str(path), metadata={"format": "pt", METADATA_KEY: header.to_json()})


def write_anchor(path: str | Path, header: StepHeader, tensors: Mapping[str, torch.Tensor]) -> None:
    """Write an anchor: an ordinary checkpoint with the trainer's names, plus the step header."""
    cpu = {name: t.detach().to("cpu").contiguous() for name, t in tensors.items()}
    safetensors.torch.save_file(cpu, str(path), metadata={"format": "pt", METADATA_KEY: header.to_json()})


class StepObject:
    """A published object opened for reading (memory-mapped): its header and its tensors or patches."""

    def __init__(self, path: str | Path, *, where: str) -> None:
        self.path = str(path)
        self.where = where
        try:
            self._file = safetensors.safe_open(self.path, framework="pt")
            metadata = self._file.metadata() or {}
        except Exception as e:  # safetensors raises its own SafetensorError and OSError
            raise FormatError(f"{where}: not a readable safetensors file ({e})") from None
        if METADATA_KEY not in metadata:
            raise FormatError(f"{where}: safetensors file has no '{METADATA_KEY}' header metadata")
        self.header = StepHeader.from_json(metadata[METADATA_KEY], where=where)
        self._keys = set(self._file.keys())
        self._offsets: tuple[int, dict[str, tuple[int, int]]] | None = None
        self._check_keys()

    def close(self) -> None:
        self._file = None  # releases the memory map

    def __enter__(self) -> StepObject:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _check_keys(self) -> None:
        h = self.header
        if h.kind == "anchor":
            expected = set(h.tensors)
        else:
            expected = set()
            for name, t in h.tensors.items():
                if t.changed:
                    pos, val = blob_names(name)
                    expected.add(val)
                    if t.positions and t.positions[0] != "dense":
                        expected.add(pos)
        if self._keys != expected:
            raise FormatError(
                f"{self.where}: object tensors do not match its header: missing {sorted(expected - self._keys)[:5]}, "
                f"unexpected {sorted(self._keys - expected)[:5]}"
            )

    def tensor(self, name: str) -> torch.Tensor:
        """An anchor's tensor, checked against its header entry."""
        t = self._file.get_tensor(name)
        h = self.header.tensors[name]
        if tuple(t.shape) != h.shape or t.dtype != h.torch_dtype:
            raise FormatError(f"{self.where}: tensor {name!r} is {tuple(t.shape)} {t.dtype}, header says {h.shape} {h.dtype}")
        return t

    def read_tensor(self, name: str) -> torch.Tensor:
        """An anchor's tensor read into fresh memory: writable, and freed when dropped.

        ``tensor`` maps the file instead; its pages stay resident (and count towards the process's memory)
        until the object is closed, and writing to them costs a page fault per page.
        """
        h = self.header.tensors[name]
        t = torch.empty(h.shape, dtype=h.torch_dtype)
        if t.numel():
            self._read_into(name, t.reshape(-1).view(torch.uint8).numpy())
        return t

    def _read_into(self, key: str, out: np.ndarray | bytearray) -> None:
        """Read a stored tensor's bytes into ``out`` (a writable buffer of its size) with a plain read."""
        start, offsets = self._data_offsets()
        begin, end = offsets[key]
        view = memoryview(out).cast("B")
        if end - begin != view.nbytes:
            raise FormatError(f"{self.where}: tensor {key!r} holds {end - begin} bytes, expected {view.nbytes}")
        with open(self.path, "rb") as f:  # a handle per read: decoding runs on several threads
            f.seek(start + begin)
            if f.readinto(view) != view.nbytes:
                raise FormatError(f"{self.where}: tensor {key!r} is truncated")

    def _data_offsets(self) -> tuple[int, dict[str, tuple[int, int]]]:
        """Where the data buffer starts, and each tensor's byte range in it (safetensors layout)."""
        if self._offsets is None:
            with open(self.path, "rb") as f:
                size = int.from_bytes(f.read(8), "little")
                entries = json.loads(f.read(size))
            ranges = {k: (int(v["data_offsets"][0]), int(v["data_offsets"][1])) for k, v in entries.items() if k != "__metadata__"}
            self._offsets = (8 + size, ranges)
        return self._offsets

    def _blob(self, key: str) -> bytearray:
        # a plain read, not the memory map: a reader that keeps many objects open holds no mapped pages
        begin, end = self._data_offsets()[1][key]
        buf = bytearray(end - begin)
        self._read_into(key, buf)
        return buf

    def patch(self, name: str) -> tuple[np.ndarray | None, np.ndarray]:
        """A delta's decoded change for one tensor: (positions or None for dense, xor bits)."""
        h = self.header.tensors[name]
        pos_key, val_key = blob_names(name)
        return decode_change(
            numel=h.numel,
            width=h.torch_dtype.itemsize,
            changed=h.changed,
            positions_chain=list(h.positions or ()),
            values_chain=list(h.values or ()),
            positions=self._blob(pos_key) if pos_key in self._keys else None,
            values=self._blob(val_key),
            where=f"{self.where} tensor {name!r}",
        )

    def patches(self) -> list[tuple[str, np.ndarray | None, np.ndarray]]:
        """Every changed tensor's decoded change (decoded in parallel; any error is raised here)."""
        names = [name for name, h in self.header.tensors.items() if h.changed]
        return [(name, *patch) for name, patch in zip(names, parallel_map(self.patch, names))]
