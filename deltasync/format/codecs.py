"""Encode/decode stage: a tensor's change to and from compact bytes (docs/FORMAT.md section 3).

Each codec is named in the object's header, so the header alone says how to decode. Decoding validates
every count and index against the header before anything is applied.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Literal

import numpy as np
import zstandard

from deltasync.errors import FormatError
from deltasync.format import _byte_kernels
from deltasync.format._bits import UNSIGNED_NP
from deltasync.format.documents import PositionCodec, TensorHeader, ValueCodec
from deltasync.format.patch import PackedPatch, Patch, unpack_change

DENSE_FRACTION = 0.25  # above this share of changed elements, list every element (no positions)
ZSTD_MIN_SAVING = 0.05  # keep zstd only when it saves at least this share
# the most a zstd frame can expand (a 3-byte RLE block header + 1 byte per 128 KiB block): bounds what a
# blob of n bytes may decompress to, whatever its frame header claims
ZSTD_MAX_RATIO = 1 << 15
_ESCAPE_GAP = 65535

Buffer = bytes | bytearray | memoryview  # a blob's bytes, as read

POSITION_CODECS = frozenset({"gap16", "dense"})
VALUE_CODECS = frozenset({"xor"})


@dataclass(frozen=True, kw_only=True)
class EncodedTensor:
    """A tensor's change as bytes, with the codec chains that produced them."""

    positions: bytes | None
    values: bytes
    positions_chain: tuple[PositionCodec, ...]
    values_chain: tuple[ValueCodec, ...]

    @property
    def nbytes(self) -> int:
        return len(self.values) + (len(self.positions) if self.positions is not None else 0)


_local = threading.local()  # per-thread zstd contexts (they are not thread-safe)


def _compressor(level: int, *, values: bool = False) -> zstandard.ZstdCompressor:
    """This thread's compressor for ``level``; ``values``: for a sparse change's byte-shuffled XOR values.

    At level 1 (the default) the values get a smaller match finder (a 1 KiB hash table, a 128 KiB window,
    matches of 7 bytes or more): their low-byte plane is close to noise, where level 1's short matches cost
    more bytes than the literals they replace. Measured on an AdamW stream (bench/README.md, issue 34): the
    values' zstd time 21% lower and their bytes 4.5% fewer. Any zstd decoder reads the frames: a writer-side
    choice, not a format change."""
    cache = _local.__dict__.setdefault("compressors", {})
    key = (level, values and level == 1)
    if key not in cache:
        if key[1]:
            params = zstandard.ZstdCompressionParameters.from_level(
                1, hash_log=10, window_log=17, min_match=7, write_checksum=True, write_content_size=True)
            cache[key] = zstandard.ZstdCompressor(compression_params=params)
        else:
            cache[key] = zstandard.ZstdCompressor(level=level, write_checksum=True, write_content_size=True)
    return cache[key]


def encode_patch(patch: Patch, *, zstd_level: int = 1) -> EncodedTensor:
    """Encode one tensor's change; chooses the dense form above ``DENSE_FRACTION`` changed."""
    if patch.positions is None or patch.changed > DENSE_FRACTION * patch.numel:
        if patch.positions is None:
            dense = patch.xor
        else:
            dense = np.zeros(patch.numel, patch.xor.dtype)
            dense[patch.positions] = patch.xor
        values, vchain = _pack(*_shuffled(dense), zstd_level)
        return EncodedTensor(positions=None, values=values, positions_chain=("dense",), values_chain=("xor", *vchain))
    positions, pchain = _pack(_byte_kernels.gap16_encode(patch.positions), ("shuffle",), zstd_level)
    values, vchain = _pack(*_shuffled(patch.xor), zstd_level, values=True)
    return EncodedTensor(
        positions=positions, values=values, positions_chain=("gap16", *pchain), values_chain=("xor", *vchain)
    )


encode_change = encode_patch  # the name before issue 9


