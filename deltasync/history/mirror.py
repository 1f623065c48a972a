"""Replicate a stream from one store to another (the trainer's bucket in one cloud to a bucket or disk in
another), so that a region's followers read their own copy and egress is paid once per region.

Every object is checked against its manifest's size and digest as it is read from the source; each step is
written the way a publisher writes one: objects first, then the manifest, create-only, then the hint; steps go
in the source's commit order. So a mirror killed at any point leaves nothing half-visible (an uncommitted step
folder at most, which the next run or ``gc`` replaces), a restarted one goes on where the destination stands,
and several mirrors of one pair commit each step once: a step another mirror committed first is compared with
the source's manifest and, if equal, counted as present (a different one is an error: two streams under one
name). Model files (``files/``, ``files.json``) and ``stream.json`` are copied too, manifests and ``files.json``
byte for byte (a signature covers them as stored), and the source's signed head goes with the steps it names
(docs/FORMAT.md section 5e). With trusted keys a mirror copies only what a trusted signature covers: an
unsigned or forged step does not exist for it (skipped, logged, reported in ``refused``), and model files are
copied only while ``files.json`` is the one the newest step copied names. The destination keeps its own
retention (``deltasync gc`` there, which respects its own consumers' heartbeats).

    report = mirror("s3://trainer/run-7", "gs://region-b/run-7")           # what is committed now
    mirror_follow(src, dst, until=1000)                                     # and what comes, as it comes
"""

from __future__ import annotations

import json
import logging
import shutil
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from deltasync.errors import StepExistsError, StepNotFoundError, can_retry
from deltasync.follow.reader import StreamReader
from deltasync.follow.watch import FollowLoop, PollPolicy, StepWatch
from deltasync.format.documents import LatestHint
from deltasync.notify import EventServer, Notifier
from deltasync.signing import sha256_hex
from deltasync.store import Manifest, Part, Store, open_store
from deltasync.store.location import StoreLocation, Where
from deltasync.store.model_files import FILES_DIR, FILES_INDEX, read_model_file_index, read_model_files
from deltasync.store.scratch import ScratchFolder
from deltasync.trust import UNTRUSTED, TrustedKeys

log = logging.getLogger(__name__)

__all__ = ["MirrorReport", "mirror", "mirror_follow"]

@dataclass(frozen=True, kw_only=True)
class MirrorReport:
    """What one pass copied: steps committed at the destination, steps it held already, object bytes moved."""

    copied: tuple[int, ...]
    present: int
    bytes_copied: int
    files_copied: bool
    seconds: float
    refused: tuple[int, ...] = ()  # with trusted keys: steps no trusted signature covers (not copied)


