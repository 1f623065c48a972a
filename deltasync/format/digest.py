"""Object digests: the one place that hashes a step's objects (docs/FORMAT.md section 1b).

A digest is written ``"<algorithm>:<64 hex>"`` inside the library (``"blake3:5e07…"``), the way OCI image
manifests write theirs, so that no two algorithms' digests of any bytes can be mistaken for each other (a cache
key, a comparison, a signed statement). Manifests of format versions 1 and 2 store bare SHA-256 hex
(``object_sha256``); version 3 stores the prefixed form (``object_digest``) and names its algorithm
(``"digest": "blake3"``).

BLAKE3 is a tree hash: the ``blake3`` package hashes one large buffer on every core (``max_threads=AUTO``) at
memory speed, where SHA-256 runs at about 1 GB/s on one core. Writers write BLAKE3 (version 3) unless the
environment variable ``DELTASYNC_DIGEST`` is ``sha256`` (kept for one release, for consumers that cannot read
version 3 yet).

Example::

    >>> from deltasync.format import digest
    >>> d = digest.compute(b"abc", "blake3")
    >>> d.split(":")[0], len(digest.hex_of(d))
    ('blake3', 64)
    >>> digest.matches(d, digest.compute(b"abc", "blake3"))
    True
"""

from __future__ import annotations

import hashlib
import hmac
import os
import re
from pathlib import Path
from typing import Final, Literal, Protocol, cast, get_args

import blake3

from deltasync.errors import ConfigError, FormatError

Algorithm = Literal["sha256", "blake3"]
ALGORITHMS: Final[tuple[Algorithm, ...]] = get_args(Algorithm)
DEFAULT_ALGORITHM: Final[Algorithm] = "blake3"
ENV: Final = "DELTASYNC_DIGEST"
HEX = r"[0-9a-f]{64}"  # both algorithms give 32 bytes
PREFIXED = rf"(?:sha256|blake3):{HEX}"
_PREFIXED = re.compile(rf"(sha256|blake3):({HEX})")
_FILE_CHUNK = 1 << 22


class Hasher(Protocol):
    """What :func:`hasher` returns: ``update`` with bytes as they pass, then ``hexdigest``."""

    def update(self, data: bytes | bytearray | memoryview, /) -> object: ...

    def hexdigest(self) -> str: ...


def check_algorithm(name: object, *, where: str) -> Algorithm:
    """``name`` as an algorithm this reader knows, or ``FormatError`` naming what arrived and what was expected."""
    if name not in ALGORITHMS:
        raise FormatError(f"{where}: digest {str(name)[:40]!r} is not one this reader knows "
                          f"(expected one of {', '.join(ALGORITHMS)})")
    return cast(Algorithm, name)


def write_algorithm() -> Algorithm:
    """The algorithm writers use now: BLAKE3, or SHA-256 where ``DELTASYNC_DIGEST=sha256`` asks for the older
    format (versions 1 and 2) for one more release.

    Raises:
        ConfigError: the variable is set to anything else (``md5``, empty, ``SHA256``): a setting, not a store's
            fault, so never retried and never a silent fallback. Writers call this when they are made, so that a
            typo fails there, before anything is captured or written.
    """
    name = os.environ.get(ENV, DEFAULT_ALGORITHM)
    if name not in ALGORITHMS:
        raise ConfigError(f"environment variable {ENV}: expected one of {', '.join(ALGORITHMS)} (or unset: "
                          f"{DEFAULT_ALGORITHM}), got {name[:40]!r}", expected=ALGORITHMS, found=name[:40])
    return cast(Algorithm, name)


def hasher(algorithm: Algorithm, *, parallel: bool = True) -> Hasher:
    """An incremental hasher; BLAKE3 hashes each large ``update`` on every core unless ``parallel`` is False.

    ``parallel=False`` is for a caller that hashes while other threads move bytes (the RDMA inbox hashes one
    piece while the next lands): there BLAKE3's worker threads only take cores from that transfer, and their
    wake-ups and spinning after each small ``update`` cost more than they save (measured: bench/README.md)."""
    if algorithm == "blake3":
        return cast(Hasher, blake3.blake3(max_threads=blake3.blake3.AUTO if parallel else 1))
    if algorithm == "sha256":
        return hashlib.sha256()
    raise FormatError(f"digest {algorithm!r} is not one this reader knows (expected one of {', '.join(ALGORITHMS)})")


def join(algorithm: Algorithm, hexdigest: str) -> str:
    """The prefixed form of a bare hex digest."""
    return f"{algorithm}:{hexdigest}"


def split(digest: str) -> tuple[Algorithm, str]:
    """``(algorithm, hex)`` of a prefixed digest; ``FormatError`` for anything else."""
    m = _PREFIXED.fullmatch(digest) if isinstance(digest, str) else None
    if m is None:
        raise FormatError(f"expected a digest '<{'|'.join(ALGORITHMS)}>:<64 hex>', got {str(digest)[:80]!r}")
    return cast(Algorithm, m.group(1)), m.group(2)


def algorithm_of(digest: str) -> Algorithm:
    return split(digest)[0]


def hex_of(digest: str) -> str:
    """The bare hex of a prefixed digest (object names carry its first 16 characters)."""
    return split(digest)[1]


def compute(data: bytes | bytearray | memoryview, algorithm: Algorithm) -> str:
    """The prefixed digest of ``data``."""
    h = hasher(algorithm)
    h.update(data)
    return join(algorithm, h.hexdigest())


def of_file(path: str | Path, algorithm: Algorithm) -> str:
    """The prefixed digest of the file at ``path`` (BLAKE3 maps it and hashes it on every core)."""
    if algorithm == "blake3":
        b = blake3.blake3(max_threads=blake3.blake3.AUTO)
        b.update_mmap(str(path))
        return join(algorithm, b.hexdigest())
    h = hasher(algorithm)
    with open(path, "rb") as f:
        while chunk := f.read(_FILE_CHUNK):
            h.update(chunk)
    return join(algorithm, h.hexdigest())


def matches(a: str, b: str) -> bool:
    """Whether two prefixed digests are equal, compared in constant time (digests of signed data are compared
    with attacker-chosen ones)."""
    return hmac.compare_digest(a.encode(), b.encode())
