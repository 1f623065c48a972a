"""Verify a stream by replaying it: manifests, objects, headers, chains and every checksum (``verify``)."""

from __future__ import annotations

import logging
from dataclasses import asdict, dataclass
from typing import Any, Literal

from deltasync.errors import (
    CatchupError,
    ChecksumMismatchError,
    CorruptObjectError,
    DeltaSyncError,
    FormatError,
    ResourceLimitError,
    SignatureError,
    StepNotFoundError,
    TensorMismatchError,
)
from deltasync.follow.reader import StreamReader
from deltasync.format.objects import StepObject
from deltasync.history.replay import (
    Chain,
    ProgressFn,
    check_layout,
    open_checked,
    reader_of,
    require_steps,
)
from deltasync.store import MANIFEST
from deltasync.trust import UNTRUSTED, TrustedKeys

log = logging.getLogger(__name__)


# "resource": this machine could not read the step (open files, memory), which says nothing of the stream
ProblemKind = Literal["manifest", "object", "header", "chain", "checksum", "resource", "signature", "head", "catchup"]


@dataclass(frozen=True, kw_only=True)
class Problem:
    """One thing wrong with one step."""

    step: int
    kind: ProblemKind
    message: str


@dataclass(frozen=True, kw_only=True)
class VerifyReport:
    """Which steps were replayed with every checksum reproduced, and what was wrong with the others."""

    url: str
    first: int
    last: int
    verified: tuple[int, ...]
    problems: tuple[Problem, ...]
    origin_checked: bool = False  # every verified step was signed by a trusted key (the reader had keys)
    head: dict[str, Any] | None = None  # with trusted keys: the stream's signed head (docs/FORMAT.md section 5e)

    @property
    def ok(self) -> bool:
        return not self.problems

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "ok": self.ok}


def verify(
    url: str | StreamReader,
    *,
    first: int | None = None,
    last: int | None = None,
    all_problems: bool = False,
    storage_options: dict[str, Any] | None = None,
    progress: ProgressFn | None = None,
    trusted_keys: Any = None,
) -> VerifyReport:
    """Check every committed step in ``first..last``: manifest, object (size, digest), header (valid, and
    agreeing with the manifest), chain (each delta's base is committed and sound) and checksums, by
    replaying every tensor through every step; and each catch-up delta into a step of ``first..last``
    (docs/FORMAT.md section 5g): its manifest, signature and object, and, where both its steps verified, that
    applied to its base step's weights it gives every checksum of its step (a ``catchup`` problem, under its
    step, otherwise). With ``trusted_keys`` (a ``TrustedKeys``, or a reader that has
    them), also origin: each step's signature (a ``signature`` problem otherwise; ``origin_checked`` says it was
    done), and the signed head in ``latest.json`` (``head``): one that names a step past every committed one is a
    ``head`` problem (steps deleted after their commit: a rollback).

    Stops at the first problem (the lowest step) unless ``all_problems``. A step whose chain starts below
    ``first`` is replayed from its anchor; problems there are reported under their own step.
    """
    reader = reader_of(url, storage_options)
    if trusted_keys is not None:
        reader.trusted = TrustedKeys.load(trusted_keys)
    committed = require_steps(reader)
    lo = committed[0] if first is None else first
    hi = committed[-1] if last is None else last
    targets = [s for s in committed if lo <= s <= hi]
    if not targets:
        raise StepNotFoundError(f"{reader.url}: no committed steps in {lo}..{hi} (the stream holds "
                                f"{committed[0]}..{committed[-1]})")
    run = _Verification(reader, set(committed), all_problems)
    segments = run.segments(targets)
    for k, segment in enumerate(segments):
        if run.done(segment[0]):
            break
        run.replay(segment, progress)
        if progress:
            progress("verify", k + 1, len(segments))
    for s in targets:  # an anchor's own delta must lead from its base to exactly the anchor's weights
        if not run.done(s) and s in run.replayed:
            run.anchor_delta(s)
    for c in reader.store.catchup_entries():  # catch-ups (FORMAT.md 5g): from their base to exactly their step
        if c.committed and lo <= c.step <= hi and not run.done(c.step):
            run.catchup(c.base_step, c.step)
    head = _head(reader, committed, run) if reader.trusted is not None else None
    problems = sorted(run.problems, key=lambda p: p.step)
    if not all_problems:
        problems = problems[:1]
    bad = {p.step for p in run.problems}
    verified = tuple(s for s in targets if s in run.replayed and s not in bad)
    return VerifyReport(url=reader.url, first=lo, last=hi, verified=verified, problems=tuple(problems),
                        origin_checked=reader.trusted is not None, head=head)


def _head(reader: StreamReader, committed: list[int], run: _Verification) -> dict[str, Any] | None:
    """The stream's signed head as a report shows it; a head past every committed step is a ``head`` problem."""
    assert reader.trusted is not None
    hint = reader.store.latest_hint()
    raw = None if hint is None else hint.head_bytes
    if raw is None:
        return None
    try:
        head = reader.trusted.check_head(raw, where=reader.url)
    except UNTRUSTED as e:
        run.report(committed[-1], "head", f"latest.json's head does not prove anything: {e}")
        return None
    if head.step > committed[-1]:
        run.report(head.step, "head", f"{reader.url}: a signed head names step {head.step} as the newest, but the "
                                      f"store's newest committed step is {committed[-1]}: steps were deleted after "
                                      "they were committed (a rollback)")
    return {"step": head.step, "signed_unix_s": head.signed_unix_s, "closed": head.closed, "key_id": head.key_id}


