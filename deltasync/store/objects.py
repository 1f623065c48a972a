"""Reading a step's objects out of a store: the per-process download cache, the host's node cache, and the
size and digest checks every object passes before anyone parses it (docs/FORMAT.md section 5).

A part of :class:`deltasync.store.Store` (which delegates ``fetch_object``, ``read_object`` and the rest here, so
that the store module stays about layout and commits): it is given what it needs when it is made (the store's URL,
transport and retry policy, whether the store is local, the cache folder and the node cache) and reaches into no
other part.
"""

from __future__ import annotations

import inspect
import logging
import os
import threading
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from deltasync.errors import CorruptObjectError, StepNotFoundError
from deltasync.format import digest as digests
from deltasync.format.documents import Manifest, Part, check_step
from deltasync.store.scratch import ObjectCache, plain_name

if TYPE_CHECKING:
    from deltasync.store.node_cache import NodeCache
    from deltasync.store.retries import Retrier
    from deltasync.transports.base import Transport

log = logging.getLogger(__name__)

MANIFEST = "manifest.json"

ByteProgress = Callable[[str, int, int], None]
"""``progress(what, bytes_done, bytes_total)`` during a download (the CLI draws a bar from it)."""

PROGRESS_AFTER_BYTES = 8 << 20
"""Objects at least this large report their download's progress (a smaller one is over before a bar shows)."""


def step_dir(step: int) -> str:
    """The folder of ``step`` (12 digits: steps 0..10**12-1; anything else is refused)."""
    return f"steps/{check_step(step):012d}"


def _folder(manifest: Manifest) -> str:
    """Where a manifest's objects live: its step's folder, or a catch-up's (``Manifest.folder``)."""
    return manifest.folder if manifest.folder is not None else step_dir(manifest.step)


def part_of(manifest: Manifest, part: Part | None) -> Part:
    """The object meant: ``part``, or a version-1 step's only object."""
    if part is not None:
        return part
    objects = manifest.objects
    if len(objects) != 1:
        raise ValueError(f"step {manifest.step} has {len(objects)} parts: name the one to read")
    return objects[0]


def sha256_file(path: str | Path) -> str:
    """The bare SHA-256 hex of a file (model files, documents: docs/FORMAT.md section 5)."""
    return digests.hex_of(digests.of_file(path, "sha256"))


