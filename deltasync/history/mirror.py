"""Replicate a stream from one store to another (the trainer's bucket in one cloud to a bucket or disk in
another), so that a region's followers read their own copy and egress is paid once per region.

Every object is checked against its manifest's size and SHA-256 as it is read from the source; each step is
written the way a publisher writes one: objects first, then the manifest, create-only, then the hint; steps go
in the source's commit order. So a mirror killed at any point leaves nothing half-visible (an uncommitted step
folder at most, which the next run or ``gc`` replaces), a restarted one goes on where the destination stands,
and several mirrors of one pair commit each step once: a step another mirror committed first is compared with
the source's manifest and, if equal, counted as present (a different one is an error: two streams under one
name). Model files (``files/``, ``files.json``) and ``stream.json`` are copied too. The destination keeps its
own retention (``deltasync gc`` there, which respects its own consumers' heartbeats).

    report = mirror("s3://trainer/run-7", "gs://region-b/run-7")           # what is committed now
    mirror_follow(src, dst, until=1000)                                     # and what comes, as it comes
"""

from __future__ import annotations

import logging
import shutil
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from deltasync.errors import StepExistsError, StepNotFoundError, can_retry
from deltasync.history.checkpoints import read_model_file_index, read_model_files, write_model_files
from deltasync.notify import EventServer, Notifier
from deltasync.reader import StreamReader
from deltasync.scratch import ScratchFolder
from deltasync.signing import TrustedKeys
from deltasync.store import Manifest, Part, Store
from deltasync.watch import PollPolicy, StepWatch

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


def _store(where: str | Store, options: dict[str, Any] | None) -> tuple[Store, bool]:
    return (where, False) if isinstance(where, Store) else (Store(where, storage_options=options), True)


def mirror(src: str | Store, dst: str | Store, *, src_options: dict[str, Any] | None = None,
           dst_options: dict[str, Any] | None = None, after: int | None = None, newest: int | None = None,
           on_step: Callable[[int, int], None] | None = None, trusted_keys: Any = None,
           reader: StreamReader | None = None) -> MirrorReport:
    """Copy every committed step of ``src`` that ``dst`` lacks (those after ``after`` only, if given), in order.

    Args:
        src, dst: stream URLs (or ``Store``s); ``src_options``/``dst_options``: their storage options.
        after: skip the source's steps up to and including this one (a follower of the source knows them copied).
        newest: with ``after``, the source's newest step as its hint says: a few steps past ``after`` are then
            looked up by their manifests (one read each, which copying needs anyway), not by listing the source,
            and the stream and model files are not checked again.
        on_step: called with (step, object bytes) after each step is committed at the destination.
        trusted_keys: public key files (or ``TrustedKeys``): only steps one of them signed are copied. Either
            way a step's signature is copied with it (before its manifest), and the copy keeps the source's
            stream id, so the copy's followers check the same signatures.
        reader: a reader of ``src`` whose cached manifests to use (a follower's: the step it just saw is
            not read again).

    Raises ``StreamNotFoundError`` (no stream at ``src``), ``CorruptObjectError`` (a source object that does not
    match its manifest: nothing of that step is committed), ``StepExistsError`` (the destination holds a
    different step under the same number), store errors. A failure leaves every step before it committed.

    Example: ``mirror("s3://trainer/run-7", "/mnt/region-b/run-7").copied``
    """
    t0 = time.perf_counter()
    source, own_src = _store(src, src_options)
    target, own_dst = _store(dst, dst_options)
    trusted = None if trusted_keys is None else TrustedKeys.load(trusted_keys)
    scratch = ScratchFolder("mirror")
    copied: list[int] = []
    nbytes = 0
    try:
        incremental = after is not None and newest is not None and 0 < newest - after <= 16
        if incremental:  # following: the next few step numbers, by their manifests (a gap in numbering costs one read)
            assert after is not None and newest is not None
            steps, held, files = list(range(after + 1, newest + 1)), set(), False
        else:
            source.require_stream()
            _same_stream(source, target.create_stream(like=source.stream_info()), target)
            files = _copy_files(source, target)
            steps = [s for s in source.steps() if after is None or s > after]
            held = set(target.steps())
            common = sorted(held.intersection(steps))
            if after is None and common:  # one comparison per pass: the same stream, not another under its name
                _same_step(source, target, common[-1])
        present = sum(1 for s in steps if s in held)
        for step in steps:
            if step in held:
                continue
            try:
                size = _copy_step(source, target, step, scratch, trusted,
                                  manifest=reader.manifest if reader is not None else source.manifest)
            except StepNotFoundError:
                if not incremental and step in source.steps():
                    raise
                log.debug("%s: no step %d (not committed, or collected before it was copied)", source.url, step)
                continue
            if size is None:
                present += 1  # another mirror committed the same step first
                continue
            copied.append(step)
            nbytes += size
            if on_step is not None:
                on_step(step, size)
    finally:
        scratch.remove()
        if own_src:
            source.close()
        if own_dst:
            target.close()
    return MirrorReport(copied=tuple(copied), present=present, bytes_copied=nbytes, files_copied=files,
                        seconds=round(time.perf_counter() - t0, 3))


def _copy_files(source: Store, target: Store) -> bool:
    """The model files, each checked against the source's index; written only where the destination differs."""
    if read_model_file_index(source) is None:
        return False
    return write_model_files(target, read_model_files(source))


