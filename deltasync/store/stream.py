"""A step-addressed stream on any store URL (docs/FORMAT.md section 5): layout, commit, retries.

Commit protocol: the object first (under a name no other attempt uses), then the manifest, written
create-only (it is the commit marker: a committed step is never replaced), then the ``latest.json`` hint.
Before the manifest the writer proves it still holds the lease (lease.py). Readers only see steps whose
manifest exists, and check each object's size and digest before parsing it. Every document read back is
validated (``documents.py``). All bytes move through one ``Transport`` (deltasync/transports), chosen by
the URL's scheme; this module knows keys, never a backend.
"""

from __future__ import annotations

import builtins
import dataclasses
import logging
import re
import statistics
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import msgspec

from deltasync.errors import (
    CorruptObjectError,
    DeltaSyncError,
    FormatError,
    StepExistsError,
    StepNotFoundError,
    StoreError,
    StreamNotFoundError,
)
from deltasync.format.documents import (
    MAX_DOCUMENT_BYTES,
    MAX_MANIFEST_BYTES,
    CatchupManifest,
    LatestHint,
    Lease,
    Manifest,
    Part,
    StreamInfo,
    decode,
    encode,
)
from deltasync.secrets import redact, redact_url, remember, secret_values
from deltasync.signing import MAX_SIGNATURE_BYTES, SIGNATURE, StreamSigner, sha256_hex
from deltasync.store.lease import WRITER, WriterLease  # noqa: F401 - WRITER: the lease's name in the layout
from deltasync.store.location import StoreLocation, Where
from deltasync.store.node_cache import NodeCache, node_cache_from_env
from deltasync.store.objects import (  # noqa: F401 - sha256_file, step_dir: re-exported
    MANIFEST,
    ByteProgress,
    StoreObjects,
    part_of,
    sha256_file,
    step_dir,
)
from deltasync.store.retries import Retrier, check_option_types
from deltasync.store.scratch import ObjectCache, plain_name
from deltasync.transports import Transport, classify_failure, open_transport, scheme_of
from deltasync.transports.base import Entry

log = logging.getLogger(__name__)

__all__ = ["CatchupEntry", "Lease", "Manifest", "Part", "Store", "StreamInfo", "catchup_dir", "open_store",
           "step_dir"]

T = TypeVar("T")
_STEP_DIR = re.compile(r"\A(\d{12})\Z")
LATEST = "latest.json"
STREAM = "stream.json"
ObjectData = bytes | bytearray | memoryview | str | Path
"""A step's object: its bytes in memory, or a local file (``str``/``Path``) that is streamed."""
CATCHUP = "catchup"


def catchup_dir(step: int, base_step: int) -> str:
    """The folder of the catch-up delta from ``base_step`` to ``step`` (docs/FORMAT.md section 5g)."""
    return f"{CATCHUP}/{step_dir(step)[len('steps/'):]}/{step_dir(base_step)[len('steps/'):]}"


@dataclasses.dataclass(frozen=True)
class CatchupEntry:
    """A catch-up delta as a listing shows it: its two steps, whether its manifest is there (committed), the size
    of the largest object in its folder (a hint for planning: the manifest decides), and the age in seconds of
    its newest file (None: the backend reports no times)."""

    step: int
    base_step: int
    committed: bool
    object_bytes: int
    age_s: float | None


def open_store(where: Where, storage_options: dict[str, Any] | None = None, **kwargs: Any) -> tuple[Store, bool]:
    """The store ``where`` is (a ``Store`` given is used as it is), else one opened at the location
    :meth:`StoreLocation.of` resolves (``kwargs``: the ``Store``'s); and whether it was opened here (then the caller
    closes it)."""
    if isinstance(where, Store):
        StoreLocation.of(where, storage_options)  # options beside a store are refused, not ignored
        return where, False
    return Store(StoreLocation.of(where, storage_options), **kwargs), True