def decode_packed(
    name: str,
    header: TensorHeader,
    *,
    positions: Buffer | None,
    values: Buffer,
    where: str,
    scratch: DecodeScratch | None = None,
) -> PackedPatch:
    """Decode and validate one changed tensor of a delta into a ``PackedPatch``: decompressed, checked in full
    (counts, every position in range, no value that changes nothing), positions still in their ``gap16`` form.

    ``xor_apply_packed`` scatters it with no positions array in between; ``.unpack()`` gives the ``Patch`` of
    positions for a writer that routes them (see ``decode_change`` for the checks). A part's entry (docs/FORMAT.md
    section 5b) decodes to a patch of its range alone: shape ``(stop - start,)``, positions relative to
    ``start``, ``checksum`` the range's. ``scratch``: decompress into its memory (the patch is then valid until its
    next use).
    """
    entries, planes, starts = _decode_planes(
        numel=header.count,
        width=header.itemsize,
        changed=header.changed,
        positions_chain=list(header.positions or ()),
        values_chain=list(header.values or ()),
        positions=positions,
        values=values,
        where=where,
        scratch=scratch,
    )
    shape = header.shape if header.range is None else (header.count,)
    return PackedPatch(name=name, dtype=header.dtype, shape=shape, changed=header.changed,
                       checksum=int(header.checksum, 16), entries=entries, planes=planes, starts=starts)


def decode_change(
    *,
    numel: int,
    width: int,
    changed: int,
    positions_chain: list[str],
    values_chain: list[str],
    positions: Buffer | None,
    values: Buffer,
    where: str,
) -> tuple[np.ndarray | None, np.ndarray]:
    """Decode and validate one tensor's change: (sorted int64 positions or None for dense, xor bits).

    ``numel``, ``width`` and ``changed`` come from the step header; callers check them against the state they
    patch first. Every size is checked before its allocation, and decompression stops at the size the
    header allows (never at the size a zstd frame claims). ``where`` names the step and tensor for errors.
    """
    entries, planes, _ = _decode_planes(numel=numel, width=width, changed=changed, positions_chain=positions_chain,
                                        values_chain=values_chain, positions=positions, values=values, where=where)
    return unpack_change(entries, planes, width)


def _decode_planes(
    *,
    numel: int,
    width: int,
    changed: int,
    positions_chain: list[str],
    values_chain: list[str],
    positions: Buffer | None,
    values: Buffer,
    where: str,
    scratch: DecodeScratch | None = None,
) -> tuple[np.ndarray | None, np.ndarray, np.ndarray | None]:
    """``decode_change``'s decompression and checks: (byte-shuffled ``gap16`` entries or None for dense, the
    values' bytes byte-shuffled, ``gap16_check``'s block starts or None). Nothing here is a positions array."""
    if not positions_chain or positions_chain[0] not in POSITION_CODECS:
        raise FormatError(f"{where}: unknown positions codec chain {positions_chain!r}")
    if not values_chain or values_chain[0] not in VALUE_CODECS:
        raise FormatError(f"{where}: unknown values codec chain {values_chain!r}")
    dense = positions_chain[0] == "dense"
    count = numel if dense else changed
    if "zstd" not in values_chain and len(values) != count * width:
        raise FormatError(f"{where}: expected {count} values, found {len(values) / width:g}")
    raw = _unpack(values, values_chain[1:], exact=count * width, where=f"{where} values",
                  into=None if scratch is None else scratch.take("values", count * width))
    planes = np.frombuffer(raw, np.uint8)
    if "shuffle" not in values_chain and width > 1:
        planes = _byte_kernels.shuffle_bytes(planes.view(UNSIGNED_NP[width]))
    if dense:
        _, xor = unpack_change(None, planes, width)
        nonzero = int(np.count_nonzero(xor))
        if nonzero != changed:
            raise FormatError(f"{where}: header says {changed} changed elements, dense values change {nonzero}")
        return None, planes, None
    if positions is None:
        raise FormatError(f"{where}: positions are missing")
    max_entries = changed + numel // _ESCAPE_GAP + 1
    raw = _unpack(positions, positions_chain[1:], at_most=2 * max_entries, where=f"{where} positions",
                  into=None if scratch is None else scratch.take("positions", 2 * max_entries))
    entries = np.frombuffer(raw, np.uint8)
    if entries.size % 2:
        raise FormatError(f"{where}: positions hold an odd number of bytes ({entries.size})")
    if "shuffle" not in positions_chain:
        entries = _byte_kernels.shuffle_bytes(entries.view(np.uint16))
    status, detail, starts = _byte_kernels.gap16_check(entries, planes, width, changed, numel)
    if status == _byte_kernels.GAP16_COUNT:
        raise FormatError(f"{where}: header says {changed} changed elements, positions list {detail}")
    if status == _byte_kernels.GAP16_TRAILING:
        raise FormatError(f"{where}: positions end in a run of escape entries (advance 65535, no element) that "
                          f"lists no element after it")
    if status == _byte_kernels.GAP16_RANGE:
        raise FormatError(f"{where}: position {detail} is out of range for {numel} elements")
    if status == _byte_kernels.GAP16_ZERO_VALUE:  # a listed element whose bits do not change: the count is wrong
        raise FormatError(f"{where}: header says {changed} changed elements, {detail} of the listed values "
                          "change nothing")
    return entries, planes, starts


