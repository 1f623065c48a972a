"""The object format (docs/FORMAT.md): writing delta and anchor objects, and reading them back safely.

Objects are written with safetensors. They are read here, not through ``safe_open``: an object comes from a
store and is untrusted, so its safetensors header is parsed with the same strict rules safetensors applies
(bounded size, offsets that tile the data buffer exactly, byte lengths that match dtype and shape) plus the
format's own (the step header, the tensors it promises), all before any tensor-sized allocation. An object is
read from a file descriptor opened once (a collected file stays readable until closed) or from memory.
"""

from __future__ import annotations

import contextlib
import functools
import json
import math
import mmap
import threading
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, BinaryIO

import msgspec
import numpy as np
import torch

from deltasync.errors import FormatError, ResourceLimitError
from deltasync.format import digest as digests
from deltasync.format._bits import dtype_name
from deltasync.format.codecs import DecodeScratch, EncodedTensor, decode_packed
from deltasync.format.digest import Algorithm
from deltasync.format.documents import (
    FORMAT_VERSION,
    ITEMSIZE,
    MAX_HEADER_BYTES,
    MAX_OBJECT_BYTES,
    Count,
    DtypeName,
    Kind,
    StepHeader,
    TensorHeader,
    decode,
)
from deltasync.format.patch import PackedPatch, Patch
from deltasync.format.sources import Source
from deltasync.threads import parallel_map

__all__ = [
    "FORMAT_VERSION",
    "METADATA_KEY",
    "Kind",
    "StepHeader",
    "StepObject",
    "TensorHeader",
    "WrittenObject",
    "blob_names",
    "write_anchor",
    "write_delta",
]

METADATA_KEY = "deltasync"
# the safetensors header: the step header (up to MAX_HEADER_BYTES) plus one short entry per tensor or blob
_MAX_SAFETENSORS_HEADER = MAX_HEADER_BYTES + (64 << 20)


def blob_names(name: str) -> tuple[str, str]:
    return f"{name}:positions", f"{name}:values"


@dataclass(frozen=True, kw_only=True)
class WrittenObject:
    """What a writer wrote: its size and digest (prefixed: ``"blake3:…"``), taken from the bytes as they were
    written (the manifest's ``object_bytes`` and ``object_digest``/``object_sha256``), so nobody reads the object
    back to hash it."""

    nbytes: int
    digest: str

    @property
    def hex16(self) -> str:
        """The first 16 hex digits of the digest, which the object's name carries (docs/FORMAT.md section 5)."""
        return digests.hex_of(self.digest)[:16]


Destination = str | Path | BinaryIO


def write_delta(dest: Destination, header: StepHeader, encoded: Mapping[str, EncodedTensor], *,
                algorithm: Algorithm | None = None) -> WrittenObject:
    """Write a delta object: the header plus the positions/values blobs of each changed tensor.

    ``dest`` is a path or a binary file object (``io.BytesIO`` for an object kept in memory). ``algorithm``: the
    digest taken as it is written (default: :func:`deltasync.format.digest.write_algorithm`).
    """
    blobs: list[_Item] = []
    for name, enc in encoded.items():
        pos_name, val_name = blob_names(name)
        if enc.positions is not None:
            pos = memoryview(enc.positions)
            blobs.append((pos_name, "U8", (len(enc.positions),), pos.nbytes, pos))
        values = memoryview(enc.values)
        blobs.append((val_name, "U8", (len(enc.values),), values.nbytes, values))
    return _write_safetensors(dest, blobs, header, algorithm)


def write_anchor(dest: Destination, header: StepHeader, tensors: Mapping[str, torch.Tensor], *,
                 algorithm: Algorithm | None = None) -> WrittenObject:
    """Write an anchor: an ordinary checkpoint with the trainer's names, plus the step header.

    Each tensor is written straight from its memory; one that lives elsewhere (an accelerator) is copied to the
    host just before it is written, so an anchor costs at most one tensor of host memory.
    """
    entries: list[_Item] = [
        (name, dtype_name(t.dtype), tuple(t.shape), t.numel() * t.element_size(), functools.partial(_host_bytes, t))
        for name, t in tensors.items()
    ]
    return _write_safetensors(dest, entries, header, algorithm)