class StoreObjects:
    """Object reads of a :class:`~deltasync.store.Store`: ``fetch_object``, ``read_object``, ``release_object``.

    ``transport`` and ``retry`` are the store's (every request goes through the store's retry policy); ``is_local``:
    objects are read in place (``transport.local_path``) instead of downloaded; ``cache_dir``: where downloads go
    (a temporary folder made on first use by default); ``node_cache``: the host's shared cache, if any.

    Example::

        objects = StoreObjects("s3://bucket/run", transport, Retrier("s3://bucket/run", "s3"), is_local=False)
        path = objects.fetch_object(manifest)
    """

    download_progress: ByteProgress | None = None
    """Set (by the CLI) to see large downloads advance: every transport, because it watches the partial file."""

    def __init__(self, url: str, transport: Transport, retry: Retrier, *, is_local: bool,
                 cache_dir: Path | None = None, node_cache: NodeCache | None = None) -> None:
        self.url = url
        self.transport = transport
        self.is_local = is_local
        self.node_cache = node_cache
        self._retry = retry
        self._cache_dir = cache_dir

    def close(self) -> None:
        """Delete every downloaded object and the cache folder (a later download starts a new cache)."""
        cache = self.__dict__.get("_object_cache")
        if cache is not None:
            cache.close()

    def _exists(self, rel: str) -> bool:
        return self._retry.call(f"check {rel}", lambda: self.transport.exists(rel))

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

    def release_object(self, manifest: Manifest, part: Part | None = None) -> None:
        """A holder (``fetch_object(hold=True)``) is done with the object: deleted once nobody holds it."""
        if not self.is_local and "_object_cache" in self.__dict__:
            self.object_cache.release(self._cache_name(manifest, part_of(manifest, part)))

    def _cache_name(self, manifest: Manifest, part: Part) -> str:
        """The download cache's file name, one per stored key: ``<B>-<name>`` for step B's own objects (as
        before, so a kept ``cache_dir`` stays valid), ``catchup+<B>+<A>+<name>`` for a catch-up's (its folder,
        ``+`` for ``/``; no object name holds ``+``). A name from the step alone let a catch-up to step B and B's
        own object of the same name share one entry, each refusing the other's bytes."""
        name = plain_name(part.object, where=f"{self.url} step {manifest.step}")
        if manifest.folder is None:
            return f"{manifest.step:012d}-{name}"
        return f"{manifest.folder.replace('/', '+')}+{name}"

    def _object_key(self, manifest: Manifest, part: Part) -> str:
        """The key of a step's object; its name comes from a store, so it must be a plain file name."""
        return f"{_folder(manifest)}/{plain_name(part.object, where=f'{self.url} step {manifest.step}')}"

    def fetch_object(self, manifest: Manifest, *, part: Part | None = None, hold: bool = False) -> Path:
        """A local path to the step's object, checked against the manifest's size and digest.

        Local objects are read in place. Remote ones are downloaded into the cache: with ``hold`` the
        object stays there until ``release_object`` (``StreamReader.open`` holds it while it is open);
        without, until the cache's byte cap or ``close()`` removes it. ``part``: which object of a multi-part
        step (docs/FORMAT.md section 5b); a version-1 step has one.
        """
        part = part_of(manifest, part)
        rel = self._object_key(manifest, part)
        where = f"{self.url} step {manifest.step} object {part.object}"
        local = self.transport.local_path(rel) if self.is_local else None
        if local is not None:
            if not local.exists():
                raise self._missing(manifest, where)
            self._check_object(local, manifest, part, where)
            return local
        name = self._cache_name(manifest, part)
        cache = self.object_cache
        with cache.filling(name) as path:
            try:
                if path.exists() and path.stat().st_size == part.object_bytes:
                    self._check_object(path, manifest, part, where)
                elif self.node_cache is not None:  # linked from the host's cache, or downloaded once for the host
                    self.node_cache.fetch(part.digest, part.object_bytes, path,
                                          lambda dest: self._download(rel, dest, manifest, where, part.object_bytes),
                                          lambda dest: self._check_object(dest, manifest, part, where))
                else:
                    self._download(rel, path, manifest, where, part.object_bytes)
                    self._check_object(path, manifest, part, where)
            except BaseException:
                cache.discard(name)
                raise
            cache.add(name, hold=hold)
        return path

    def _download(self, rel: str, path: Path, manifest: Manifest, where: str, total: int) -> None:
        """``rel`` into ``path``, whole or not at all (a failed or interrupted download leaves no half file).

        Bounded by the manifest's size (``Transport.get_file(max_bytes=total)``): an object a bucket writer swapped
        for a huge one is refused as soon as the transport sees the excess, having written at most ``total + 1``
        bytes (docs/SECURITY.md); a ``CorruptObjectError``, which the retry policy does not retry."""
        partial = path.with_name(f"{path.name}.part")
        try:
            with _watching(partial, f"download step {manifest.step}", total, self.download_progress):
                self._retry.call(f"download {rel}", lambda: self._get_file(rel, partial, total))
            os.replace(partial, path)
        except FileNotFoundError:
            partial.unlink(missing_ok=True)
            raise self._missing(manifest, where) from None
        except CorruptObjectError as e:  # the transport's too_large: said again with the stream, step and object
            partial.unlink(missing_ok=True)
            found = e.found if isinstance(e.found, int) else total + 1
            raise CorruptObjectError(
                f"{where}: {found}{'+' if found == total + 1 else ''} bytes, manifest says {total} (more than it "
                "says: replaced; refused while downloading)",
                url=self.url, step=manifest.step, key=rel.rsplit("/", 1)[-1], expected=total, found=found,
            ) from e
        except BaseException:
            partial.unlink(missing_ok=True)
            raise

    def _get_file(self, rel: str, local: Path, max_bytes: int) -> None:
        """``transport.get_file`` bounded by ``max_bytes``; a transport whose ``get_file`` predates the bound
        (``get_file(key, local)``) downloads unbounded, as it did, warned once per class: the size check after
        still refuses an oversized object, only later."""
        get_file = self.transport.get_file
        if _takes_max_bytes(get_file):
            get_file(rel, local, max_bytes=max_bytes)
            return
        kind = type(self.transport)
        if kind not in _UNBOUNDED_WARNED:
            _UNBOUNDED_WARNED.add(kind)
            log.warning("%s: %s.get_file(key, local) takes no max_bytes: its downloads are not bounded by the "
                        "manifest's size (an oversized object is downloaded whole, then refused); add the keyword "
                        "(deltasync.transports.Transport.get_file)", self.url, kind.__qualname__)
        get_file(rel, local)

    def read_object(self, manifest: Manifest, *, part: Part | None = None) -> bytes:
        """A step's object (``part`` of a multi-part step) in memory, checked against the manifest's size and
        digest (no cache, no file). At most ``object_bytes + 1`` bytes are fetched: an oversized object
        costs no more than that.
        """
        part = part_of(manifest, part)
        rel = self._object_key(manifest, part)
        where = f"{self.url} step {manifest.step} object {part.object}"

        def download() -> bytes:
            try:
                return self._retry.call(f"read {rel}", lambda: self.transport.get(rel, end=part.object_bytes + 1))
            except FileNotFoundError:
                raise self._missing(manifest, where) from None

        if self.node_cache is not None:
            return self.node_cache.read(part.digest, part.object_bytes, download,
                                        lambda data: self._check_bytes(data, manifest, part, where))
        data = download()
        self._check_bytes(data, manifest, part, where)
        return data

    def _check_bytes(self, data: bytes, manifest: Manifest, part: Part, where: str) -> None:
        """``data`` has the manifest's size and digest, or ``CorruptObjectError``."""
        if len(data) != part.object_bytes:
            longer = len(data) > part.object_bytes
            raise CorruptObjectError(
                f"{where}: {len(data)}{'+' if longer else ''} bytes, manifest says {part.object_bytes} "
                f"({'more than it says: replaced' if longer else 'truncated or replaced'})",
                url=self.url, step=manifest.step, key=part.object, expected=part.object_bytes, found=len(data),
            )
        _check_digest(digests.compute(data, digests.algorithm_of(part.digest)), part, where, url=self.url,
                      step=manifest.step)

    def _missing(self, manifest: Manifest, where: str) -> StepNotFoundError | CorruptObjectError:
        """The error for an object that is not there: its step was collected meanwhile (no manifest either),
        or the store lost it (the manifest is still there)."""
        if not self._exists(f"{_folder(manifest)}/{MANIFEST}"):
            what = (f"step {manifest.step}" if manifest.folder is None
                    else f"catch-up {manifest.base_step}->{manifest.step}")
            return StepNotFoundError(f"{self.url}: {what} was collected (deleted by gc) while it was being read",
                                     url=self.url, step=manifest.step)
        return CorruptObjectError(f"{where}: missing, though the step is committed", url=self.url, step=manifest.step)

    def local_object_unhashed(self, manifest: Manifest) -> Path | None:
        """The path of a local single-object step's object, its size checked but not yet its digest: for a
        reader that hashes the bytes as it reads them (replay reads an anchor once), then calls
        ``check_digest``. None where the store is not local or the step has several parts."""
        if not self.is_local or manifest.is_multipart:
            return None
        part = manifest.objects[0]
        local = self.transport.local_path(self._object_key(manifest, part))
        if local is None:
            return None
        where = f"{self.url} step {manifest.step} object {part.object}"
        if not local.exists():
            raise self._missing(manifest, where)
        _check_size(local.stat().st_size, part, where, url=self.url, step=manifest.step)
        return local

    def check_digest(self, manifest: Manifest, digest: str) -> None:
        """``CorruptObjectError`` unless ``digest`` (prefixed, of a single-object step's bytes) is the manifest's."""
        part = manifest.objects[0]
        _check_digest(digest, part, f"{self.url} step {manifest.step} object {part.object}", url=self.url,
                      step=manifest.step)

    def _check_object(self, path: Path, manifest: Manifest, part: Part, where: str) -> None:
        """The object at ``path`` has the manifest's size and digest, or ``CorruptObjectError``."""
        _check_size(path.stat().st_size, part, where, url=self.url, step=manifest.step)
        _check_digest(digests.of_file(path, digests.algorithm_of(part.digest)), part, where, url=self.url,
                      step=manifest.step)