def _shuffled(arr: np.ndarray) -> tuple[np.ndarray, tuple[Literal["shuffle"], ...]]:
    if arr.itemsize == 1:
        return arr.view(np.uint8), ()
    return _byte_kernels.shuffle_bytes(arr), ("shuffle",)


def _pack(
    data: np.ndarray, chain: tuple[Literal["shuffle"], ...], zstd_level: int, *, values: bool = False
) -> tuple[bytes, tuple[Literal["shuffle", "zstd"], ...]]:
    if data.nbytes:  # compressed straight from the array's memory (no copy into bytes first)
        packed = _compressor(zstd_level, values=values).compress(np.ascontiguousarray(data).data)
        if len(packed) <= (1 - ZSTD_MIN_SAVING) * data.nbytes:
            return packed, (*chain, "zstd")
    return data.tobytes(), chain


def _unpack(data: Buffer, chain: list[str], *, where: str, exact: int | None = None,
            at_most: int | None = None, into: np.ndarray | None = None) -> Buffer | np.ndarray:
    """Undo the byte codecs of a chain, producing ``exact`` bytes or at most ``at_most`` bytes.

    A zstd frame's declared content size is checked against that bound before anything is allocated, and
    a frame without one is decompressed into at most the bound; neither can exceed what a zstd frame of this
    many bytes can hold (``ZSTD_MAX_RATIO``), so a small object never costs a large allocation. ``into``: memory
    of at least the bound to decompress a frame that declares its size into (a ``DecodeScratch``'s, reused: fresh
    memory for every frame costs a page fault per 4 KiB, a third of the decompression's time).
    """
    if list(chain) not in (["shuffle", "zstd"], ["shuffle"], ["zstd"], []):
        raise FormatError(f"{where}: unsupported codec chain {chain!r}")
    bound = exact if exact is not None else at_most
    assert bound is not None
    if "zstd" not in chain:
        if len(data) != exact and (exact is not None or len(data) > bound):
            raise FormatError(f"{where}: {len(data)} bytes, expected {'exactly' if exact is not None else 'at most'} "
                              f"{bound}")
        return data
    limit = min(bound, len(data) * ZSTD_MAX_RATIO)
    if exact is not None and exact > limit:
        raise FormatError(f"{where}: a zstd frame of {len(data)} bytes cannot hold the {exact} bytes the header "
                          "implies")
    try:
        declared = zstandard.frame_content_size(data)
        if declared > limit or (exact is not None and declared not in (-1, exact)):
            raise FormatError(f"{where}: zstd frame claims {declared} bytes, expected "
                              f"{'' if exact is not None else 'at most '}{bound if exact is not None else limit}")
        # checked here, for both paths below: decompress ignores bytes after the frame, the stream reader reads
        # on into them and takes a frame whose checksum is cut short
        end = _frame_end(data)
        if end is not None and end < len(data):
            raise FormatError(f"{where}: {len(data) - end} bytes follow the zstd frame (it ends at byte {end} of "
                              f"{len(data)}), expected none")
        if end is not None and end > len(data):
            raise FormatError(f"{where}: the zstd frame is cut short: its blocks need at least {end} bytes, found "
                              f"{len(data)}")
        if declared >= 0 and into is not None:
            return _decompress_into(data, into[:declared], where)
        if declared >= 0:
            out = _decompressor().decompress(data)
        else:
            out = _decompressor().decompress(data, max_output_size=limit)
    except zstandard.ZstdError as e:
        raise FormatError(f"{where}: zstd frame is corrupt or larger than expected ({e})") from None
    if exact is not None and len(out) != exact:
        raise FormatError(f"{where}: {len(out)} bytes after zstd, expected {exact}")
    return out