class _Verification:
    def __init__(self, reader: StreamReader, committed: set[int], all_problems: bool) -> None:
        self.reader = reader
        self.committed = committed
        self.all_problems = all_problems
        self.problems: list[Problem] = []
        self.replayed: set[int] = set()
        self._folders: set[int] | None = None

    def report(self, step: int, kind: ProblemKind, message: str) -> None:
        self.problems.append(Problem(step=step, kind=kind, message=message))

    def done(self, step: int) -> bool:
        """Without ``all_problems``, stop once a problem below ``step`` is known (it is the first)."""
        return not self.all_problems and any(p.step < step for p in self.problems)

    def segments(self, targets: list[int]) -> list[list[int]]:
        """The targets as linear chains (anchor first), from their manifests; chain problems reported."""
        out: list[list[int]] = []
        for s in targets:
            try:
                m = self.reader.manifest(s)
            except SignatureError as e:
                self.report(s, "signature", str(e))
                continue
            except FormatError as e:
                self.report(s, "manifest", str(e))
                continue
            if m.kind == "anchor":
                out.append([s])
            elif out and out[-1][-1] == m.base_step:
                out[-1].append(s)
            elif m.base_step not in self.committed:
                self.report(s, "chain", f"{self.reader.url}: step {s} is a delta on step {m.base_step}, which is not "
                                        f"committed{self._leftover(m.base_step)}")
            else:
                try:
                    out.append(self.reader.chain(s, catchup=False))
                except SignatureError as e:
                    self.report(s, "signature", str(e))
                except (StepNotFoundError, FormatError) as e:
                    self.report(s, "chain", str(e))
        return out

    def anchor_delta(self, step: int) -> None:
        """An anchor step's own delta (docs/FORMAT.md section 5): its object (size, digest, header), and, where
        its base step is committed, applied to that step's weights it gives every checksum of the anchor."""
        m = self.reader.manifest(step)
        if m.delta is None:
            return
        base = m.delta.base_step
        sound = base in self.replayed and all(p.step != base for p in self.problems)  # else only the object is checked
        try:
            with self.reader.open(step, base=base) as obj:
                if sound:
                    replica = self.reader.replica(base, verify="full")
                    replica.apply(obj, verify="full")
        except CorruptObjectError as e:
            self.report(step, "object", f"{step}'s own delta: {e}")
        except ChecksumMismatchError as e:
            self.report(step, "checksum", f"{step}'s own delta from step {base}: {e}")
        except (FormatError, TensorMismatchError, StepNotFoundError) as e:
            self.report(step, "header", f"{step}'s own delta: {e}")
        except DeltaSyncError as e:
            self.report(step, "chain", f"{step}'s own delta from step {base}: {e}")

    def catchup(self, base: int, step: int) -> None:
        """A catch-up delta: its manifest, signature and object, and, where both steps verified, its result."""
        sound = base in self.replayed and step in self.replayed and not any(p.step in (base, step)
                                                                             for p in self.problems)
        try:
            self.reader.catchup(step, base)
            with self.reader.open(step, base=base) as obj:
                if sound:
                    replica = self.reader.replica(base, verify="full")
                    replica.apply(obj, verify="full")
        except DeltaSyncError as e:
            cause = e.__cause__ if isinstance(e, CatchupError) and isinstance(e.__cause__, DeltaSyncError) else e
            self.report(step, "catchup", f"the catch-up from step {base} to step {step}: {type(cause).__name__}: "
                                         f"{cause}")

    def _leftover(self, step: int | None) -> str:
        if self._folders is None:
            self._folders = set(self.reader.store.step_folders())
        return f" (its folder holds objects but no {MANIFEST})" if step in self._folders else ""

    def replay(self, segment: list[int], progress: ProgressFn | None) -> None:
        objects: list[StepObject] = []
        try:
            failures = [self._open(segment, objects)]  # the steps before a bad object are replayed all the same
            failures.append(self._check_checksums(objects, progress) if objects else None)
            first = min((f for f in failures if f is not None), default=len(segment))
            reported = {p.step for p in self.problems}
            for s in segment[first + 1 :]:
                if s not in reported:
                    self.report(s, "chain", f"{self.reader.url}: step {s} builds on step {segment[first]}, which "
                                            "failed verification")
            self.replayed.update(segment[:first])
        finally:
            for o in objects:
                o.close()

    def _open(self, segment: list[int], objects: list[StepObject]) -> int | None:
        """Open each object of the segment; the index of the first that failed, or None."""
        for i, s in enumerate(segment):
            try:
                obj = open_checked(self.reader, s)
                try:
                    check_layout(objects[0] if objects else obj, obj)
                except TensorMismatchError:
                    obj.close()
                    raise
                objects.append(obj)
            except CorruptObjectError as e:
                self.report(s, "object", str(e))
            except (FormatError, TensorMismatchError) as e:
                self.report(s, "header", str(e))
            except StepNotFoundError as e:
                self.report(s, "manifest", str(e))
            except ResourceLimitError as e:
                self.report(s, "resource", str(e))
            except ChecksumMismatchError as e:  # a multi-part step whose parts' checksums do not add up
                self.report(s, "checksum", str(e))
            else:
                continue
            return i
        return None

    def _check_checksums(self, objects: list[StepObject], progress: ProgressFn | None) -> int | None:
        """Replay every tensor through the segment; the index of the first step that failed, or None."""
        chain = Chain(objects)
        first: dict[int, DeltaSyncError] = {}  # link -> the first error found there
        for rebuilt in chain.rebuild(check="each", progress=progress):
            failed = chain.failure(rebuilt)
            if failed:
                first.setdefault(*failed)
        if not first:
            return None
        link = min(first)
        kind: ProblemKind = "checksum" if isinstance(first[link], ChecksumMismatchError) else "object"
        self.report(chain.steps[link], kind, str(first[link]))
        return link


