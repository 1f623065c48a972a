"""A step-addressed stream on any store URL (docs/FORMAT.md section 5): layout, commit, writer lease.

Commit protocol: the object first (under a name no other attempt uses), then the manifest, written
create-only (it is the commit marker: a committed step is never replaced), then the ``latest.json`` hint.
Before the manifest the writer proves it still holds the lease. Readers only see steps whose manifest
exists, and check each object's size and SHA-256 before parsing it. Every document read back is
validated (``documents.py``).
"""

from __future__ import annotations

import hashlib
import logging
import os
import random
import re
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import fsspec

from deltasync.errors import (
    CorruptObjectError,
    FormatError,
    MissingDependencyError,
    StepExistsError,
    StepNotFoundError,
    StoreAuthError,
    StoreConfigError,
    StoreError,
    StoreUnreachableError,
    StreamNotFoundError,
    WriterConflictError,
)
from deltasync.format.documents import (
    MAX_DOCUMENT_BYTES,
    MAX_STEP,
    LatestHint,
    Lease,
    Manifest,
    StreamInfo,
    check_step,
    decode,
    encode,
)
from deltasync.scratch import ObjectCache, plain_name
from deltasync.transports import (
    LocalTransport,
    StoreFailure,
    classify_failure,
    transient_errors,
    transport_for,
)

log = logging.getLogger(__name__)

__all__ = ["Lease", "Manifest", "Store", "StreamInfo", "step_dir"]

T = TypeVar("T")
_STEP_DIR = re.compile(r"^(\d{12})$")
MANIFEST = "manifest.json"
LATEST = "latest.json"
STREAM = "stream.json"
WRITER = "writer.json"


def step_dir(step: int) -> str:
    """The folder of ``step`` (12 digits: steps 0..10**12-1; anything else is refused)."""
    return f"steps/{check_step(step):012d}"