def _decompress_into(data: Buffer, out: np.ndarray, where: str) -> np.ndarray:
    """One zstd frame decompressed into ``out``, which its declared content size fills exactly (its checksum is
    checked as ``decompress`` checks it: the frame is read to its end)."""
    got = 0
    view = memoryview(out)  # type: ignore[arg-type]  # numpy types ndarray as a Buffer on Python >= 3.12 only
    with _decompressor().stream_reader(data) as reader:
        while got < out.size:
            n = reader.readinto(view[got:])
            if not n:
                break
            got += n
        extra = reader.read(1) if got == out.size else b""
    if got != out.size or extra:
        raise FormatError(f"{where}: {f'more than {out.size}' if extra else got} bytes after zstd, expected {out.size}")
    return out


_ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"


def _frame_end(data: Buffer) -> int | None:
    """Where the zstd frame at the start of ``data`` ends (RFC 8878 section 3.1.1: its header, blocks to the one
    marked last, the optional 4-byte checksum), past ``len(data)`` when its blocks run off the end, or None when
    it is no zstd frame (the decompressor then says what is wrong). Neither python-zstandard's ``decompress``
    (which ignores what follows unless told, and then says so in words only) nor its stream reader (which reads
    on into a next frame, and takes a frame cut short in its checksum) says where a frame ends; this walks only
    block headers, one per 128 KiB of output."""
    view = memoryview(data).cast("B")
    if view[:4] != _ZSTD_MAGIC:
        return None
    pos = zstandard.frame_header_size(data)
    while pos + 3 <= len(view):
        block = int.from_bytes(view[pos:pos + 3], "little")
        pos += 3 + (1 if (block >> 1) & 3 == 1 else block >> 3)  # an RLE block stores its one byte
        if block & 1:
            return pos + 4 * zstandard.get_frame_parameters(data).has_checksum
    return pos + 3


class DecodeScratch:
    """Memory that decoding one tensor after another on one thread reuses: the blobs as read and their
    decompressed bytes. A ``PackedPatch`` decoded with it is valid until the next decode with it (write it first).

    It grows to the largest tensor's change seen and stays that size (``nbytes``)."""

    def __init__(self) -> None:
        self._slots: dict[str, np.ndarray] = {}

    def take(self, slot: str, nbytes: int) -> np.ndarray:
        """``nbytes`` of the slot's memory (uninitialised), growing it by at least a quarter when too small."""
        buf = self._slots.get(slot)
        if buf is None or buf.size < nbytes:
            buf = self._slots[slot] = np.empty(max(nbytes, 0 if buf is None else buf.size * 5 // 4), np.uint8)
        return buf[:nbytes]

    @property
    def nbytes(self) -> int:
        return sum(b.nbytes for b in self._slots.values())


def _decompressor() -> zstandard.ZstdDecompressor:
    d = _local.__dict__.get("decompressor")
    if d is None:
        d = _local.decompressor = zstandard.ZstdDecompressor()
    return d
