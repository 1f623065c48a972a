"""Encode/decode stage: a tensor's change to and from compact bytes (docs/FORMAT.md section 3).

Each codec is named in the object's header, so the header alone says how to decode. Decoding validates
every count and index against the header before anything is applied.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import numpy as np
import zstandard

from ._bits import UNSIGNED_NP
from .diff import TensorChange
from .errors import FormatError

DENSE_FRACTION = 0.25  # above this share of changed elements, list every element (no positions)
ZSTD_MIN_SAVING = 0.05  # keep zstd only when it saves at least this share
_ESCAPE_GAP = 65535

POSITION_CODECS = frozenset({"gap16", "dense"})
VALUE_CODECS = frozenset({"xor"})


@dataclass(frozen=True, kw_only=True)
class EncodedTensor:
    """A tensor's change as bytes, with the codec chains that produced them."""

    positions: bytes | None
    values: bytes
    positions_chain: tuple[str, ...]
    values_chain: tuple[str, ...]

    @property
    def nbytes(self) -> int:
        return len(self.values) + (len(self.positions) if self.positions is not None else 0)


_local = threading.local()


def _compressor(level: int) -> zstandard.ZstdCompressor:
    cache = _local.__dict__.setdefault("compressors", {})
    if level not in cache:
        cache[level] = zstandard.ZstdCompressor(level=level, write_checksum=True, write_content_size=True)
    return cache[level]


def encode_change(change: TensorChange, *, zstd_level: int = 1) -> EncodedTensor:
    """Encode one tensor's change; chooses the dense form above ``DENSE_FRACTION`` changed."""
    width = change.xor.itemsize
    if change.changed > DENSE_FRACTION * change.numel:
        dense = np.zeros(change.numel, change.xor.dtype)
        dense[change.positions] = change.xor
        values, vchain = _pack(dense, width, zstd_level)
        return EncodedTensor(positions=None, values=values, positions_chain=("dense",), values_chain=("xor", *vchain))
    positions, pchain = _pack(_gap16_encode(change.positions), 2, zstd_level)
    values, vchain = _pack(change.xor, width, zstd_level)
    return EncodedTensor(
        positions=positions, values=values, positions_chain=("gap16", *pchain), values_chain=("xor", *vchain)
    )


def decode_change(
    *,
    numel: int,
    width: int,
    changed: int,
    positions_chain: list[str],
    values_chain: list[str],
    positions: bytes | None,
    values: bytes,
    where: str,
) -> tuple[np.ndarray | None, np.ndarray]:
    """Decode and validate one tensor's change: (sorted int64 positions or None for dense, xor bits).

    ``where`` names the step and tensor for error messages.
    """
    if not positions_chain or positions_chain[0] not in POSITION_CODECS:
        raise FormatError(f"{where}: unknown positions codec chain {positions_chain!r}")
    if not values_chain or values_chain[0] not in VALUE_CODECS:
        raise FormatError(f"{where}: unknown values codec chain {values_chain!r}")
    dense = positions_chain[0] == "dense"
    count = numel if dense else changed
    xor = _unpack(values, values_chain[1:], width, count, where=f"{where} values").view(UNSIGNED_NP[width])
    if xor.size != count:
        raise FormatError(f"{where}: expected {count} values, found {xor.size}")
    if dense:
        nonzero = int(np.count_nonzero(xor))
        if nonzero != changed:
            raise FormatError(f"{where}: header says {changed} changed elements, dense values change {nonzero}")
        return None, xor
    if positions is None:
        raise FormatError(f"{where}: positions are missing")
    max_entries = changed + numel // _ESCAPE_GAP + 1
    gaps = _unpack(positions, positions_chain[1:], 2, max_entries, where=f"{where} positions").view(np.uint16)
    pos = _gap16_decode(gaps)
    if pos.size != changed:
        raise FormatError(f"{where}: header says {changed} changed elements, positions list {pos.size}")
    if pos.size and pos[-1] >= numel:
        raise FormatError(f"{where}: position {int(pos[-1])} is out of range for {numel} elements")
    return pos, xor


def _gap16_encode(positions: np.ndarray) -> np.ndarray:
    gaps = np.diff(positions, prepend=-1)  # >= 1
    escapes = (gaps - 1) // _ESCAPE_GAP
    out = np.zeros(positions.size + int(escapes.sum()), np.uint16)
    ends = np.cumsum(escapes + 1) - 1
    out[ends] = gaps - escapes * _ESCAPE_GAP
    return out


def _gap16_decode(entries: np.ndarray) -> np.ndarray:
    steps = entries.astype(np.int64)
    is_escape = steps == 0
    steps[is_escape] = _ESCAPE_GAP
    return (np.cumsum(steps) - 1)[~is_escape]


def _pack(arr: np.ndarray, width: int, zstd_level: int) -> tuple[bytes, tuple[str, ...]]:
    chain: list[str] = []
    if width > 1:
        arr = np.ascontiguousarray(arr.view(np.uint8).reshape(-1, width).T)
        chain.append("shuffle")
    raw = arr.tobytes()
    if raw:
        packed = _compressor(zstd_level).compress(raw)
        if len(packed) <= (1 - ZSTD_MIN_SAVING) * len(raw):
            return packed, (*chain, "zstd")
    return raw, tuple(chain)


def _unpack(data: bytes, chain: list[str], width: int, max_count: int, *, where: str) -> np.ndarray:
    if list(chain) not in (["shuffle", "zstd"], ["shuffle"], ["zstd"], []):
        raise FormatError(f"{where}: unsupported codec chain {chain!r}")
    if "zstd" in chain:
        try:
            data = zstandard.ZstdDecompressor().decompress(data, max_output_size=max_count * width)
        except zstandard.ZstdError as e:
            raise FormatError(f"{where}: zstd frame is corrupt ({e})") from None
    if len(data) % width:
        raise FormatError(f"{where}: {len(data)} bytes is not a whole number of {width}-byte elements")
    arr = np.frombuffer(data, np.uint8)
    if "shuffle" in chain and width > 1:
        arr = np.ascontiguousarray(arr.reshape(width, -1).T)
    return arr.reshape(-1)