def _check_size(size: int, part: Part, where: str, *, url: str, step: int) -> None:
    if size != part.object_bytes:
        raise CorruptObjectError(f"{where}: {size} bytes, manifest says {part.object_bytes} (truncated or replaced)",
                                 url=url, step=step, key=part.object, expected=part.object_bytes, found=size)


def _check_digest(digest: str, part: Part, where: str, *, url: str, step: int) -> None:
    """``digest`` (prefixed) is the manifest's, or ``CorruptObjectError`` naming both (and the stream, the step and
    the object as attributes: errors.CONTEXT)."""
    if not digests.matches(digest, part.digest):
        raise CorruptObjectError(f"{where}: digest {digest[:23]}… differs from the manifest's {part.digest[:23]}…",
                                 url=url, step=step, key=part.object, expected=part.digest, found=digest)


_UNBOUNDED_WARNED: set[type] = set()


def _takes_max_bytes(get_file: Callable[..., None]) -> bool:
    """Whether ``get_file`` (a transport's, maybe replaced on the instance) takes ``max_bytes`` (or ``**kwargs``).
    One whose signature cannot be read is taken to be current."""
    try:
        params = inspect.signature(get_file).parameters.values()
    except (TypeError, ValueError):
        return True
    return any(p.name == "max_bytes" or p.kind is inspect.Parameter.VAR_KEYWORD for p in params)


class _watching:
    """While a download runs, report the size of its partial file every ``every_s`` to ``progress`` (any
    transport: none has to support a callback). Nothing happens without ``progress`` or for small objects."""

    def __init__(self, partial: Path, what: str, total: int, progress: ByteProgress | None, every_s: float = 0.25):
        self.partial, self.what, self.total, self.progress, self.every_s = partial, what, total, progress, every_s
        self._done = threading.Event()
        self._thread: threading.Thread | None = None

    def _size(self) -> int:
        try:
            return self.partial.stat().st_size
        except OSError:
            return 0

    def _run(self) -> None:
        assert self.progress is not None
        while not self._done.wait(self.every_s):
            self.progress(self.what, min(self._size(), self.total), self.total)

    def __enter__(self) -> _watching:
        if self.progress is not None and self.total >= PROGRESS_AFTER_BYTES:
            self.progress(self.what, 0, self.total)
            self._thread = threading.Thread(target=self._run, name="deltasync-download-progress", daemon=True)
            self._thread.start()
        return self

    def __exit__(self, kind: Any, *_: Any) -> None:
        if self._thread is None:
            return
        self._done.set()
        self._thread.join()
        assert self.progress is not None
        if kind is None:
            self.progress(self.what, self.total, self.total)