class Store:
    """A stream of steps under one URL: a local path or ``file://``, ``s3://``, ``hf://buckets/…``,
    ``memory://``, any fsspec URL, or a scheme a registered transport takes (deltasync.transports).

    ``storage_options`` go to the transport (credentials, endpoint, region). Remote objects are downloaded
    into ``cache_dir`` (a temporary folder by default) before they are opened; local ones are read in place.
    Transient errors are retried ``retries`` times with exponential backoff and jitter, for ``retry_max_s`` at
    most; errors that retrying cannot mend (credentials, a wrong endpoint, an unknown option) fail at once.
    ``transport`` gives an already opened transport instead of opening one for ``url``.
    """

    def __init__(
        self,
        url: str | StoreLocation,
        *,
        storage_options: dict[str, Any] | None = None,
        cache_dir: str | Path | None = None,
        node_cache: NodeCache | str | Path | None = None,
        retries: int = 4,
        retry_base_s: float = 0.2,
        retry_max_s: float = 60.0,
        transport: Transport | None = None,
    ) -> None:
        # the URL as given (a password in it too) and the options, credentials held as Secrets: one value, what an
        # engine reading the same store is sent (deltasync/store/location.py)
        self.location = where = StoreLocation.of(url, storage_options)
        self.url = where.shown  # what messages, reports and metrics show: a URL's password hidden
        self.protocol = scheme_of(where.url) or "file"
        options = dict(where.options)
        # scrubbed from every error and log line (deltasync/secrets.py): what the backend says may quote them
        self._secrets = tuple(v for v in secret_values(options) if v not in self.url)
        remember(*self._secrets, public=self.url)
        # the parts (each given what it needs, none reaching into another): the retry policy every request runs
        # through, the object reads (objects.py) and the writer lease (lease.py)
        self._retry = Retrier(self.url, self.protocol, retries=retries, retry_base_s=retry_base_s,
                              retry_max_s=retry_max_s, option_names=frozenset(options), secrets=self._secrets)
        self._transport = transport if transport is not None else self._open(where)
        self.root = redact_url(self._transport.root or where.url)
        is_local = self._transport.capabilities.local_files
        # shared with the host's other processes (node_cache.py): given, else DELTASYNC_NODE_CACHE; never for a
        # local store, whose objects are read in place
        node = NodeCache(node_cache) if isinstance(node_cache, (str, Path)) else node_cache
        node = None if is_local else node if node is not None else node_cache_from_env()
        self._objects = StoreObjects(self.url, self._transport, self._retry, is_local=is_local,
                                     cache_dir=Path(cache_dir) if cache_dir else None, node_cache=node)
        self._lease = WriterLease(self)
        self._committed_at: float | None = None  # monotonic time of this writer's last commit
        self._gaps: list[float] = []  # its last few times between commits (seconds)
        self._last_hint: LatestHint | None = None  # what this writer last wrote to latest.json (heads refresh it)

    def _open(self, where: StoreLocation) -> Transport:
        """The URL's transport (given the options' secrets revealed); a storage option the backend refuses at once,
        or one of a type it cannot take, is a ``StoreConfigError`` (naming the option, never its value)."""
        check_option_types(self.protocol, dict(where.options))
        try:
            return open_transport(where.url, where.backend_options())
        except DeltaSyncError:
            raise
        except TypeError as e:  # a backend that checks its options at once
            failure = classify_failure(e, self._retry.option_names)
            if failure is None:
                raise self._retry.settings_failed(e, "open it") from e
            raise self._retry.refusal(failure, "open it") from e
        except ValueError as e:
            raise StoreError(f"cannot open store {self.url!r}: {redact(str(e), also=self._secrets)}") from e

    def __repr__(self) -> str:
        return f"Store({self.url!r})"

    @property
    def storage_options(self) -> dict[str, Any]:
        """The backend's options, credentials held as ``Secret`` (``location.options``)."""
        return dict(self.location.options)

    # --- paths ---

    def path(self, *parts: str) -> str:
        """Where ``parts`` are, in the backend's words (a file path for a local store): for messages."""
        return "/".join([self.root.rstrip("/"), *parts])

    def close(self) -> None:
        """Delete every downloaded object and the cache folder this store made; also right after an error
        (a ``with`` block). The store stays usable: a later download starts a new cache."""
        self._objects.close()

    def __enter__(self) -> Store:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- the parts' public faces: the transport, the retry policy (retries.py), the object reads (objects.py) ---

    @property
    def transport(self) -> Transport:
        """The backend every byte moves through (deltasync/transports)."""
        return self._transport

    @transport.setter
    def transport(self, transport: Transport) -> None:
        # replaced (a counting wrapper in a benchmark, a test's): the object reads move with it; the lease reads it here
        self._transport = self._objects.transport = transport

    @property
    def is_local(self) -> bool:
        """Whether objects are read in place (a local store) rather than downloaded into the cache."""
        return self._objects.is_local

    @is_local.setter
    def is_local(self, local: bool) -> None:
        self._objects.is_local = local

    @property
    def retries(self) -> int:
        """How often a transient failure is retried (``Retrier.retries``)."""
        return self._retry.retries

    @retries.setter
    def retries(self, retries: int) -> None:
        self._retry.retries = retries

    @property
    def retry_base_s(self) -> float:
        """The first back-off delay in seconds, doubled at each retry (``Retrier.retry_base_s``)."""
        return self._retry.retry_base_s

    @retry_base_s.setter
    def retry_base_s(self, seconds: float) -> None:
        self._retry.retry_base_s = seconds

    @property
    def retry_max_s(self) -> float:
        """The longest one operation is retried for, in seconds (``Retrier.retry_max_s``)."""
        return self._retry.retry_max_s

    @retry_max_s.setter
    def retry_max_s(self, seconds: float) -> None:
        self._retry.retry_max_s = seconds

    def call(self, what: str, fn: Callable[[], T], *, landed: Callable[[], bool] | None = None) -> T:
        """Run one store operation under the store's retry policy (:meth:`Retrier.call`)."""
        return self._retry.call(what, fn, landed=landed)

    def throttle_s(self) -> float:
        """Seconds the store still asked callers to wait (:meth:`Retrier.throttle_s`); 0 when it did not."""
        return self._retry.throttle_s()

    @property
    def node_cache(self) -> NodeCache | None:
        """The host's shared object cache (node_cache.py), None for a local store or where there is none."""
        return self._objects.node_cache

    @property
    def cache_dir(self) -> Path:
        """Where remote objects are downloaded (``StoreObjects.cache_dir``)."""
        return self._objects.cache_dir

    @property
    def object_cache(self) -> ObjectCache:
        """The download cache (``StoreObjects.object_cache``)."""
        return self._objects.object_cache

    @property
    def cache_max_bytes(self) -> int:
        """At most this many bytes of downloaded objects that nobody holds open are kept (held ones always)."""
        return self._objects.cache_max_bytes

    @cache_max_bytes.setter
    def cache_max_bytes(self, max_bytes: int) -> None:
        self._objects.cache_max_bytes = max_bytes

    @property
    def download_progress(self) -> ByteProgress | None:
        """Set (by the CLI) to see large downloads advance (``StoreObjects.download_progress``)."""
        return self._objects.download_progress

    @download_progress.setter
    def download_progress(self, progress: ByteProgress | None) -> None:
        self._objects.download_progress = progress

    def fetch_object(self, manifest: Manifest, *, part: Part | None = None, hold: bool = False) -> Path:
        """A local path to the step's object, checked against the manifest's size and digest
        (:meth:`StoreObjects.fetch_object`: ``hold`` keeps it until ``release_object``)."""
        return self._objects.fetch_object(manifest, part=part, hold=hold)

    def read_object(self, manifest: Manifest, *, part: Part | None = None) -> bytes:
        """A step's object in memory, checked against the manifest's size and digest
        (:meth:`StoreObjects.read_object`)."""
        return self._objects.read_object(manifest, part=part)

    def release_object(self, manifest: Manifest, part: Part | None = None) -> None:
        """A holder of ``fetch_object(hold=True)`` is done with the object (:meth:`StoreObjects.release_object`)."""
        self._objects.release_object(manifest, part)

    def local_object_unhashed(self, manifest: Manifest) -> Path | None:
        """A local single-object step's object, its size checked but not its digest
        (:meth:`StoreObjects.local_object_unhashed`; then ``check_digest``)."""
        return self._objects.local_object_unhashed(manifest)

    def check_digest(self, manifest: Manifest, digest: str) -> None:
        """``CorruptObjectError`` unless ``digest`` (prefixed) is the single-object step's
        (:meth:`StoreObjects.check_digest`)."""
        self._objects.check_digest(manifest, digest)

    # --- objects by key (relative to the stream's URL) ---

    def read_bytes(self, rel: str, *, max_bytes: int | None = None) -> bytes:
        """An object's bytes; with ``max_bytes``, at most ``max_bytes + 1`` are fetched (a ranged read), so
        that an oversized object from a hostile store costs no more than that."""
        end = None if max_bytes is None else max_bytes + 1
        return self.call(f"read {rel}", lambda: self.transport.get(rel, end=end))

    def read_range(self, rel: str, start: int, end: int) -> bytes:
        """Bytes ``[start, end)`` of an object (fewer where it ends sooner)."""
        return self.call(f"read {rel} bytes {start}..{end}", lambda: self.transport.get(rel, start=start, end=end))

    def write_bytes(self, rel: str, data: bytes | bytearray | memoryview, *, if_absent: bool = False) -> None:
        """Write a whole object so that readers see either the old or the new content.

        ``if_absent``: never replace an existing object (``FileExistsError``; atomic where the backend
        allows, ``transport.capabilities.create_only``).
        """
        self.call(f"write {rel}", lambda: self.transport.put(rel, data, if_absent=if_absent),
                  landed=(lambda: self._holds(rel, data)) if if_absent else None)

    def _holds(self, rel: str, data: bytes | bytearray | memoryview) -> bool:
        """Whether the object at ``rel`` is exactly ``data`` (a create-only write whose reply was lost landed)."""
        want = memoryview(data).cast("B")
        try:
            return self.transport.get(rel, end=want.nbytes + 1) == want
        except FileNotFoundError:
            return False

    def write_many(self, items: list[tuple[bytes, str]]) -> None:
        """Write small objects in order (the order is what makes a commit)."""
        for data, rel in items:
            self.write_bytes(rel, data)

    def read_document(self, rel: str, kind: type[T]) -> T:
        """Read and validate one stored document (``FileNotFoundError`` if absent, ``FormatError`` if invalid)."""
        return decode(self.read_bytes(rel, max_bytes=MAX_DOCUMENT_BYTES), kind, where=f"{self.url}/{rel}")

    def exists(self, rel: str) -> bool:
        """Whether ``rel`` is an object or a folder holding one."""
        return self.call(f"check {rel}", lambda: self.transport.exists(rel))

    def list(self, prefix: str = "") -> list[Entry]:
        """Every object under the folder ``prefix`` (keys relative to the stream), [] where there is none."""
        try:
            return self.call(f"list {prefix or 'the stream'}", lambda: self.transport.list(prefix))
        except FileNotFoundError:
            return []

    def delete(self, rel: str, *, recursive: bool = False) -> None:
        """Delete an object (with ``recursive``, everything under the folder ``rel``); absent is fine."""
        if recursive:
            self.call(f"delete {rel}", lambda: self.transport.delete_tree(rel))
        else:
            self.call(f"delete {rel}", lambda: self.transport.delete(rel))

    # --- steps ---

    def step_folders(self) -> builtins.list[int]:
        """Every step folder holding any object, committed or not (empty folders do not count)."""
        out = set()
        for e in self.list("steps"):
            m = _STEP_DIR.match(e.key.split("/")[1]) if e.key.count("/") >= 2 else None
            if m:
                out.add(int(m.group(1)))
        return sorted(out)

    def steps(self) -> builtins.list[int]:
        """Committed steps (those with a manifest), ascending."""
        out = []
        for e in self.list("steps"):
            parts = e.key.split("/")
            m = _STEP_DIR.match(parts[1]) if len(parts) == 3 and parts[2] == MANIFEST else None
            if m:
                out.append(int(m.group(1)))
        return sorted(out)

    def latest_hint(self) -> LatestHint | None:
        """``latest.json`` as written after the newest commit (one small read); None where there is none or it
        is damaged (logged): a hint, readers trust manifests."""
        try:
            return self.read_document(LATEST, LatestHint)
        except FileNotFoundError:
            return None
        except FormatError as e:
            log.warning("%s: ignoring the latest hint: %s", self.url, str(e))
            return None

    def latest_step(self) -> int | None:
        """The newest committed step, or None for an empty stream: from a listing of the manifests (one LIST
        request per 1,000 steps), whatever ``latest.json`` says.

        The hint cannot decide it: step numbers may have gaps (every 10th step published, or coalesced
        steps), so a writer that died between step 20's manifest and the hint leaves a hint of 10 with no
        step 11, which a probe of "the next step" takes for the newest for ever. Followers poll with
        :class:`deltasync.follow.watch.StepWatch` instead: one read of the hint per poll, checked by its manifest,
        and a listing every ``audit_s`` that catches such a stale hint.
        """
        steps = self.steps()
        return steps[-1] if steps else None

    def manifest(self, step: int, *, nearby: bool = True) -> Manifest:
        """Step ``step``'s manifest (one read). ``StepNotFoundError`` if it is not committed, naming the nearest
        committed steps (a listing) unless ``nearby`` is False (a caller that probes step numbers)."""
        return self.manifest_and_digest(step, nearby=nearby)[0]

    def manifest_and_digest(self, step: int, *, nearby: bool = True) -> tuple[Manifest, str]:
        """``manifest(step)`` and the SHA-256 of its bytes as stored (what a step's signature covers)."""
        m, digest, _ = self.manifest_record(step, nearby=nearby)
        return m, digest

    def manifest_record(self, step: int, *, nearby: bool = False) -> tuple[Manifest, str, bytes]:
        """Step ``step``'s manifest, the SHA-256 of its bytes as stored, and those bytes (a mirror copies them)."""
        rel = f"{step_dir(step)}/{MANIFEST}"
        try:
            raw = self.read_bytes(rel, max_bytes=MAX_MANIFEST_BYTES)
        except FileNotFoundError:
            near = self._nearby(step) if nearby else ""
            raise StepNotFoundError(f"{self.url}: step {step} is not committed{near}", url=self.url,
                                    step=step) from None
        m = decode(raw, Manifest, where=f"{self.url}/{rel}", max_bytes=MAX_MANIFEST_BYTES)
        if m.step != step:
            raise FormatError(f"{self.url}: manifest in folder of step {step} describes step {m.step}")
        return m, sha256_hex(raw), raw

    def _nearby(self, step: int) -> str:
        steps = self.steps()
        if not steps:
            return " (the stream has no committed steps)"
        below = [s for s in steps if s < step]
        above = [s for s in steps if s > step]
        near = ", ".join(str(s) for s in ([below[-1]] if below else []) + ([above[0]] if above else []))
        return f" (nearest committed: {near}; stream holds {steps[0]}..{steps[-1]})"

    def put_object(self, manifest: Manifest, data: ObjectData, *, part: Part | None = None) -> None:
        """Upload a step's object (not a commit: ``commit`` writes the manifest after it).

        ``data``: the object's bytes (``bytes``, ``memoryview``, ...), or a local file (``str``/``Path``),
        streamed, and consumed on a local store (moved into place). Its size must be the manifest's.
        """
        self.put_part(manifest.step, part_of(manifest, part), data)

    def put_part(self, step: int, part: Part, data: ObjectData) -> None:
        """Upload one object of ``step`` before its manifest exists (a rank's part of a multi-part step)."""
        source = Path(data) if isinstance(data, (str, Path)) else data
        size = source.stat().st_size if isinstance(source, Path) else memoryview(source).nbytes
        if size != part.object_bytes:
            raise CorruptObjectError(
                f"{self.url} step {step}: the object to upload has {size} bytes, its manifest says {part.object_bytes}",
                url=self.url, step=step, key=part.object, expected=part.object_bytes, found=size,
            )
        rel = f"{step_dir(step)}/{plain_name(part.object, where=f'{self.url} step {step}')}"
        self.call(f"upload {rel}", lambda: self.transport.put(rel, source))

    def commit(self, manifest: Manifest, data: ObjectData | None, *, owner: str | None = None,
               signer: StreamSigner | None = None, signature: bytes | None = None,
               manifest_bytes: bytes | None = None, head: bytes | None = None) -> None:
        """Publish one step: object, then signature, then manifest (the commit, create-only), then the latest hint.

        ``signer`` signs the step (``signature.json``, docs/FORMAT.md section 5e) before the manifest makes it
        visible, and the head in ``latest.json``; ``signature`` is a signature made elsewhere (a mirror copying a
        signed step), with ``manifest_bytes`` the manifest exactly as the signature covers it and ``head`` the
        source's head envelope (relayed only if it names this step or an earlier one).

        With ``owner``, the writer's lease is checked right before the manifest is written (and renewed if it
        ran out meanwhile): a writer that lost the stream commits nothing (``WriterConflictError``). A step
        that is already committed is never replaced (``StepExistsError``), whoever committed it.
        ``data`` is the object's bytes or a local file (``put_object``; a file may be consumed); None for a
        multi-part step, whose parts their writers uploaded already (``put_part``).
        """
        manifest_rel = f"{step_dir(manifest.step)}/{MANIFEST}"
        if self.exists(manifest_rel):  # saves an upload; the create-only write below is what guarantees it
            raise StepExistsError(f"{self.url}: step {manifest.step} is already committed; a committed step is never "
                                  "replaced", url=self.url, step=manifest.step)
        if data is not None:
            self.put_object(manifest, data)
        elif not manifest.is_multipart:
            raise ValueError(f"{self.url} step {manifest.step}: a single-object step is committed with its object")
        body = manifest_bytes if manifest_bytes is not None else manifest.to_json().encode()
        if signer is not None:
            signature = signer.sign_step(manifest, body)
        if signature is not None:  # before the commit: a committed step of a signed stream is signed
            self.write_bytes(f"{step_dir(manifest.step)}/{SIGNATURE}", signature)
        if owner is not None:
            self.hold_lease(owner)
        try:
            self.write_bytes(manifest_rel, body, if_absent=True)
        except FileExistsError:
            raise StepExistsError(
                f"{self.url}: step {manifest.step} was committed by another writer meanwhile; a committed step is "
                "never replaced", url=self.url, step=manifest.step,
            ) from None
        hint = self._hint(manifest.step)
        if signer is not None:
            hint = dataclasses.replace(hint, head=msgspec.Raw(signer.sign_head(manifest.step)))
        elif head is not None:
            hint = dataclasses.replace(hint, head=msgspec.Raw(head))
        self._last_hint = hint
        self.write_bytes(LATEST, encode(hint))

    def refresh_head(self, signer: StreamSigner, *, closed: bool = False) -> bool:
        """Sign the head again for the step this writer committed last (docs/FORMAT.md section 5e: a publisher
        does it every third of its lease while it runs, and with ``closed`` when it closes), keeping the rest of
        ``latest.json`` as this writer wrote it. Returns False (writing nothing) when it committed nothing."""
        hint = self._last_hint
        if hint is None:
            return False
        hint = dataclasses.replace(hint, head=msgspec.Raw(signer.sign_head(hint.step, closed=closed)))
        self._last_hint = hint
        self.write_bytes(LATEST, encode(hint))
        return True

    def resume_head(self, step: int, signer: StreamSigner | None) -> None:
        """A writer resuming after ``step`` (its newest trusted step) keeps ``latest.json``'s times for it, and signs
        its head at the next refresh."""
        hint = self.latest_hint()
        self._last_hint = LatestHint(step=step, committed_unix_s=hint.committed_unix_s if hint and hint.step == step
                                     else None, interval_s=hint.interval_s if hint and hint.step == step else None)
        if signer is None:
            self._last_hint = None

    def relay_head(self, head: bytes, step: int) -> None:
        """Write ``latest.json`` for ``step`` carrying ``head`` (a mirror: the source's head, for steps it holds)."""
        hint = self.latest_hint()
        base = hint if hint is not None and hint.step == step else LatestHint(step=step)
        self.write_bytes(LATEST, encode(dataclasses.replace(base, head=msgspec.Raw(head))))

    def _hint(self, step: int) -> LatestHint:
        """``latest.json`` for a commit now, with this writer's time between commits: the median of its last
        five gaps, which followers time their polls by (docs/FORMAT.md section 5c); a median, so that one
        pause of the trainer (an evaluation, a restart) does not move it."""
        now = time.monotonic()
        if self._committed_at is not None:
            self._gaps = [*self._gaps[-4:], now - self._committed_at]
        self._committed_at = now
        interval = round(min(statistics.median(self._gaps), 1e6), 3) if self._gaps else None
        return LatestHint(step=step, committed_unix_s=round(time.time(), 3), interval_s=interval)

    # --- catch-up deltas (docs/FORMAT.md section 5g) ---

    def catchup_entries(self) -> builtins.list[CatchupEntry]:
        """Every catch-up folder from one listing of ``catchup/`` (committed or not), by (step, base_step)."""
        found: dict[tuple[int, int], list[Any]] = {}  # -> [committed, biggest object, newest mtime]
        for e in self.list(CATCHUP):
            parts = e.key.split("/")
            if len(parts) != 4:
                continue
            b, a = _STEP_DIR.match(parts[1]), _STEP_DIR.match(parts[2])
            if not (b and a) or int(a.group(1)) >= int(b.group(1)):
                continue
            rec = found.setdefault((int(b.group(1)), int(a.group(1))), [False, 0, None])
            if parts[3] == MANIFEST:
                rec[0] = True
            elif parts[3].endswith(".safetensors"):
                rec[1] = max(rec[1], e.size)
            if e.mtime_unix_s is not None:
                rec[2] = e.mtime_unix_s if rec[2] is None else max(rec[2], e.mtime_unix_s)
        now = time.time()
        return [CatchupEntry(step, base, rec[0], rec[1], None if rec[2] is None else max(0.0, now - rec[2]))
                for (step, base), rec in sorted(found.items())]

    def catchup_record(self, step: int, base_step: int) -> tuple[CatchupManifest, str, bytes]:
        """The catch-up from ``base_step`` to ``step``: its manifest, the SHA-256 of the manifest's bytes as stored,
        and those bytes. ``StepNotFoundError`` where it is not committed; ``FormatError`` where the manifest is not
        a valid one for its folder."""
        rel = f"{catchup_dir(step, base_step)}/{MANIFEST}"
        try:
            raw = self.read_bytes(rel, max_bytes=MAX_DOCUMENT_BYTES)
        except FileNotFoundError:
            raise StepNotFoundError(f"{self.url}: no catch-up from step {base_step} to step {step} is "
                                    "committed") from None
        m = decode(raw, CatchupManifest, where=f"{self.url}/{rel}")
        if (m.step, m.base_step) != (step, base_step):
            raise FormatError(f"{self.url}/{rel}: describes the catch-up from step {m.base_step} to step {m.step}, "
                              f"its folder the one from step {base_step} to step {step}")
        return m, sha256_hex(raw), raw

    def catchup_signature(self, step: int, base_step: int) -> bytes | None:
        """The catch-up's ``signature.json`` as stored (bounded), or None where it has none."""
        rel = f"{catchup_dir(step, base_step)}/{SIGNATURE}"
        try:
            raw = self.read_bytes(rel, max_bytes=MAX_SIGNATURE_BYTES)
        except FileNotFoundError:
            return None
        if len(raw) > MAX_SIGNATURE_BYTES:
            raise FormatError(f"{self.url}/{rel}: over {MAX_SIGNATURE_BYTES} bytes")
        return raw

    def commit_catchup(self, manifest: CatchupManifest, data: ObjectData, *,
                       signer: StreamSigner | None = None) -> None:
        """Publish one catch-up delta: object, then signature, then manifest (create-only: the commit marker).
        ``StepExistsError`` where that catch-up is committed already (a committed one is never replaced)."""
        folder = catchup_dir(manifest.step, manifest.base_step)
        source = Path(data) if isinstance(data, (str, Path)) else data
        size = source.stat().st_size if isinstance(source, Path) else memoryview(source).nbytes
        if size != manifest.object_bytes:
            raise CorruptObjectError(f"{self.url} {folder}: the object to upload has {size} bytes, its manifest says "
                                     f"{manifest.object_bytes}")
        rel = f"{folder}/{plain_name(manifest.object, where=f'{self.url} {folder}')}"
        self.call(f"upload {rel}", lambda: self.transport.put(rel, source))
        body = encode(manifest)
        if signer is not None:  # before the commit: a committed catch-up of a signed stream is signed
            self.write_bytes(f"{folder}/{SIGNATURE}", signer.sign_catchup(manifest, body))
        try:
            self.write_bytes(f"{folder}/{MANIFEST}", body, if_absent=True)
        except FileExistsError:
            raise StepExistsError(f"{self.url}: the catch-up from step {manifest.base_step} to step {manifest.step} is "
                                  "already committed; a committed one is never replaced") from None

    def delete_catchup(self, step: int, base_step: int) -> None:
        """Delete a catch-up: its manifest first (readers stop seeing it), then its folder."""
        folder = catchup_dir(step, base_step)
        self.delete(f"{folder}/{MANIFEST}")
        self.delete(folder, recursive=True)

    # --- the stream itself ---

    def stream_id(self) -> str | None:
        """``stream.json``'s ``stream_id`` (None: a stream made before streams had one), read once."""
        if "_stream_id" not in self.__dict__:
            info = self.stream_info()
            self._stream_id = info.stream_id if info is not None else None
        return self._stream_id

    def signature(self, step: int) -> bytes | None:
        """Step ``step``'s ``signature.json`` as stored (bounded), or None where it has none."""
        try:
            raw = self.read_bytes(f"{step_dir(step)}/{SIGNATURE}", max_bytes=MAX_SIGNATURE_BYTES)
        except FileNotFoundError:
            return None
        if len(raw) > MAX_SIGNATURE_BYTES:
            raise FormatError(f"{self.url}: step {step}'s {SIGNATURE} is over {MAX_SIGNATURE_BYTES} bytes")
        return raw

    def files_sha256(self) -> str | None:
        """The SHA-256 of ``files.json`` as stored (what a step's signature names), or None where there is none."""
        try:
            return sha256_hex(self.read_bytes("files.json", max_bytes=MAX_DOCUMENT_BYTES))
        except FileNotFoundError:
            return None

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
            names = self.call("list the location", lambda: self.transport.children(""))
            more = f" and {len(names) - 5} more" if len(names) > 5 else ""
            there = f"it holds {', '.join(names[:5])}{more}" if names else "it is empty"
        except FileNotFoundError:
            there = "the location does not exist"
        raise StreamNotFoundError(
            f"no deltasync stream at {self.url} (no {STREAM} and no steps/ folder; {there}); check the bucket, prefix "
            "or path", url=self.url,
        )

    def create_stream(self, like: StreamInfo | None = None) -> StreamInfo:
        """Write ``stream.json`` if the stream has none yet (create-only); returns the stream's. ``like``: a
        copy's (a mirror's) stream takes its source's, whose id the source's signed steps name."""
        info = self.stream_info()
        if info is None:
            info = like or StreamInfo(created_unix_s=time.time(), stream_id=uuid.uuid4().hex)
            try:
                self.write_bytes(STREAM, encode(info), if_absent=True)
            except FileExistsError:  # created by another process meanwhile
                info = self.stream_info() or info
        return info

    # --- the writer lease (one publisher per stream): lease.py ---

    def lease(self) -> Lease | None:
        """The stream's lease as stored now, or None."""
        return self._lease.current()

    def acquire_lease(self, owner: str, *, ttl_s: float, take_over: bool = False,
                      stream_id: str | None = None) -> Lease:
        """Become the stream's only writer, or raise ``WriterConflictError`` naming the holder.

        The lease is written with a compare-and-swap on what was read (atomic where the transport's
        capabilities say so): of two writers racing for a stream, one wins. Also creates the stream
        (``stream.json``, with ``stream_id`` when given, else a random id) if needed.
        """
        lease = self._lease.acquire(owner, ttl_s=ttl_s, take_over=take_over)
        self.create_stream(None if stream_id is None else StreamInfo(created_unix_s=time.time(), stream_id=stream_id))
        return lease

    def renew_lease(self, owner: str, *, ttl_s: float) -> Lease:
        """Extend ``owner``'s lease (compare-and-swap: fails if anybody else wrote it meanwhile)."""
        return self._lease.renew(owner, ttl_s=ttl_s)

    def check_lease(self, owner: str) -> None:
        """Raise ``WriterConflictError`` unless ``owner`` holds the stream (one read)."""
        self._lease.check(owner)

    def hold_lease(self, owner: str) -> None:
        """Prove that ``owner`` holds the stream now, renewing a lease that ran low (``WriterLease.hold``)."""
        self._lease.hold(owner)

    def release_lease(self, owner: str) -> None:
        """Give the stream up (the lease is deleted if ``owner`` still holds it)."""
        self._lease.release(owner)

    def remove_uncommitted(
        self, *, newer_than: int | None = None, older_than_s: float | None = None
    ) -> builtins.list[int]:
        """Delete what no committed step names: step folders without a manifest (a writer died before its
        commit), and files in committed folders other than the manifest, its objects (an anchor's own delta
        included) and its signature (a writer killed mid-way that a later writer overtook). Returns the steps whose
        folders were removed.

        ``older_than_s``: only files at least that old (a writer that just lost the stream may still be
        finishing an upload there; its late manifest must not point at nothing).
        """
        folders: dict[int, dict[str, float]] = {}  # step -> {file name: age in seconds}
        now = time.time()
        for entry in self.list("steps"):
            rest = entry.key[len("steps/"):]
            m = _STEP_DIR.match(rest.split("/", 1)[0])
            if m and "/" in rest:
                # a backend that reports no time: "now", so that the file counts as young (never deleted on a guess)
                written = entry.mtime_unix_s if entry.mtime_unix_s is not None else now
                folders.setdefault(int(m.group(1)), {})[rest.split("/", 1)[1]] = now - written
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
                    keep = {MANIFEST, SIGNATURE, *(p.object for p in self.manifest(s).stored_objects)}
                except (StepNotFoundError, FormatError):
                    continue  # collected meanwhile, or for verify to report
                for name in files.keys() - keep:
                    self.delete(f"{step_dir(s)}/{name}")
                    log.info("%s: removed %s from step %d (no manifest names it)", self.url, name, s)
        if removed:
            log.info("%s: removed uncommitted step folders %s", self.url, removed)
        return removed