def mirror(src: Where, dst: Where, *, src_options: dict[str, Any] | None = None,
           dst_options: dict[str, Any] | None = None, after: int | None = None, newest: int | None = None,
           on_step: Callable[[int, int], None] | None = None, trusted_keys: Any = None,
           reader: StreamReader | None = None, hint: LatestHint | None = None) -> MirrorReport:
    """Copy every committed step of ``src`` that ``dst`` lacks (those after ``after`` only, if given), in order.

    Args:
        src, dst: stream URLs (or ``Store``s); ``src_options``/``dst_options``: their storage options.
        after: skip the source's steps up to and including this one (a follower of the source knows them copied).
        newest: with ``after``, the source's newest step as its hint says: a few steps past ``after`` are then
            looked up by their manifests (one read each, which copying needs anyway), not by listing the source,
            and the stream and model files are not checked again.
        on_step: called with (step, object bytes) after each step is committed at the destination.
        trusted_keys: a ``TrustedKeys`` (keys and the stream they sign for): only steps one of them signed are
            copied (the others are skipped and reported in ``refused``), and model files only as the newest
            step copied names them. Either way a step's signature is copied with it (before its manifest), and
            the copy keeps the source's stream id, so the copy's followers check the same signatures.
        reader: a reader of ``src`` whose last manifests and signatures (as stored) to use (a follower's: the step
            it just saw is not read again).
        hint: the source's ``latest.json`` as the caller just read it (its head goes with the steps it names);
            None: read here.

    Raises ``StreamNotFoundError`` (no stream at ``src``), ``CorruptObjectError`` (a source object that does not
    match its manifest: nothing of that step is committed), ``StepExistsError`` (the destination holds a
    different step under the same number), store errors. A failure leaves every step before it committed.
    With trusted keys, a step that breaks the chain of trust (a retired key's, a forgery) is never an error:
    it does not exist for the mirror.

    Example: ``mirror("s3://trainer/run-7", "/mnt/region-b/run-7").copied``
    """
    t0 = time.perf_counter()
    source, own_src = open_store(src, src_options)
    target, own_dst = open_store(dst, dst_options)
    trusted = None if trusted_keys is None else TrustedKeys.load(trusted_keys)
    scratch = ScratchFolder("mirror")
    copied: list[int] = []
    refused: list[int] = []
    nbytes = 0
    files = False
    try:
        incremental = after is not None and newest is not None and 0 < newest - after <= 16
        if incremental:  # following: the next few step numbers, by their manifests (a gap in numbering costs one read)
            assert after is not None and newest is not None
            steps, held = list(range(after + 1, newest + 1)), set()
        else:
            source.require_stream()
            _same_stream(source, target.create_stream(like=source.stream_info()), target)
            if trusted is None:
                files = _copy_files(source, target, False)
            steps = [s for s in source.steps() if after is None or s > after]
            held = set(target.steps())
            common = sorted(held.intersection(steps))
            if after is None and common:  # one comparison per pass: the same stream, not another under its name
                _same_step(source, target, common[-1])
        head = _source_head(source, trusted, hint)
        present = sum(1 for s in steps if s in held)
        vouched: str | None | bool = False  # the files.json digest the newest trusted step copied (or held) names
        for step in steps:
            if step in held:
                if trusted is not None:
                    vouched = _vouched(source, trusted, step, vouched)
                continue
            try:
                size, signed = _copy_step(source, target, step, scratch, trusted, head=head,
                                          record=reader.record if reader is not None else None)
            except StepNotFoundError:
                if not incremental and step in source.steps():
                    raise
                log.debug("%s: no step %d (not committed, or collected before it was copied)", source.url, step)
                continue
            except UNTRUSTED as e:
                if trusted is None:
                    raise
                refused.append(step)
                log.warning("%s: step %d is not copied: %s: %s", source.url, step, type(e).__name__, e)
                continue
            if signed is not None:
                vouched = signed
            if size is None:
                present += 1  # another mirror committed the same step first
                continue
            copied.append(step)
            nbytes += size
            if on_step is not None:
                on_step(step, size)
        if trusted is not None and not incremental and vouched is not False:
            files = _copy_files(source, target, vouched)
        if head is not None:
            done = target.steps()
            if done and head[1] <= done[-1]:
                target.relay_head(head[0], done[-1])
    finally:
        scratch.remove()
        if own_src:
            source.close()
        if own_dst:
            target.close()
    return MirrorReport(copied=tuple(copied), present=present, bytes_copied=nbytes, files_copied=files,
                        seconds=round(time.perf_counter() - t0, 3), refused=tuple(refused))


def _source_head(source: Store, trusted: TrustedKeys | None, hint: LatestHint | None) -> tuple[bytes, int] | None:
    """The source's head envelope and the step it names (verified with trusted keys; else the mirror relays what
    it read and the followers of the copy verify it), or None."""
    hint = hint if hint is not None else source.latest_hint()
    raw = None if hint is None else hint.head_bytes
    step = None if raw is None else _head_step(raw, trusted, source.url)
    return None if raw is None or step is None else (raw, step)


def _head_step(raw: bytes, trusted: TrustedKeys | None, where: str) -> int | None:
    """The step a head envelope names: verified with trusted keys; else as it reads (the mirror relays it, the
    copy's followers verify it)."""
    if trusted is not None:
        try:
            return trusted.check_head(raw, where=where).step
        except UNTRUSTED as e:
            log.warning("%s: not relaying its head: %s: %s", where, type(e).__name__, e)
            return None
    try:
        step = json.loads(json.loads(raw)["statement"])["step"]
    except (ValueError, KeyError, TypeError):
        return None
    return step if isinstance(step, int) and not isinstance(step, bool) else None


