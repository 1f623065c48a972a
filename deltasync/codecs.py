"""Encode/decode stage: a tensor's change to and from compact bytes (docs/FORMAT.md section 3).

Each codec is named in the object's header, so the header alone says how to decode. Decoding validates
every count and index against the header before anything is applied.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TypeVar

import numpy as np
import zstandard

from . import _kernels
from ._bits import UNSIGNED_NP
from .diff import TensorChange
from .errors import FormatError

T = TypeVar("T")
R = TypeVar("R")

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
_pool: ThreadPoolExecutor | None = None


def parallel_map(fn: Callable[[T], R], items: Iterable[T]) -> list[R]:
    """Map over tensors on a small shared thread pool: the kernels and zstd release the GIL."""
    global _pool
    if _pool is None:
        _pool = ThreadPoolExecutor(max_workers=max(1, min(8, os.cpu_count() or 1)), thread_name_prefix="deltasync-codec")
    return list(_pool.map(fn, items))


def _compressor(level: int) -> zstandard.ZstdCompressor:
    cache = _local.__dict__.setdefault("compressors", {})
    if level not in cache:
        cache[level] = zstandard.ZstdCompressor(level=level, write_checksum=True, write_content_size=True)
    return cache[level]


def encode_change(change: TensorChange, *, zstd_level: int = 1) -> EncodedTensor:
    """Encode one tensor's change; chooses the dense form above ``DENSE_FRACTION`` changed."""
    if change.changed > DENSE_FRACTION * change.numel:
        dense = np.zeros(change.numel, change.xor.dtype)
        dense[change.positions] = change.xor
        values, vchain = _pack(*_shuffled(dense), zstd_level)
        return EncodedTensor(positions=None, values=values, positions_chain=("dense",), values_chain=("xor", *vchain))
    positions, pchain = _pack(_kernels.gap16_encode(change.positions), ("shuffle",), zstd_level)
    values, vchain = _pack(*_shuffled(change.xor), zstd_level)
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
    raw = _unpack(values, values_chain[1:], width, count, where=f"{where} values")
    if len(raw) != count * width:
        raise FormatError(f"{where}: expected {count} values, found {len(raw) / width:g}")
    xor = np.empty(count, UNSIGNED_NP[width])
    if "shuffle" in values_chain and width > 1:
        _kernels.unshuffle_bytes(np.frombuffer(raw, np.uint8), xor)
    else:
        xor[:] = np.frombuffer(raw, UNSIGNED_NP[width])
    if dense:
        nonzero = int(np.count_nonzero(xor))
        if nonzero != changed:
            raise FormatError(f"{where}: header says {changed} changed elements, dense values change {nonzero}")
        return None, xor
    if positions is None:
        raise FormatError(f"{where}: positions are missing")
    max_entries = changed + numel // _ESCAPE_GAP + 1
    entries = np.frombuffer(_unpack(positions, positions_chain[1:], 2, max_entries, where=f"{where} positions"), np.uint8)
    if entries.size % 2:
        raise FormatError(f"{where}: positions hold an odd number of bytes ({entries.size})")
    if "shuffle" not in positions_chain:
        entries = _kernels.shuffle_bytes(entries.view(np.uint16))
    pos = _kernels.gap16_decode(entries, changed)
    if pos.size != changed or (pos.size == 1 and pos[0] < 0):
        raise FormatError(f"{where}: header says {changed} changed elements, positions list a different number")
    if pos.size and pos[-1] >= numel:
        raise FormatError(f"{where}: position {int(pos[-1])} is out of range for {numel} elements")
    return pos, xor


def _shuffled(arr: np.ndarray) -> tuple[np.ndarray, tuple[str, ...]]:
    if arr.itemsize == 1:
        return arr.view(np.uint8), ()
    return _kernels.shuffle_bytes(arr), ("shuffle",)


def _pack(data: np.ndarray, chain: tuple[str, ...], zstd_level: int) -> tuple[bytes, tuple[str, ...]]:
    raw = data.tobytes()
    if raw:
        packed = _compressor(zstd_level).compress(raw)
        if len(packed) <= (1 - ZSTD_MIN_SAVING) * len(raw):
            return packed, (*chain, "zstd")
    return raw, chain


def _unpack(data: bytes, chain: list[str], width: int, max_count: int, *, where: str) -> bytes:
    if list(chain) not in (["shuffle", "zstd"], ["shuffle"], ["zstd"], []):
        raise FormatError(f"{where}: unsupported codec chain {chain!r}")
    if "zstd" in chain:
        try:
            return zstandard.ZstdDecompressor().decompress(data, max_output_size=max_count * width)
        except zstandard.ZstdError as e:
            raise FormatError(f"{where}: zstd frame is corrupt ({e})") from None
    return data