def _host_bytes(t: torch.Tensor) -> memoryview:
    cpu = t.detach().to("cpu").contiguous()
    raw = cpu.reshape(-1).view(torch.uint8).numpy() if cpu.numel() else np.empty(0, np.uint8)
    return memoryview(raw)  # type: ignore[arg-type]  # numpy types ndarray as a Buffer on Python >= 3.12 only


# name, dtype, shape, bytes, and the bytes (or a function returning them, called when they are written)
_Item = tuple[str, DtypeName, tuple[int, ...], int, "memoryview | Callable[[], memoryview]"]


def _write_safetensors(dest: Destination, entries: list[_Item], header: StepHeader,
                       algorithm: Algorithm | None) -> WrittenObject:
    """Write a safetensors file (the layout ``safetensors.save`` writes: wider dtypes first, then by name,
    so every tensor is aligned to its width; the header padded with spaces to 8 bytes), hashing every byte
    on its way out."""
    entries = sorted(entries, key=lambda e: (-ITEMSIZE[e[1]], e[0]))
    table: dict[str, object] = {"__metadata__": {"format": "pt", METADATA_KEY: header.to_json()}}
    offset = 0
    for name, dtype, shape, nbytes, _ in entries:
        table[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    text = json.dumps(table, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    algorithm = algorithm or digests.write_algorithm()
    hasher = digests.hasher(algorithm)
    with _opened(dest) as f:
        for chunk in (len(text).to_bytes(8, "little"), text):
            hasher.update(chunk)
            f.write(chunk)
        for name, _, _, nbytes, data in entries:
            view = data() if callable(data) else data
            if view.nbytes != nbytes:
                raise FormatError(f"tensor {name!r}: {view.nbytes} bytes to write, its header says {nbytes}")
            hasher.update(view)
            f.write(view)
            del view  # a host copy of a device tensor goes before the next is made
    return WrittenObject(nbytes=8 + len(text) + offset, digest=digests.join(algorithm, hasher.hexdigest()))


@contextlib.contextmanager
def _opened(dest: Destination) -> Iterator[BinaryIO]:
    if isinstance(dest, (str, Path)):
        with open(dest, "wb") as f:
            yield f
    else:
        yield dest


# --- reading ---


@dataclass(frozen=True, kw_only=True)
class _Entry:
    dtype: DtypeName
    shape: Annotated[tuple[Count, ...], msgspec.Meta(max_length=16)]
    data_offsets: tuple[Annotated[int, msgspec.Meta(ge=0, le=MAX_OBJECT_BYTES)],
                        Annotated[int, msgspec.Meta(ge=0, le=MAX_OBJECT_BYTES)]]


def parse_header(read: Callable[[int, int], bytes | bytearray], size: int, *,
                 where: str) -> tuple[int, dict[str, _Entry], StepHeader]:
    """Parse an object's safetensors header with safetensors' own rules, then its step header.

    ``read(offset, size)`` reads bytes of the object (a file, a buffer, or ranged GETs of a remote object of
    ``size`` bytes: only the first ``8 + header`` bytes are read). Returns where the data buffer starts,
    each tensor's entry, and the step header.
    """
    if size < 8:
        raise FormatError(f"{where}: {size} bytes, too short for a safetensors file")
    n = int.from_bytes(_read_exactly(read, 0, 8, where), "little")
    if not 2 <= n <= min(_MAX_SAFETENSORS_HEADER, size - 8):
        raise FormatError(f"{where}: safetensors header of {n} bytes in an object of {size} bytes")
    raw = decode(_read_exactly(read, 8, n, where), dict[str, msgspec.Raw], where=f"{where} safetensors header",
                 max_bytes=_MAX_SAFETENSORS_HEADER)
    metadata: dict[str, str] = {}
    entries: dict[str, _Entry] = {}
    for key, value in raw.items():
        if key == "__metadata__":
            metadata = decode(value, dict[str, str], where=f"{where} safetensors metadata", max_bytes=n)
        else:
            entries[key] = decode(value, _Entry, where=f"{where} safetensors entry {key[:200]!r}", max_bytes=n)
    data_bytes = size - 8 - n
    end = 0
    for key, e in sorted(entries.items(), key=lambda kv: kv[1].data_offsets):
        begin, stop = e.data_offsets
        want = math.prod(e.shape) * ITEMSIZE[e.dtype]
        if begin != end or stop - begin != want:
            raise FormatError(
                f"{where}: tensor {key[:200]!r} occupies bytes {begin}..{stop} of the data buffer, expected "
                f"{want} bytes ({e.dtype} {list(e.shape)}) starting at {end}"
            )
        end = stop
    if end != data_bytes:
        raise FormatError(f"{where}: tensors cover {end} bytes of a {data_bytes}-byte data buffer (truncated or "
                          "padded)")
    if METADATA_KEY not in metadata:
        raise FormatError(f"{where}: safetensors file has no '{METADATA_KEY}' header metadata")
    return 8 + n, entries, StepHeader.from_json(metadata[METADATA_KEY], where=where)


def _read_exactly(read: Callable[[int, int], bytes | bytearray], offset: int, size: int,
                  where: str) -> bytes | bytearray:
    try:
        data = read(offset, size)
    except EOFError:
        data = b""
    if len(data) != size:
        raise FormatError(f"{where}: truncated (wanted bytes {offset}..{offset + size})")
    return data


class StepObject:
    """A published object opened for reading: its validated header, and its tensors or decoded patches.

    ``source`` is a local path (read through a bounded pool of descriptors) or the object's bytes. Every check a
    reader relies on runs here, at open: so ``verify`` and every consumer refuse exactly the same objects.
    """

    def __init__(self, source: str | Path | bytes | bytearray | memoryview | mmap.mmap, *, where: str) -> None:
        self.where = where
        try:
            self._src = Source(source)
        except (FileNotFoundError, ResourceLimitError):
            raise
        except OSError as e:
            raise FormatError(f"{where}: cannot open the object ({e})") from None
        self.path = self._src.path
        try:
            self._data_start, self._entries, self.header = parse_header(self._src.read, self._src.size, where=where)
            self._check_entries()
        except BaseException:
            self._src.close()
            raise

    def close(self) -> None:
        self._src.close()

    def __enter__(self) -> StepObject:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def nbytes(self) -> int:
        return self._src.size

    @property
    def buffer(self) -> memoryview | None:
        """The object's bytes when it was opened from memory (None when it reads from a file: see ``path``)."""
        return self._src._buf

    def _check_entries(self) -> None:
        """The object holds exactly the tensors its header promises, in the promised dtypes and shapes."""
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
        keys = set(self._entries)
        if keys != expected:
            raise FormatError(
                f"{self.where}: object tensors do not match its header: missing {sorted(expected - keys)[:5]}, "
                f"unexpected {sorted(keys - expected)[:5]}"
            )
        for key, e in self._entries.items():
            if h.kind == "anchor":
                t = h.tensors[key]
                shape = t.shape if t.range is None else (t.count,)  # a part stores its range flat (section 5b)
                ok, want = (e.dtype, e.shape) == (t.dtype, shape), f"{t.dtype} {list(shape)} (as its header says)"
            else:
                ok, want = e.dtype == "U8" and len(e.shape) == 1, "a 1-D U8 blob"
            if not ok:
                raise FormatError(f"{self.where}: tensor {key!r} is stored as {e.dtype} {list(e.shape)}, expected "
                                  f"{want}")

    def keys(self) -> list[str]:
        return list(self._entries)

    def read_tensor(self, name: str) -> torch.Tensor:
        """An anchor's tensor, read into fresh memory (writable; its size was checked at open). A part's
        entry is its range, flat."""
        h = self.header.tensors[name]
        t = torch.empty(h.shape if h.range is None else (h.count,), dtype=h.torch_dtype)
        if t.numel():
            self._read_into(name, t.reshape(-1).view(torch.uint8).numpy())
        return t

    tensor = read_tensor

    def read_tensors_hashed(
        self, landed: Callable[[str, torch.Tensor], None], *, algorithm: Algorithm,
        stop: threading.Event | None = None, chunk_bytes: int = 1 << 20,
    ) -> str | None:
        """Read every tensor of an anchor once, in file order, each into fresh memory, hashing the object's
        bytes as they pass (the header, then the tensors: parsing checked that they fill the data buffer with
        no hole) with ``algorithm`` (the manifest's); returns the prefixed digest of the whole object, or None
        when ``stop`` was set.

        ``landed(name, tensor)`` is called as each tensor is complete. Its bits are proven only once the
        caller has compared the digest with the manifest's: this is for a reader that would otherwise hash
        the object first and read it again (replay), each chunk hashed while it is still in the cache."""
        digest = digests.hasher(algorithm)
        digest.update(self._src.read(0, self._data_start))
        for key, e in sorted(self._entries.items(), key=lambda kv: kv[1].data_offsets):
            h = self.header.tensors[key]
            t = torch.empty(h.shape if h.range is None else (h.count,), dtype=h.torch_dtype)
            raw = t.reshape(-1).view(torch.uint8).numpy()
            # numpy types ndarray as a Buffer on Python >= 3.12 only
            view = memoryview(raw).cast("B") if t.numel() else memoryview(b"")  # type: ignore[arg-type]
            begin, end = e.data_offsets
            if end - begin != view.nbytes:
                raise FormatError(f"{self.where}: tensor {key!r} holds {end - begin} bytes, expected {view.nbytes}")
            for at in range(0, view.nbytes, chunk_bytes):
                if stop is not None and stop.is_set():
                    return None
                part = view[at : at + chunk_bytes]
                if self._src.read_into(self._data_start + begin + at, part) != part.nbytes:
                    raise FormatError(f"{self.where}: tensor {key!r} is truncated")
                digest.update(part)  # releases the GIL: the workers patch tensors meanwhile
            landed(key, t)
        return digests.join(algorithm, digest.hexdigest())

    def _read_into(self, key: str, out: np.ndarray | bytearray) -> None:
        begin, end = self._entries[key].data_offsets
        view = memoryview(out).cast("B")  # type: ignore[arg-type]  # numpy types ndarray as a Buffer on Python >= 3.12 only
        if end - begin != view.nbytes:
            raise FormatError(f"{self.where}: tensor {key!r} holds {end - begin} bytes, expected {view.nbytes}")
        if self._src.read_into(self._data_start + begin, view) != view.nbytes:
            raise FormatError(f"{self.where}: tensor {key!r} is truncated")

    def _blob(self, key: str, scratch: DecodeScratch | None = None) -> bytearray | memoryview:
        begin, end = self._entries[key].data_offsets
        if scratch is None:
            buf = bytearray(end - begin)
            self._read_into(key, buf)
            return buf
        out = scratch.take(key.rpartition(":")[2] + " blob", end - begin)
        self._read_into(key, out)
        return memoryview(out)  # type: ignore[arg-type]  # numpy types ndarray as a Buffer on Python >= 3.12 only

    def patch(self, name: str) -> Patch:
        """A delta's decoded, validated change for one changed tensor, with its positions as int64 (for a
        writer that routes them; ``packed`` is the cheaper form for one that scatters into the tensor itself)."""
        return self.packed(name).unpack()

    def packed(self, name: str, *, scratch: DecodeScratch | None = None) -> PackedPatch:
        """A delta's decompressed, validated change for one changed tensor, positions still ``gap16`` entries
        (``xor_apply_packed`` scatters it as it decodes them).

        ``scratch``: read and decompress into its reused memory (no fresh pages per tensor); the patch is then
        valid only until ``scratch`` decodes another (a writer writes it first, and decodes it again to undo)."""
        h = self.header.tensors[name]
        pos_key, val_key = blob_names(name)
        return decode_packed(
            name,
            h,
            positions=self._blob(pos_key, scratch) if pos_key in self._entries else None,
            values=self._blob(val_key, scratch),
            where=f"{self.where} tensor {name!r}",
            scratch=scratch,
        )

    def change(self, name: str, *, scratch: DecodeScratch | None = None) -> Patch | PackedPatch:
        """The cheapest decoded form of a changed tensor for a writer into the whole tensor: ``packed`` here (a
        multi-part step may answer with a ``patch``). ``xor_apply_packed``/``xor_apply`` write either."""
        return self.packed(name, scratch=scratch)

    def patches(self) -> list[Patch]:
        """Every changed tensor's decoded change, in the header's order (decoded in parallel, largest first;
        any error is raised here)."""
        names = [name for name, h in self.header.tensors.items() if h.changed]
        return parallel_map(self.patch, names, cost=lambda n: self.header.tensors[n].changed)
