"""Every name that comes from outside (a store, a peer, a flag), and the one way to check it: the whole string.

A pattern anchored with ``^...$`` also accepts a trailing newline (``$`` matches before one), so a consumer id
``"c1\\n"`` or a file name ``"config.json\\n"`` would pass and then name a different file. The patterns here are
bare; :func:`whole` anchors one with ``\\A...\\Z`` for msgspec (which searches), and :func:`check` matches a
value whole with ``re.fullmatch``.
"""

from __future__ import annotations

import re
from typing import Literal

# the format's dtype names (docs/FORMAT.md section 2); here, below documents and _bits, which both use them
DtypeName = Literal["BOOL", "U8", "I8", "I16", "I32", "I64", "U16", "U32", "U64", "F16", "BF16", "F32", "F64",
                    "F8_E4M3", "F8_E5M2"]

__all__ = [
    "CHECKSUM", "CONSUMER_ID", "DtypeName", "FILE_NAME", "OBJECT_NAME", "PEER_NAME", "SHA256", "STREAM_ID", "check",
    "whole",
]

SHA256 = r"[0-9a-f]{64}"
CHECKSUM = r"0x[0-9a-f]{16}"
# a plain file name: no separators, no leading dot (so neither "." nor ".."), bounded length
FILE_NAME = r"[A-Za-z0-9][A-Za-z0-9._+-]{0,254}"
OBJECT_NAME = r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}\.safetensors"
CONSUMER_ID = r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}"
PEER_NAME = r"[A-Za-z0-9][A-Za-z0-9._:-]{0,127}"  # NIXL agents and RDMA peers
# a stream's id (stream.json): random hex by default, or a name the operator chose (docs/FORMAT.md section 5e)
STREAM_ID = r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}"


def whole(pattern: str) -> str:
    """``pattern`` anchored to the whole string, for matchers that search (msgspec's ``Meta(pattern=...)``)."""
    return rf"\A(?:{pattern})\Z"


def check(pattern: str, value: object) -> bool:
    """Whether ``value`` is a string that ``pattern`` matches whole (no trailing newline, nothing around it)."""
    return isinstance(value, str) and re.fullmatch(pattern, value) is not None