def _vouched(source: Store, trusted: TrustedKeys, step: int, current: str | None | bool) -> str | None | bool:
    """The files digest step ``step`` (held at the destination already) names, if its signature proves it."""
    try:
        m, digest = source.manifest_and_digest(step, nearby=False)
        return trusted.check(source.signature(step), m, manifest_sha256=digest, where=source.url).files_sha256
    except (*UNTRUSTED, StepNotFoundError):
        return current


def _copy_files(source: Store, target: Store, vouched: str | None | bool) -> bool:
    """The model files, each checked against the source's index, and the index byte for byte; written only where
    the destination differs. ``vouched``: with trusted keys, the ``files.json`` digest a trusted step names (None:
    none; then no file is copied); False: copied unchecked."""
    if read_model_file_index(source) is None:
        return False
    try:
        files = read_model_files(source, files_sha256=vouched, where="the newest step copied")
    except UNTRUSTED as e:
        log.warning("%s: model files not copied: %s", source.url, e)
        return False
    raw = source.read_bytes(FILES_INDEX, max_bytes=1 << 20)
    if vouched not in (False, None) and sha256_hex(raw) != vouched:
        log.warning("%s: model files not copied: files.json changed while it was read", source.url)
        return False
    if target.files_sha256() == sha256_hex(raw):
        return False
    target.write_many([(data, f"{FILES_DIR}/{name}") for name, data in files.items()])
    target.write_bytes(FILES_INDEX, raw)
    log.info("%s: stored model files %s", target.url, sorted(files))
    return True


def _same_stream(source: Store, info: Any, target: Store) -> None:
    """``StepExistsError`` when the destination is another stream (its id differs from the source's)."""
    theirs = source.stream_id()
    if theirs is not None and info.stream_id is not None and info.stream_id != theirs:
        raise StepExistsError(f"{target.url} holds another stream (id {info.stream_id}) than {source.url} (id "
                              f"{theirs}): "
                              "two different streams under one name (mirror into an empty location, or an earlier "
                              "copy of this stream)")


def _copy_step(source: Store, target: Store, step: int, scratch: ScratchFolder, trusted: TrustedKeys | None, *,
               head: tuple[bytes, int] | None,
               record: Callable[[int], tuple[Manifest, str, bytes, bytes | None]] | None = None,
               ) -> tuple[int | None, str | None | bool]:
    """Commit ``step`` at the destination: its objects (checked against the manifest), its signature, then the
    manifest (byte for byte), then ``latest.json`` with ``head`` where it names this step or an earlier one.
    Returns the bytes copied (None when the destination already holds exactly this step) and, with trusted keys,
    the files digest the step's signature names (False without)."""
    if record is not None:
        m, digest, raw, signature = record(step)
    else:
        m, digest, raw = source.manifest_record(step)
        signature = source.signature(step)
    files: str | None | bool = False
    if trusted is not None:
        files = trusted.check(signature, m, manifest_sha256=digest, where=source.url).files_sha256
    objects = [(m, part) for part in m.objects]
    if m.delta is not None:  # an anchor's own delta: a second object of the step (docs/FORMAT.md section 5)
        own = m.as_delta()
        objects.append((own, own.objects[0]))
    held: list[tuple[Manifest, Part]] = []
    local: list[tuple[Part, Path]] = []
    made: list[Path] = []
    try:
        for owner, part in objects:
            path = source.fetch_object(owner, part=part, hold=True)  # checked: size and digest
            held.append((owner, part))
            if target.is_local:  # a local destination takes files over (moves them): hand it a copy of its own
                made.append(scratch.path / f"{step}-{part.object}")
                shutil.copyfile(path, made[-1])
                path = made[-1]
            local.append((part, path))
        # every object before the manifest: the step's parts, or the anchor's own delta beside its object
        for part, path in local if m.is_multipart else local[1:]:
            target.put_part(step, part, path)
        target.commit(m, None if m.is_multipart else local[0][1], signature=signature, manifest_bytes=raw,
                      head=head[0] if head is not None and head[1] <= step else None)
    except StepExistsError:
        _same_step(source, target, step, m)
        return None, files
    finally:
        for owner, part in held:
            source.release_object(owner, part)
        for path in made:
            path.unlink(missing_ok=True)
    return sum(part.object_bytes for part, _ in local), files


