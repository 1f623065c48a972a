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
from deltasync.format.documents import ITEMSIZE, DtypeName

__all__ = ["Patch"]


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