def sha256_file(path: str | Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


class Store:
    """A stream of steps under one fsspec URL (``file://``/plain path, ``s3://``, ``memory://``, ...).

    ``storage_options`` go to fsspec (credentials, endpoint, region). Remote objects are downloaded into
    ``cache_dir`` (a temporary folder by default) before they are opened; local ones are read in place.
    Transient errors are retried ``retries`` times with exponential backoff and jitter, for ``retry_max_s`` at
    most; errors that retrying cannot mend (credentials, a wrong endpoint, an unknown option) fail at once.
    """

    def __init__(
        self,
        url: str,
        *,
        storage_options: dict[str, Any] | None = None,
        cache_dir: str | Path | None = None,
        retries: int = 4,
        retry_base_s: float = 0.2,
        retry_max_s: float = 60.0,
    ) -> None:
        self.url = url
        self.protocol = fsspec.core.split_protocol(url)[0] or "file"
        options = dict(storage_options or {})
        self._option_names = frozenset(options)
        config = options.get("config_kwargs", {})
        if self.protocol in ("s3", "s3a") and isinstance(config, dict):
            # unless told otherwise: a connect that has not succeeded in 2 s will not (botocore waits 60 s, five
            # times), and one attempt per request in botocore, since call() retries (and bounds the time)
            config = {"connect_timeout": 2, **config, "retries": dict(config.get("retries", {"max_attempts": 1}))}
            options["config_kwargs"] = config
        where = f"cannot open store {url!r}"
        try:
            self.fs, self.root = fsspec.core.url_to_fs(url, **options)
        except ImportError as e:
            extra = {"s3": "s3", "s3a": "s3", "hf": "hf"}.get(self.protocol)
            raise MissingDependencyError(f"{where}: {e}" + (f" (pip install 'deltasync[{extra}]')" if extra else "")) from e
        except TypeError as e:  # a filesystem that checks its options at once
            failure = classify_failure(e, self._option_names)
            if failure is None:
                raise
            raise self._refusal(failure, "open it") from e
        except ValueError as e:
            raise StoreError(f"{where}: {e}") from e
        self.root = self.root.rstrip("/")
        try:
            self.transport = transport_for(self.fs, self.root, options)
        except ImportError as e:
            raise MissingDependencyError(f"{where}: {e} (pip install 'deltasync[hf]')") from e
        self.is_local = isinstance(self.transport, LocalTransport)
        self._transient = transient_errors()
        self._answered = False  # has the store ever answered? (then a failed connect is an outage, not a wrong URL)
        self.retries = retries
        self.retry_base_s = retry_base_s
        self.retry_max_s = retry_max_s
        self._cache_dir = Path(cache_dir) if cache_dir else None
        self._leases: dict[str, tuple[Lease, float]] = {}  # owner -> (lease as last written, its lifetime)
        self._tmp: str | None = None

    def __repr__(self) -> str:
        return f"Store({self.url!r})"

    # --- paths ---

    def path(self, *parts: str) -> str:
        return "/".join([self.root, *parts])

    @property
    def cache_dir(self) -> Path:
        """Where remote objects are downloaded: ``cache_dir`` if given, else a ``deltasync-cache-*`` temp folder."""
        return self.object_cache.folder

    @property
    def object_cache(self) -> ObjectCache:
        """The download cache (scratch.py): objects kept while held open, the others bounded by a byte cap."""
        cache = self.__dict__.get("_object_cache")
        if cache is None:  # setdefault is atomic: threads fetching a chain in parallel share one cache
            cache = self.__dict__.setdefault("_object_cache", ObjectCache(self._cache_dir))
        return cache

    @property
    def cache_max_bytes(self) -> int:
        """At most this many bytes of downloaded objects that nobody holds open are kept (held ones always)."""
        return self.object_cache.max_bytes

    @cache_max_bytes.setter
    def cache_max_bytes(self, max_bytes: int) -> None:
        self.object_cache.max_bytes = max_bytes

    def release_object(self, manifest: Manifest) -> None:
        """A holder (``fetch_object(hold=True)``) is done with the object: deleted once nobody holds it."""
        if not self.is_local and "_object_cache" in self.__dict__:
            self.object_cache.release(self._cache_name(manifest))

    def _cache_name(self, manifest: Manifest) -> str:
        return f"{manifest.step:012d}-{plain_name(manifest.object, where=f'{self.url} step {manifest.step}')}"

    def close(self) -> None:
        """Delete every downloaded object and the cache folder this store made; also right after an error
        (a ``with`` block). The store stays usable: a later download starts a new cache."""
        cache = self.__dict__.get("_object_cache")
        if cache is not None:
            cache.close()

    def __enter__(self) -> Store:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _fresh(self) -> fsspec.AbstractFileSystem:
        """The filesystem with its listing cache dropped: other processes write this stream."""
        self.fs.invalidate_cache()
        return self.fs

    # --- retries ---

    def call(self, what: str, fn: Callable[[], T]) -> T:
        """Run one store operation, retrying transient errors ``retries`` times and ``retry_max_s`` at most.

        Never retried: a definite answer (``FileNotFoundError``, ``FileExistsError``); missing or refused
        credentials (``StoreAuthError``); a storage option the backend does not take (``StoreConfigError``);
        an endpoint that cannot be connected to while the store has never answered (``StoreUnreachableError``:
        a wrong endpoint fails in seconds, while an outage of a store that did answer is retried).
        """
        started = time.monotonic()
        for attempt in range(self.retries + 1):
            try:
                result = fn()
            except (FileNotFoundError, FileExistsError, IsADirectoryError, NotADirectoryError):
                self._answered = True
                raise
            except Exception as e:
                failure = classify_failure(e, self._option_names)
                if failure is not None and not (failure.kind == "unreachable" and self._answered):
                    raise self._refusal(failure, what) from e
                if not isinstance(e, self._transient):
                    raise
                delay = self.retry_base_s * 2**attempt * (0.5 + random.random())
                spent = time.monotonic() - started
                if attempt == self.retries or spent + delay > self.retry_max_s:
                    raise StoreError(f"{self.url}: {what} failed after {attempt + 1} attempts in {spent:.1f}s: {e}") from e
                log.warning("%s: %s failed (%s); retrying in %.2fs", self.url, what, str(e), delay)
                time.sleep(delay)
            else:
                self._answered = True
                return result
        raise AssertionError("unreachable")

    def _refusal(self, failure: StoreFailure, what: str) -> Exception:
        """The error a user sees for a failure that retrying cannot mend: what, why, and what to check."""
        detail = " ".join(failure.detail.split())  # one line, whatever the backend wrote
        hint = failure.hint(self.protocol)
        if failure.kind == "no_credentials":
            return StoreAuthError(f"{self.url}: {what}: no credentials found ({detail}); {hint}")
        if failure.kind == "auth":
            return StoreAuthError(f"{self.url}: {what}: access refused ({detail}); {hint}")
        if failure.kind == "unreachable":
            return StoreUnreachableError(f"{self.url}: {what}: cannot connect to the store ({detail}); {hint}")
        if failure.kind == "not_found":
            return FileNotFoundError(f"{self.url}: {detail}")
        return StoreConfigError(
            f"{self.url}: storage option {detail!r} is not one the {self.protocol!r} filesystem takes "
            f"(options given: {', '.join(sorted(self._option_names))}); check its spelling"
        )

    # --- small JSON objects ---

    def read_bytes(self, rel: str, *, max_bytes: int | None = None) -> bytes:
        """An object's bytes; with ``max_bytes``, at most ``max_bytes + 1`` are fetched (a ranged read), so
        that an oversized object from a hostile store costs no more than that."""
        path = self.path(rel)
        if max_bytes is None:
            return self.call(f"read {rel}", lambda: self.fs.cat_file(path))
        return self.call(f"read {rel}", lambda: self.fs.cat_file(path, start=0, end=max_bytes + 1))

    def write_bytes(self, rel: str, data: bytes, *, if_absent: bool = False) -> None:
        """Write a whole object so that readers see either the old or the new content.

        ``if_absent``: never replace an existing object (``FileExistsError``; atomic where the backend
        allows, ``transport.atomic_conditions``).
        """
        self.call(f"write {rel}", lambda: self.transport.put_bytes(data, self.path(rel), if_absent=if_absent))

    def write_many(self, items: list[tuple[bytes, str]]) -> None:
        """Write small objects in order (the order is what makes a commit)."""
        for data, rel in items:
            self.write_bytes(rel, data)

    def read_document(self, rel: str, kind: type[T]) -> T:
        """Read and validate one stored document (``FileNotFoundError`` if absent, ``FormatError`` if invalid)."""
        return decode(self.read_bytes(rel, max_bytes=MAX_DOCUMENT_BYTES), kind, where=f"{self.url}/{rel}")

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
        """The newest committed step, or None for an empty stream. Uses the hint, then checks for newer.

        Writers never trust this (they list manifests): a hint can be stale or damaged.
        """
        try:
            hint: int | None = self.read_document(LATEST, LatestHint).step
        except FileNotFoundError:
            hint = None
        except FormatError as e:
            log.warning("%s: ignoring the latest hint: %s", self.url, str(e))
            hint = None
        if hint is not None and hint < MAX_STEP and self.exists(f"{step_dir(hint)}/{MANIFEST}") and not self.exists(
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
            m = self.read_document(rel, Manifest)
        except FileNotFoundError:
            raise StepNotFoundError(f"{self.url}: step {step} is not committed{self._nearby(step)}") from None
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

    def fetch_object(self, manifest: Manifest, *, hold: bool = False) -> Path:
        """A local path to the step's object, checked against the manifest's size and SHA-256.

        Local objects are read in place. Remote ones are downloaded into the cache: with ``hold`` the
        object stays there until ``release_object`` (``StreamReader.open`` holds it while it is open);
        without, until the cache's byte cap or ``close()`` removes it.
        """
        rel = f"{step_dir(manifest.step)}/{manifest.object}"
        where = f"{self.url} step {manifest.step} object {manifest.object}"
        if self.is_local:
            plain_name(manifest.object, where=f"{self.url} step {manifest.step}")
            path = Path(self.path(rel))
            if not path.exists():
                raise self._missing(manifest, where)
            self._check_object(path, manifest, where)
            return path
        name = self._cache_name(manifest)
        cache = self.object_cache
        with cache.filling(name) as path:
            if not (path.exists() and path.stat().st_size == manifest.object_bytes):
                part = path.with_name(f"{name}.part")
                try:
                    self.call(f"download {rel}", lambda: self.transport.get_file(self.path(rel), part))
                    os.replace(part, path)
                except FileNotFoundError:
                    part.unlink(missing_ok=True)
                    raise self._missing(manifest, where) from None
                except BaseException:
                    part.unlink(missing_ok=True)  # failed or interrupted (Ctrl-C): no half file stays
                    raise
            try:
                self._check_object(path, manifest, where)
            except BaseException:
                cache.discard(name)
                raise
            cache.add(name, hold=hold)
        return path

    def _missing(self, manifest: Manifest, where: str) -> StepNotFoundError | CorruptObjectError:
        """The error for an object that is not there: its step was collected meanwhile (no manifest either),
        or the store lost it (the manifest is still there)."""
        if not self.exists(f"{step_dir(manifest.step)}/{MANIFEST}"):
            return StepNotFoundError(f"{self.url}: step {manifest.step} was collected (deleted by gc) while it was being read")
        return CorruptObjectError(f"{where}: missing, though the step is committed")

    def _check_object(self, path: Path, manifest: Manifest, where: str) -> None:
        """The object at ``path`` has the manifest's size and SHA-256, or ``CorruptObjectError``."""
        size = path.stat().st_size
        if size != manifest.object_bytes:
            raise CorruptObjectError(f"{where}: {size} bytes, manifest says {manifest.object_bytes} (truncated or replaced)")
        digest = sha256_file(path)
        if digest != manifest.object_sha256:
            raise CorruptObjectError(f"{where}: SHA-256 {digest[:16]}… differs from the manifest's {manifest.object_sha256[:16]}…")

    def commit(self, manifest: Manifest, local_object: str | Path, *, owner: str | None = None) -> None:
        """Publish one step: object, then manifest (the commit, create-only), then the latest hint.

        With ``owner``, the writer's lease is checked right before the manifest is written (and renewed if it
        ran out meanwhile): a writer that lost the stream commits nothing (``WriterConflictError``). A step
        that is already committed is never replaced (``StepExistsError``), whoever committed it.
        ``local_object`` may be consumed (moved into place on a local store).
        """
        d = step_dir(manifest.step)
        manifest_rel = f"{d}/{MANIFEST}"
        if self.exists(manifest_rel):  # saves an upload; the create-only write below is what guarantees it
            raise StepExistsError(f"{self.url}: step {manifest.step} is already committed; a committed step is never replaced")
        target = self.path(d, manifest.object)
        self.call(f"upload {d}/{manifest.object}", lambda: self.transport.move_in(Path(local_object), target))
        if owner is not None:
            self.hold_lease(owner)
        try:
            self.write_bytes(manifest_rel, manifest.to_json().encode(), if_absent=True)
        except FileExistsError:
            raise StepExistsError(
                f"{self.url}: step {manifest.step} was committed by another writer meanwhile; a committed step is never replaced"
            ) from None
        self.write_bytes(LATEST, encode(LatestHint(step=manifest.step)))

    # --- the stream itself ---

    def stream_info(self) -> StreamInfo | None:
        """``stream.json`` (written when a stream is created), or None where there is none."""
        try:
            return self.read_document(STREAM, StreamInfo)
        except FileNotFoundError:
            return None

    def require_stream(self) -> None:
        """Raise ``StreamNotFoundError`` where this URL holds no deltasync stream at all (no ``stream.json``, no
        ``steps/`` folder): a wrong bucket, prefix or path, as opposed to a stream with no steps yet.

        Streams written before ``stream.json`` existed are recognised by their ``steps/`` folder.
        """
        if self.exists(STREAM) or self.exists("steps"):
            return
        try:  # what is there instead helps to spot a wrong prefix
            found = self.call("list the location", lambda: self._fresh().ls(self.root, detail=False))
            names = sorted(p.rstrip("/").rsplit("/", 1)[-1] for p in found)
            more = f" and {len(names) - 5} more" if len(names) > 5 else ""
            there = f"it holds {', '.join(names[:5])}{more}" if names else "it is empty"
        except FileNotFoundError:
            there = "the location does not exist"
        raise StreamNotFoundError(
            f"no deltasync stream at {self.url} (no {STREAM} and no steps/ folder; {there}); check the bucket, prefix or path"
        )

    def create_stream(self) -> StreamInfo:
        """Write ``stream.json`` if the stream has none yet (create-only); returns the stream's."""
        info = self.stream_info()
        if info is None:
            info = StreamInfo(created_unix_s=time.time())
            try:
                self.write_bytes(STREAM, encode(info), if_absent=True)
            except FileExistsError:  # created by another process meanwhile
                info = self.stream_info() or info
        return info

    # --- the writer lease (one publisher per stream) ---

    def _read_lease(self) -> tuple[Lease | None, str | None]:
        """The lease and its version tag (for compare-and-swap), or (None, None) where there is none.

        A lease that does not parse counts as held by an unknown writer: taking it needs ``take_over``.
        """
        path = self.path(WRITER)
        try:
            data, version = self.call(f"read {WRITER}", lambda: self.transport.get_versioned(path))
        except FileNotFoundError:
            return None, None
        try:
            return decode(data, Lease, where=f"{self.url}/{WRITER}"), version
        except FormatError as e:
            log.warning("%s", str(e))
            return Lease(owner="(unreadable writer.json)", expires_unix_s=float("inf")), version

    def lease(self) -> Lease | None:
        return self._read_lease()[0]

    def _write_lease(self, lease: Lease, version: str | None) -> None:
        """Replace the lease if it is still at ``version`` (None: if there is none): a compare-and-swap."""
        data = encode(lease)
        path = self.path(WRITER)
        try:
            self.call(f"write {WRITER}", lambda: self.transport.put_bytes(
                data, path, if_absent=version is None, if_version=version))
        except FileExistsError:
            held = self.lease()
            raise WriterConflictError(
                f"{self.url}: writer {held.owner if held else None!r} took the stream at the same time as {lease.owner!r}"
            ) from None

    def acquire_lease(self, owner: str, *, ttl_s: float, take_over: bool = False) -> Lease:
        """Become the stream's only writer, or raise ``WriterConflictError`` naming the holder.

        The lease is written with a compare-and-swap on what was read (atomic on local folders and S3): of
        two writers racing for a stream, one wins. Also creates the stream (``stream.json``) if needed.
        """
        held, version = self._read_lease()
        now = time.time()
        if held and held.owner != owner and held.expires_unix_s > now and not take_over:
            left = "" if held.expires_unix_s == float("inf") else f" for {held.expires_unix_s - now:.0f}s more"
            raise WriterConflictError(
                f"{self.url}: stream is held by writer {held.owner!r}{left}; "
                f"stop it, wait for its lease to expire, or take over explicitly (take_over=True, CLI --take-over)"
            )
        if held and held.owner != owner:
            log.warning("%s: taking the stream over from writer %r", self.url, held.owner)
        lease = Lease(owner=owner, expires_unix_s=now + ttl_s)
        self._write_lease(lease, version)
        self._leases[owner] = (lease, ttl_s)
        self.create_stream()
        return lease

    def renew_lease(self, owner: str, *, ttl_s: float) -> Lease:
        """Extend ``owner``'s lease (compare-and-swap: fails if anybody else wrote it meanwhile)."""
        held, version = self._read_lease()
        if held is None or held.owner != owner:
            raise WriterConflictError(
                f"{self.url}: writer {owner!r} lost the stream to {held.owner if held else 'nobody (lease deleted)'!r}"
            )
        lease = Lease(owner=owner, expires_unix_s=time.time() + ttl_s)
        self._write_lease(lease, version)
        self._leases[owner] = (lease, ttl_s)
        return lease

    def check_lease(self, owner: str) -> None:
        """Raise ``WriterConflictError`` unless ``owner`` holds the stream (one read)."""
        held = self.lease()
        if held is None or held.owner != owner:
            raise WriterConflictError(
                f"{self.url}: writer {owner!r} lost the stream to {held.owner if held else 'nobody (lease deleted)'!r}"
            )

    def hold_lease(self, owner: str) -> None:
        """Prove that ``owner`` holds the stream now: a read, plus a renewal (compare-and-swap) when its lease
        has less than a third of its lifetime left or ran out (nobody may take a live lease without
        ``take_over``; an expired one could be taken at any moment)."""
        held = self.lease()
        if held is None or held.owner != owner:
            raise WriterConflictError(
                f"{self.url}: writer {owner!r} lost the stream to {held.owner if held else 'nobody (lease deleted)'!r}"
            )
        _, ttl_s = self._leases.get(owner, (None, 120.0))
        if held.expires_unix_s - time.time() < ttl_s / 3:
            self.renew_lease(owner, ttl_s=ttl_s)

    def release_lease(self, owner: str) -> None:
        held = self.lease()
        if held is not None and held.owner == owner:
            self.delete(WRITER)
        self._leases.pop(owner, None)

    def remove_uncommitted(self, *, newer_than: int | None = None, older_than_s: float | None = None) -> list[int]:
        """Delete what no committed step names: step folders without a manifest (a writer died before its
        commit), and files in committed folders other than the manifest and its object (a writer killed
        mid-way that a later writer overtook). Returns the steps whose folders were removed.

        ``older_than_s``: only files at least that old (a writer that just lost the stream may still be
        finishing an upload there; its late manifest must not point at nothing).
        """
        try:
            infos = self.call("list step objects", lambda: self._fresh().find(self.path("steps"), detail=True))
        except FileNotFoundError:
            return []
        prefix = self.path("steps") + "/"
        folders: dict[int, dict[str, float]] = {}  # step -> {file name: age in seconds}
        now = time.time()
        for path, info in infos.items():
            rest = path[len(prefix):] if path.startswith(prefix) else ""
            m = _STEP_DIR.match(rest.split("/", 1)[0])
            if m and "/" in rest:
                folders.setdefault(int(m.group(1)), {})[rest.split("/", 1)[1]] = now - _mtime(info)
        young = (lambda age: False) if older_than_s is None else (lambda age: age < older_than_s)
        removed = []
        for s, files in sorted(folders.items()):
            if newer_than is not None and s <= newer_than or any(young(a) for a in files.values()):
                continue
            if MANIFEST not in files:
                self.delete(step_dir(s), recursive=True)
                removed.append(s)
            elif len(files) > 2:
                try:
                    keep = {MANIFEST, self.manifest(s).object}
                except (StepNotFoundError, FormatError):
                    continue  # collected meanwhile, or for verify to report
                for name in files.keys() - keep:
                    self.delete(f"{step_dir(s)}/{name}")
                    log.info("%s: removed %s from step %d (no manifest names it)", self.url, name, s)
        if removed:
            log.info("%s: removed uncommitted step folders %s", self.url, removed)
        return removed


def _mtime(info: dict[str, Any]) -> float:
    """When a listed file was last written (unix seconds), from whatever the backend reports; "now" when it
    reports nothing usable, so that the file counts as young (never deleted on a guess)."""
    t = info.get("mtime") or info.get("LastModified") or info.get("last_modified") or info.get("created")
    if hasattr(t, "timestamp"):
        t = t.timestamp()
    return float(t) if isinstance(t, (int, float)) else time.time()
