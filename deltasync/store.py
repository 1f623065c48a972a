"""Transport stage for object stores: a step-addressed stream on any fsspec URL (docs/FORMAT.md section 5).

Commit protocol: the object first, the manifest last (the manifest is the commit marker), then the
``latest.json`` hint. Readers only see steps whose manifest exists, and check each object's size and
SHA-256 before parsing it.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import random
import re
import shutil
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import fsspec

from .errors import CorruptObjectError, FormatError, StepNotFoundError, StoreError, WriterConflictError
from .format import FORMAT_VERSION, Kind
from .transports import LocalTransport, transient_errors, transport_for

log = logging.getLogger(__name__)

T = TypeVar("T")
_STEP_DIR = re.compile(r"^(\d{12})$")
MANIFEST = "manifest.json"
LATEST = "latest.json"
STREAM = "stream.json"
WRITER = "writer.json"


@dataclass(frozen=True, kw_only=True)
class Manifest:
    """The commit marker of one step: what object holds it and how to check that object."""

    step: int
    base_step: int | None
    kind: Kind
    object: str
    object_bytes: int
    object_sha256: str
    state_checksum: str
    created_unix_s: float
    stats: dict[str, Any] = field(default_factory=dict)
    format_version: int = FORMAT_VERSION

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=1)

    @classmethod
    def from_json(cls, text: str | bytes, *, where: str) -> Manifest:
        try:
            d = json.loads(text)
            if d.get("format_version") != FORMAT_VERSION:
                raise FormatError(f"{where}: manifest format version {d.get('format_version')!r} is not supported")
            return cls(**d)
        except (json.JSONDecodeError, TypeError, AttributeError) as e:
            raise FormatError(f"{where}: invalid manifest ({e})") from None


@dataclass(frozen=True, kw_only=True)
class Lease:
    """Who may write a stream, until when. Renewed by the holder; expired leases may be taken."""

    owner: str
    expires_unix_s: float


def step_dir(step: int) -> str:
    return f"steps/{step:012d}"


def sha256_file(path: str | Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


class Store:
    """A stream of steps under one fsspec URL (``file://``/plain path, ``s3://``, ``memory://``, ...).

    ``storage_options`` go to fsspec (credentials, endpoint, region). Remote objects are downloaded into
    ``cache_dir`` (a temporary folder by default) before they are opened; local ones are read in place.
    Transient errors are retried ``retries`` times with exponential backoff and jitter.
    """

    def __init__(
        self,
        url: str,
        *,
        storage_options: dict[str, Any] | None = None,
        cache_dir: str | Path | None = None,
        retries: int = 4,
        retry_base_s: float = 0.2,
    ) -> None:
        self.url = url
        try:
            self.fs, self.root = fsspec.core.url_to_fs(url, **(storage_options or {}))
        except (ImportError, ValueError) as e:
            raise StoreError(f"cannot open store {url!r}: {e}") from e
        self.root = self.root.rstrip("/")
        try:
            self.transport = transport_for(self.fs, self.root, storage_options or {})
        except ImportError as e:
            raise StoreError(f"cannot open store {url!r}: {e} (install the extra: pip install 'deltasync[hf]')") from e
        self.is_local = isinstance(self.transport, LocalTransport)
        self._transient = transient_errors()
        self.retries = retries
        self.retry_base_s = retry_base_s
        self._cache_dir = Path(cache_dir) if cache_dir else None
        self._tmp: str | None = None

    def __repr__(self) -> str:
        return f"Store({self.url!r})"

    # --- paths ---

    def path(self, *parts: str) -> str:
        return "/".join([self.root, *parts])

    @property
    def cache_dir(self) -> Path:
        if self._cache_dir is None:
            self._tmp = tempfile.mkdtemp(prefix="deltasync-cache-")
            self._cache_dir = Path(self._tmp)
        self._cache_dir.mkdir(parents=True, exist_ok=True)  # a missing local folder must not read as a missing object
        return self._cache_dir

    def close(self) -> None:
        if self._tmp:
            shutil.rmtree(self._tmp, ignore_errors=True)
            self._tmp = None
            self._cache_dir = None

    def _fresh(self) -> fsspec.AbstractFileSystem:
        """The filesystem with its listing cache dropped: other processes write this stream."""
        self.fs.invalidate_cache()
        return self.fs

    # --- retries ---

    def call(self, what: str, fn: Callable[[], T]) -> T:
        """Run one store operation with retries; ``FileNotFoundError`` is never retried."""
        for attempt in range(self.retries + 1):
            try:
                return fn()
            except FileNotFoundError:
                raise
            except self._transient as e:
                if attempt == self.retries:
                    raise StoreError(f"{self.url}: {what} failed after {attempt + 1} attempts: {e}") from e
                delay = self.retry_base_s * 2**attempt * (0.5 + random.random())
                log.warning("%s: %s failed (%s); retrying in %.2fs", self.url, what, e, delay)
                time.sleep(delay)
        raise AssertionError("unreachable")

    # --- small JSON objects ---

    def read_bytes(self, rel: str) -> bytes:
        return self.call(f"read {rel}", lambda: self.fs.cat_file(self.path(rel)))

    def write_bytes(self, rel: str, data: bytes) -> None:
        """Write a whole object so that readers see either the old or the new content."""
        self.write_many([(data, rel)])

    def write_many(self, items: list[tuple[bytes, str]]) -> None:
        """Write small objects in order (the order is what makes a commit)."""
        paths = [(data, self.path(rel)) for data, rel in items]
        self.call(f"write {', '.join(rel for _, rel in items)}", lambda: self.transport.put_bytes(paths))

    def exists(self, rel: str) -> bool:
        return self.call(f"check {rel}", lambda: self._fresh().exists(self.path(rel)))

    def delete(self, rel: str, *, recursive: bool = False) -> None:
        def _rm() -> None:
            try:
                self.fs.rm(self.path(rel), recursive=recursive)
            except FileNotFoundError:
                pass

        self.call(f"delete {rel}", _rm)

    # --- steps ---

    def step_folders(self) -> list[int]:
        """Every step folder holding any object, committed or not (empty folders do not count)."""
        try:
            found = self.call("list step objects", lambda: self._fresh().find(self.path("steps")))
        except FileNotFoundError:
            return []
        out = set()
        prefix = self.path("steps") + "/"
        for p in found:
            m = _STEP_DIR.match(p[len(prefix) :].split("/", 1)[0]) if p.startswith(prefix) else None
            if m:
                out.add(int(m.group(1)))
        return sorted(out)

    def steps(self) -> list[int]:
        """Committed steps (those with a manifest), ascending."""
        try:
            found = self.call("list manifests", lambda: self._fresh().glob(self.path("steps", "*", MANIFEST)))
        except FileNotFoundError:
            return []
        out = []
        for p in found:
            m = _STEP_DIR.match(p.rstrip("/").rsplit("/", 2)[-2])
            if m:
                out.append(int(m.group(1)))
        return sorted(out)

    def latest_step(self) -> int | None:
        """The newest committed step, or None for an empty stream. Uses the hint, then checks for newer."""
        try:
            hint = int(json.loads(self.read_bytes(LATEST))["step"])
        except (FileNotFoundError, ValueError, KeyError, TypeError):
            hint = None
        if hint is not None and self.exists(f"{step_dir(hint)}/{MANIFEST}") and not self.exists(
            f"{step_dir(hint + 1)}/{MANIFEST}"
        ):
            # a newer step may still exist with a gap in numbering; the hint is updated after each commit,
            # so only a writer that died between manifest and hint leaves it stale: then list
            return hint
        steps = self.steps()
        return steps[-1] if steps else None

    def manifest(self, step: int) -> Manifest:
        rel = f"{step_dir(step)}/{MANIFEST}"
        try:
            data = self.read_bytes(rel)
        except FileNotFoundError:
            raise StepNotFoundError(f"{self.url}: step {step} is not committed{self._nearby(step)}") from None
        m = Manifest.from_json(data, where=f"{self.url} step {step} manifest")
        if m.step != step:
            raise FormatError(f"{self.url}: manifest in folder of step {step} describes step {m.step}")
        return m

    def _nearby(self, step: int) -> str:
        steps = self.steps()
        if not steps:
            return " (the stream has no committed steps)"
        below = [s for s in steps if s < step]
        above = [s for s in steps if s > step]
        near = ", ".join(str(s) for s in ([below[-1]] if below else []) + ([above[0]] if above else []))
        return f" (nearest committed: {near}; stream holds {steps[0]}..{steps[-1]})"

    def fetch_object(self, manifest: Manifest) -> Path:
        """A local path to the step's object, checked against the manifest's size and SHA-256."""
        rel = f"{step_dir(manifest.step)}/{manifest.object}"
        where = f"{self.url} step {manifest.step} object {manifest.object}"
        if self.is_local:
            path = Path(self.path(rel))
            if not path.exists():
                raise CorruptObjectError(f"{where}: missing, though the step is committed")
        else:
            path = self.cache_dir / f"{manifest.step:012d}-{manifest.object}"
            if not (path.exists() and path.stat().st_size == manifest.object_bytes):
                part = path.with_suffix(".part")
                try:
                    self.call(f"download {rel}", lambda: self.transport.get_file(self.path(rel), part))
                except FileNotFoundError:
                    raise CorruptObjectError(f"{where}: missing, though the step is committed") from None
                os.replace(part, path)
        size = path.stat().st_size
        if size != manifest.object_bytes:
            raise CorruptObjectError(f"{where}: {size} bytes, manifest says {manifest.object_bytes} (truncated or replaced)")
        digest = sha256_file(path)
        if digest != manifest.object_sha256:
            if not self.is_local:
                path.unlink(missing_ok=True)
            raise CorruptObjectError(f"{where}: SHA-256 {digest[:16]}… differs from the manifest's {manifest.object_sha256[:16]}…")
        return path

    def commit(self, manifest: Manifest, local_object: str | Path) -> None:
        """Publish one step: object, then manifest (the commit), then the latest hint.

        ``local_object`` may be consumed (moved into place on a local store).
        """
        d = step_dir(manifest.step)
        target = self.path(d, manifest.object)
        self.call(f"upload {d}/{manifest.object}", lambda: self.transport.move_in(Path(local_object), target))
        self.write_many(
            [(manifest.to_json().encode(), f"{d}/{MANIFEST}"), (json.dumps({"step": manifest.step}).encode(), LATEST)]
        )

    # --- the writer lease (one publisher per stream) ---

    def lease(self) -> Lease | None:
        try:
            d = json.loads(self.read_bytes(WRITER))
            return Lease(owner=str(d["owner"]), expires_unix_s=float(d["expires_unix_s"]))
        except FileNotFoundError:
            return None
        except (ValueError, KeyError, TypeError):
            log.warning("%s: unreadable %s; treating the stream as unheld", self.url, WRITER)
            return None

    def acquire_lease(self, owner: str, *, ttl_s: float, take_over: bool = False) -> Lease:
        """Become the stream's only writer, or raise ``WriterConflictError`` naming the holder.

        A lease object with an expiry (object stores offer no portable compare-and-swap): after writing it
        the writer reads it back, and it checks it again before every commit (``renew_lease``).
        """
        held = self.lease()
        now = time.time()
        if held and held.owner != owner and held.expires_unix_s > now and not take_over:
            raise WriterConflictError(
                f"{self.url}: stream is held by writer {held.owner!r} for {held.expires_unix_s - now:.0f}s more; "
                f"stop it, wait for its lease to expire, or take over explicitly (take_over=True, CLI --take-over)"
            )
        if held and held.owner != owner and take_over:
            log.warning("%s: taking the stream over from writer %r", self.url, held.owner)
        return self.renew_lease(owner, ttl_s=ttl_s, check=False)

    def renew_lease(self, owner: str, *, ttl_s: float, check: bool = True) -> Lease:
        """Extend ``owner``'s lease; with ``check``, first make sure nobody took the stream over."""
        if check:
            self.check_lease(owner)
        lease = Lease(owner=owner, expires_unix_s=time.time() + ttl_s)
        self.write_bytes(WRITER, json.dumps(asdict(lease)).encode())
        held = self.lease()
        if held is None or held.owner != owner:
            raise WriterConflictError(f"{self.url}: writer {held.owner if held else None!r} took the stream at the same time")
        return lease

    def check_lease(self, owner: str) -> None:
        """Raise ``WriterConflictError`` unless ``owner`` holds the stream (one read)."""
        held = self.lease()
        if held is None or held.owner != owner:
            raise WriterConflictError(
                f"{self.url}: writer {owner!r} lost the stream to {held.owner if held else 'nobody (lease deleted)'!r}"
            )

    def release_lease(self, owner: str) -> None:
        held = self.lease()
        if held is not None and held.owner == owner:
            self.delete(WRITER)

    def remove_uncommitted(self, *, newer_than: int | None = None) -> list[int]:
        """Delete step folders without a manifest (leftovers of a writer that died); returns their steps."""
        committed = set(self.steps())
        removed = [s for s in self.step_folders() if s not in committed and (newer_than is None or s > newer_than)]
        for s in removed:
            self.delete(step_dir(s), recursive=True)
        if removed:
            log.info("%s: removed uncommitted step folders %s", self.url, removed)
        return removed

