"""The one decoded, in-memory form of a tensor's change: what diff produces, codecs encode and decode, and
every apply (state dicts, replay, the vLLM worker) consumes.

A patch is bits, not values: ``xor`` holds ``old_bits ^ new_bits`` as unsigned integers of the dtype's
width (docs/FORMAT.md section 3), at the sorted flat ``positions`` (or at every element when ``positions``
is None: the ``dense`` form). ``checksum`` is the tensor's ``mix64-sum`` after the change (section 4), so
whoever applies a patch can prove the result.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

from deltasync.errors import FormatError
from deltasync.format import _byte_kernels
from deltasync.format._bits import UNSIGNED_NP
from deltasync.format.documents import ITEMSIZE, DtypeName

__all__ = ["PackedPatch", "Patch", "unpack_change"]


@dataclass(frozen=True, kw_only=True, eq=False)
class Patch:
    """One tensor's change from a base step: ``tensor.flat[positions] ^= xor``, then its checksum is ``checksum``.

    ``positions``: int64, strictly ascending, in ``0 .. numel - 1``; None means every element in order
    (then ``xor`` has ``numel`` entries, 0 where nothing changed). ``xor``: unsigned integers as wide as
    ``dtype``. Decoded patches (``StepObject.patch``) have been checked against their step header already.
    """

    name: str
    dtype: DtypeName
    shape: tuple[int, ...]
    positions: np.ndarray | None
    xor: np.ndarray
    checksum: int

    def __post_init__(self) -> None:
        # cheap structural checks only (nothing proportional to the change): the codecs validate contents
        width = ITEMSIZE.get(self.dtype)
        if width is None:
            raise FormatError(f"patch {self.name!r}: unknown dtype {self.dtype!r}")
        if self.xor.ndim != 1 or self.xor.dtype.kind != "u" or self.xor.itemsize != width:
            raise FormatError(
                f"patch {self.name!r}: xor must be 1-D unsigned {8 * width}-bit bits for {self.dtype}, "
                f"got {self.xor.ndim}-D {self.xor.dtype}"
            )
        count = self.numel if self.positions is None else self.positions.size
        if self.positions is not None and (self.positions.ndim != 1 or self.positions.dtype != np.int64):
            raise FormatError(f"patch {self.name!r}: positions must be 1-D int64, got {self.positions.ndim}-D "
                              f"{self.positions.dtype}")
        if self.xor.size != count:
            raise FormatError(f"patch {self.name!r}: {self.xor.size} xor values for {count} positions")

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def width(self) -> int:
        """Bytes per element."""
        return self.xor.itemsize

    @property
    def dense(self) -> bool:
        return self.positions is None

    @property
    def changed(self) -> int:
        """Elements whose bits change (a dense patch counts its nonzero entries)."""
        if self.positions is None:
            return int(np.count_nonzero(self.xor))
        return int(self.positions.size)

    @property
    def torch_dtype(self) -> Any:
        from deltasync.format._bits import DTYPES

        return DTYPES[self.dtype]

    def __iter__(self) -> Iterator[Any]:
        """``name, positions, xor = patch``: the tuple that ``StepObject.patches()`` used to return.

        Kept only while callers move to the attributes (rollout_loader's worker); prefer the attributes.
        """
        return iter((self.name, self.positions, self.xor))


@dataclass(frozen=True, kw_only=True, eq=False)
class PackedPatch:
    """One tensor's change as a delta stores it, decompressed and checked: ``gap16`` entries, not positions.

    What ``StepObject.packed`` returns. ``xor_apply_packed`` (``deltasync.stages.apply``) scatters it straight
    from ``entries``, with no int64 positions written and read back; ``unpack()`` gives the ``Patch`` for a
    writer that needs the positions (routing into fused or sharded parameters, an accelerator). Built only by
    the decoder, which has checked the counts, every position against ``shape`` and every value, so a scatter
    of it into a tensor of ``numel`` elements cannot go out of range.

    ``entries``: byte-shuffled ``gap16`` entries (docs/FORMAT.md section 3), None for the ``dense`` form;
    ``planes``: the xor values' bytes, byte-shuffled (byte ``j`` of value ``k`` at ``j * count + k``; ``count`` is
    ``changed``, or ``numel`` when dense); ``starts``: where each block of entries begins (``gap16_check``'s).
    """

    name: str
    dtype: DtypeName
    shape: tuple[int, ...]
    changed: int
    checksum: int
    entries: np.ndarray | None
    planes: np.ndarray
    starts: np.ndarray | None

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def width(self) -> int:
        """Bytes per element."""
        return ITEMSIZE[self.dtype]

    @property
    def dense(self) -> bool:
        return self.entries is None

    @property
    def nbytes(self) -> int:
        """Memory held (what a staged step's budget counts)."""
        return self.planes.nbytes + (self.entries.nbytes if self.entries is not None else 0)

    def unpack(self) -> Patch:
        """The same change with int64 positions and xor bits (a new array of each)."""
        positions, xor = unpack_change(self.entries, self.planes, self.width)
        return Patch(name=self.name, dtype=self.dtype, shape=self.shape, positions=positions, xor=xor,
                     checksum=self.checksum)


def unpack_change(entries: np.ndarray | None, planes: np.ndarray, width: int) -> tuple[np.ndarray | None, np.ndarray]:
    """Checked byte-shuffled ``gap16`` entries (None: dense) and value planes as (int64 positions or None, xor)."""
    xor = np.empty(planes.size // width, UNSIGNED_NP[width])
    if width > 1:
        _byte_kernels.unshuffle_bytes(planes, xor)
    else:
        xor[:] = planes
    if entries is None:
        return None, xor
    return _byte_kernels.gap16_decode(entries, xor.size), xor