def _same_stream(source: Store, info: Any, target: Store) -> None:
    """``StepExistsError`` when the destination is another stream (its id differs from the source's)."""
    theirs = source.stream_id()
    if theirs is not None and info.stream_id is not None and info.stream_id != theirs:
        raise StepExistsError(f"{target.url} holds another stream (id {info.stream_id}) than {source.url} (id "
                              f"{theirs}): "
                              "two different streams under one name (mirror into an empty location, or an earlier "
                              "copy of this stream)")


def _copy_step(source: Store, target: Store, step: int, scratch: ScratchFolder, trusted: Any = None, *,
               manifest: Callable[..., Manifest]) -> int | None:
    """Commit ``step`` at the destination: its objects (checked against the manifest), its signature, then the
    manifest. Returns the bytes copied, or None when the destination already holds exactly this step."""
    m = manifest(step, nearby=False)
    signature = source.signature(step)
    if trusted is not None:
        trusted.check(signature, m, source.stream_id(), where=source.url)
    objects = [(m, part) for part in m.objects]
    if m.delta is not None:  # an anchor's own delta: a second object of the step (docs/FORMAT.md section 5)
        own = m.as_delta()
        objects.append((own, own.objects[0]))
    held: list[tuple[Manifest, Part]] = []
    local: list[tuple[Part, Path]] = []
    made: list[Path] = []
    try:
        for owner, part in objects:
            path = source.fetch_object(owner, part=part, hold=True)  # checked: size and SHA-256
            held.append((owner, part))
            if target.is_local:  # a local destination takes files over (moves them): hand it a copy of its own
                made.append(scratch.path / f"{step}-{part.object}")
                shutil.copyfile(path, made[-1])
                path = made[-1]
            local.append((part, path))
        # every object before the manifest: the step's parts, or the anchor's own delta beside its object
        for part, path in local if m.is_multipart else local[1:]:
            target.put_part(step, part, path)
        target.commit(m, None if m.is_multipart else local[0][1], signature=signature)
    except StepExistsError:
        _same_step(source, target, step, m)
        return None
    finally:
        for owner, part in held:
            source.release_object(owner, part)
        for path in made:
            path.unlink(missing_ok=True)
    return sum(part.object_bytes for part, _ in local)


def _same_step(source: Store, target: Store, step: int, manifest: Any = None) -> None:
    """``StepExistsError`` unless the destination's step ``step`` is the source's (same manifest)."""
    ours = manifest if manifest is not None else source.manifest(step)
    if target.manifest(step).to_json() != ours.to_json():
        raise StepExistsError(
            f"{target.url}: step {step} is committed there with another manifest than at {source.url}: two "
            "different streams under one name (mirror into an empty location, or an earlier copy of this stream)")


def mirror_follow(src: str, dst: str, *, src_options: dict[str, Any] | None = None,
                  dst_options: dict[str, Any] | None = None, policy: PollPolicy | None = None,
                  until: int | None = None, stop: threading.Event | None = None,
                  on_step: Callable[[int, int], None] | None = None,
                  on_error: Callable[[BaseException], None] | None = None,
                  notifier: Notifier | None = None, events: EventServer | None = None,
                  trusted_keys: Any = None) -> int | None:
    """Keep ``dst`` a copy of ``src``: copy what is committed, then each new step as the source commits it,
    polling the source with one small read per poll (:class:`~deltasync.watch.StepWatch`). Returns the newest
    step copied once ``until`` is copied or ``stop`` is set. Transient failures are retried with the
    watch's back-off (``on_error`` hears each, a damaged source object too: a committed step is never rewritten,
    but a truncated download reads whole next time); those retrying cannot help (``can_retry``: credentials,
    settings, another stream under the destination's name) are raised.

    ``notifier`` pushes the source's new steps (an upstream mirror's ``EventFeed``): polls slow to a safety
    net. ``events`` (an :class:`~deltasync.notify.EventServer`) is told of every step committed at the
    destination, so the region's followers hear of it at once instead of polling (deltasync/notify.py)."""
    stop = stop or threading.Event()
    trusted = None if trusted_keys is None else TrustedKeys.load(trusted_keys)  # one set: endorsements seen persist
    reader = StreamReader(src, storage_options=src_options)
    watch = StepWatch(reader, policy, notifier=notifier)
    target = Store(dst, storage_options=dst_options)
    done: int | None = None
    failures = 0

    def copied(step: int, nbytes: int) -> None:
        if events is not None:
            events.announce(step)
        if on_step is not None:
            on_step(step, nbytes)

    try:
        while not stop.is_set():
            try:
                newest = watch.newest()
                if newest is not None and (done is None or newest > done):
                    mirror(reader.store, target, after=done, newest=newest, on_step=copied, trusted_keys=trusted,
                           reader=reader)  # the step the watch just checked is not read again
                    done = newest
                    if events is not None:
                        events.announce(done)  # steps the destination held already count too
                failures = 0
                delay = watch.delay()
            except Exception as e:  # noqa: BLE001 - the source or the destination may come back
                if not can_retry(e):  # credentials, settings, two different streams under one name
                    raise
                failures += 1
                if on_error is not None:
                    on_error(e)
                delay = watch.retry_delay(failures, max_s=60.0)
            if until is not None and done is not None and done >= until:
                break
            _wait(watch, stop, delay)
    finally:
        watch.close()
        target.close()
        reader.close()
    return done


def _wait(watch: StepWatch, stop: threading.Event, seconds: float) -> None:
    """Sleep up to ``seconds``: less when a step is pushed, or (within half a second) when ``stop`` is set."""
    deadline = time.monotonic() + seconds
    while not stop.is_set():
        left = deadline - time.monotonic()
        if left <= 0 or watch.wake.wait(min(left, 0.5)):
            watch.wake.clear()
            return