def _same_step(source: Store, target: Store, step: int, manifest: Any = None) -> None:
    """``StepExistsError`` unless the destination's step ``step`` is the source's (same manifest)."""
    ours = manifest if manifest is not None else source.manifest(step)
    if target.manifest(step).to_json() != ours.to_json():
        raise StepExistsError(
            f"{target.url}: step {step} is committed there with another manifest than at {source.url}: two "
            "different streams under one name (mirror into an empty location, or an earlier copy of this stream)")


def mirror_follow(src: Where, dst: Where, *, src_options: dict[str, Any] | None = None,
                  dst_options: dict[str, Any] | None = None, policy: PollPolicy | None = None,
                  until: int | None = None, stop: threading.Event | None = None,
                  on_step: Callable[[int, int], None] | None = None,
                  on_error: Callable[[BaseException], None] | None = None,
                  notifier: Notifier | None = None, events: EventServer | None = None,
                  trusted_keys: Any = None) -> int | None:
    """Keep ``dst`` a copy of ``src``: copy what is committed, then each new step as the source commits it,
    polling the source with one small read per poll (the follow loop, :class:`~deltasync.follow.watch.FollowLoop`).
    Returns the newest step copied once ``until`` is copied or ``stop`` is set. Transient failures are retried
    with the watch's back-off (``policy``, by default ``PollPolicy(retry_max_s=60)``; ``on_error`` hears each, a
    damaged source object too: a committed step is never rewritten, but a truncated download reads whole next
    time); those retrying cannot help (``can_retry``: credentials, settings, another stream under the
    destination's name) are raised.

    ``notifier`` pushes the source's new steps (an upstream mirror's ``EventFeed``): polls slow to a safety
    net. ``events`` (an :class:`~deltasync.notify.EventServer`) is told of every step committed at the
    destination, so the region's followers hear of it at once instead of polling (deltasync/notify.py)."""
    stop = stop or threading.Event()
    trusted = None if trusted_keys is None else TrustedKeys.load(trusted_keys)  # one set: endorsements seen persist
    # the watch's reader checks with the same trust: a forged newest step does not exist for the mirror either
    reader = StreamReader(StoreLocation.of(src, src_options), trusted_keys=trusted)
    watch = StepWatch(reader, policy or PollPolicy(retry_max_s=60.0), notifier=notifier)
    target = Store(StoreLocation.of(dst, dst_options))
    done: int | None = None
    relayed: bytes | None = None  # the source's head last relayed (refreshed heads follow while it is idle)

    def copied(step: int, nbytes: int) -> None:
        if events is not None:
            events.announce(step)
        if on_step is not None:
            on_step(step, nbytes)

    def act(newest: int | None) -> None:
        nonlocal done, relayed
        if newest is not None and (done is None or newest > done):
            mirror(reader.store, target, after=done, newest=newest, on_step=copied, trusted_keys=trusted,
                   reader=reader, hint=watch.last_hint)  # the step the watch just saw is not read again
            done = newest
            if events is not None:
                events.announce(done)  # steps the destination held already count too
        relayed = _relay_refreshed(watch, target, trusted, done, relayed)

    def failed(e: Exception) -> None:
        # the source or the destination may come back; what retrying cannot help (credentials, settings, two
        # different streams under one name) is raised by the loop, not reported
        if on_error is not None and can_retry(e):
            on_error(e)

    try:
        FollowLoop(watch, act, on_error=failed).run(
            stop, until=lambda: until is not None and done is not None and done >= until)
    finally:
        watch.close()
        target.close()
        reader.close()
    return done


def _relay_refreshed(watch: StepWatch, target: Store, trusted: TrustedKeys | None, done: int | None,
                     relayed: bytes | None) -> bytes | None:
    """Relay the source's head as the watch last read it, when it changed and names a step the copy holds."""
    hint = watch.last_hint
    raw = None if hint is None else hint.head_bytes
    if raw is None or raw == relayed or done is None:
        return relayed
    head = _head_step(raw, trusted, watch.reader.url)
    if head is not None and head <= done:
        target.relay_head(raw, done)
        return raw
    return relayed
