"""Views of tensors as raw bits, and the dtype names of the format.

Deltas compare and patch bit patterns, never values: that is what makes them exact for every dtype
(NaN payloads and signed zeros included).
"""

from __future__ import annotations

from typing import cast

import numpy as np
import torch

from deltasync.errors import FormatError
from deltasync.format.names import DtypeName

# safetensors dtype names <-> torch dtypes (docs/FORMAT.md section 2)
DTYPES: dict[str, torch.dtype] = {
    "BOOL": torch.bool,
    "U8": torch.uint8,
    "I8": torch.int8,
    "I16": torch.int16,
    "I32": torch.int32,
    "I64": torch.int64,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F32": torch.float32,
    "F64": torch.float64,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
}
for _name, _attr in (("U16", "uint16"), ("U32", "uint32"), ("U64", "uint64")):
    if hasattr(torch, _attr):
        DTYPES[_name] = getattr(torch, _attr)
DTYPE_NAMES: dict[torch.dtype, DtypeName] = {v: cast(DtypeName, k) for k, v in DTYPES.items()}  # the format's names

_SIGNED = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
UNSIGNED_NP = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}


def dtype_name(dtype: torch.dtype) -> DtypeName:
    try:
        return DTYPE_NAMES[dtype]
    except KeyError:
        raise FormatError(f"dtype {dtype} is not supported (supported: {sorted(DTYPES)})") from None


def dtype_from_name(name: str, *, where: str = "") -> torch.dtype:
    try:
        return DTYPES[name]
    except KeyError:
        raise FormatError(f"{where}unknown dtype {name!r} (known: {sorted(DTYPES)})") from None


def int_view(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bits as a flat signed-integer tensor of the same width (no copy; t must be contiguous)."""
    flat = t.reshape(-1)
    if flat.dtype == torch.bool:
        flat = flat.view(torch.uint8)
    return flat.view(_SIGNED[flat.element_size()])


def np_bits(t: torch.Tensor) -> np.ndarray:
    """The bits of a contiguous CPU tensor as a flat unsigned numpy array sharing its memory."""
    return int_view(t).numpy().view(UNSIGNED_NP[t.element_size()])


def np_words(u: np.ndarray) -> tuple[np.ndarray | None, int]:
    """An 8-byte word view of the largest prefix of ``u`` that fills whole words, and elements per word.

    Lets the diff kernel skip unchanged words with one compare. None when ``u`` is not 8-byte aligned.
    """
    group = 8 // u.itemsize
    covered = (u.size // group) * group
    if covered == 0 or u.ctypes.data % 8:
        return None, group
    return u[:covered].view(np.uint64), group
