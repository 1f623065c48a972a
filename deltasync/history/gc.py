"""Garbage collection that never hurts a consumer: it respects the consumers' heartbeats
(deltasync/follow/consumers.py).

Planned by a pure function (``plan_gc``: committed steps and consumer positions in, a ``GcPlan`` out) and
executed by ``run_gc``; ``collect_garbage`` does both. Consumers record their position in the store
(``consumers/<id>.json``, written by ``Follower(consumer_id=...)``); a plan never deletes a step that a
consumer with a recent heartbeat holds or may still need to catch up.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

from deltasync.errors import ConfigError
from deltasync.follow.consumers import FUTURE_SKEW_S, read_heartbeats_checked
from deltasync.follow.reader import StreamReader
from deltasync.format.documents import ConsumerPosition
from deltasync.history.replay import ProgressFn, require_steps
from deltasync.store import MANIFEST, CatchupEntry, Manifest, Store, open_store, step_dir
from deltasync.store.location import Where

log = logging.getLogger(__name__)

CATCHUP_LEFTOVER_S = 3600.0  # an uncommitted catch-up folder this old lost its writer (docs/FORMAT.md section 5g)


@dataclass(frozen=True)
class StepSummary:
    """What garbage collection needs of a step's manifest (its chain link and size): a manifest of a
    1,000-rank step parses to megabytes, this to a few dozen bytes, so a plan over every step of a long
    stream holds one manifest at a time."""

    step: int
    kind: str
    base_step: int | None
    object_bytes: int

    @classmethod
    def of(cls, m: Manifest) -> StepSummary:
        return cls(m.step, m.kind, m.base_step, m.object_bytes)


@dataclass(frozen=True, kw_only=True)
class GcPlan:
    """What a garbage collection keeps and deletes. Plain data: ``run_gc`` executes it."""

    keep: dict[int, str]  # step -> why it is kept
    delete: tuple[int, ...]  # committed steps, newest first: an interrupted run leaves whole chains
    leftovers: tuple[int, ...]  # step folders without a manifest, older than the latest step
    freed_bytes: int
    live_consumers: tuple[ConsumerPosition, ...]
    stale_consumers: tuple[ConsumerPosition, ...]  # too old, or dated ahead of this clock (suspect): not respected
    unreadable: tuple[tuple[str, str], ...] = ()  # heartbeat files that could not be read: (file, why)
    # catch-up deltas (docs/FORMAT.md section 5g) to delete, as (base_step, step): an end no longer committed after
    # this collection, or a folder without a manifest older than an hour; deleted before any step
    catchups: tuple[tuple[int, int], ...] = ()

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["keep"] = [{"step": s, "reason": r} for s, r in sorted(self.keep.items())]
        return d


def check_gc_options(keep_last: Any, keep_anchor_every: Any, consumer_max_age_s: Any) -> None:
    """``ConfigError`` naming the first option that makes no sense: a count below 1, an age that is NaN or
    negative (NaN compares false with every age: every live consumer would look stale and the steps it needs
    would go). An age of 0 disregards every heartbeat; infinity respects every one."""
    def count(name: str, value: Any) -> None:
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ConfigError(f"gc: {name} must be a whole number of steps, at least 1, got {value!r}")

    count("keep_last", keep_last)
    if keep_anchor_every is not None:
        count("keep_anchor_every", keep_anchor_every)
    age = consumer_max_age_s
    if isinstance(age, bool) or not isinstance(age, (int, float)) or math.isnan(age) or age < 0:
        raise ConfigError(f"gc: consumer_max_age_s must be a number of seconds, 0 or more, got {age!r}")


def plan_gc(
    manifests: Sequence[Manifest | StepSummary],
    *,
    keep_last: int,
    keep_anchor_every: int | None = None,
    consumers: Sequence[ConsumerPosition] = (),
    now_unix_s: float,
    consumer_max_age_s: float = 3600.0,
    folders: Sequence[int] = (),
    catchups: Sequence[CatchupEntry] = (),
) -> GcPlan:
    """Decide what to delete: only steps that no retained step needs.

    Retained: the last ``keep_last`` committed steps; with ``keep_anchor_every`` M, the first anchor of
    every M-step window (a sparse history to replay from); for each consumer whose heartbeat is at most
    ``consumer_max_age_s`` old, the step it holds and every later step (it may still replay each). A heartbeat
    dated more than ``FUTURE_SKEW_S`` ahead of ``now_unix_s`` is suspect and never respected (a consumer could
    otherwise hold back every step for ever by dating its heartbeat ten years ahead).
    Every retained step keeps its whole chain (its anchor and the deltas in between). ``folders`` are
    the stream's step folders: those without a manifest and older than the latest step are leftovers.
    ``catchups``: the stream's catch-up deltas (``Store.catchup_entries``): one whose step or base is not kept
    goes (a catch-up is never part of a step's chain: no kept step needs one), and so does an uncommitted one an
    hour old.
    """
    check_gc_options(keep_last, keep_anchor_every, consumer_max_age_s)
    by_step = {m.step: m for m in manifests}
    steps = sorted(by_step)
    live = tuple(c for c in consumers if -FUTURE_SKEW_S <= now_unix_s - c.updated_unix_s <= consumer_max_age_s)
    stale = tuple(c for c in consumers if c not in live)
    roots: dict[int, str] = {}
    for s in steps[-keep_last:]:
        roots.setdefault(s, f"one of the last {keep_last} steps")
    if keep_anchor_every:
        windows: set[int] = set()
        for s in steps:
            if by_step[s].kind == "anchor" and s // keep_anchor_every not in windows:
                windows.add(s // keep_anchor_every)
                roots.setdefault(s, f"first anchor of steps {s // keep_anchor_every * keep_anchor_every}..")
    for c in live:
        for s in steps:
            if s >= c.step:
                roots.setdefault(s, f"consumer {c.consumer_id} holds step {c.step}" if s == c.step
                                 else f"consumer {c.consumer_id} may catch up through it")
    keep: dict[int, str] = {}
    for root in sorted(roots):
        at: int | None = root
        why = roots[root]
        while at is not None and at in by_step and at not in keep:
            keep[at] = why if at == root else roots.get(at, f"in the chain of step {root}")
            at = None if by_step[at].kind == "anchor" else by_step[at].base_step
    delete = tuple(sorted((s for s in steps if s not in keep), reverse=True))
    latest = steps[-1] if steps else -1
    gone = tuple((c.base_step, c.step) for c in catchups
                 if (c.committed and (c.step not in keep or c.base_step not in keep))
                 or (not c.committed and c.age_s is not None and c.age_s >= CATCHUP_LEFTOVER_S))
    return GcPlan(
        keep=dict(sorted(keep.items())),
        delete=delete,
        leftovers=tuple(sorted(f for f in set(folders) if f not in by_step and f < latest)),
        freed_bytes=sum(by_step[s].object_bytes for s in delete),
        live_consumers=live,
        stale_consumers=stale,
        catchups=gone,
    )


def run_gc(store: Store, plan: GcPlan, *, progress: ProgressFn | None = None) -> None:
    """Execute ``plan``: catch-ups first (no catch-up outlives an end), then each step's manifest (readers stop
    seeing it), then its folder."""
    for base, step in plan.catchups:
        store.delete_catchup(step, base)
    total = len(plan.delete) + len(plan.leftovers)
    for k, s in enumerate(plan.delete):
        store.delete(f"{step_dir(s)}/{MANIFEST}")
        store.delete(step_dir(s), recursive=True)
        if progress:
            progress("delete", k + 1, total)
    for k, s in enumerate(plan.leftovers):
        store.delete(step_dir(s), recursive=True)
        if progress:
            progress("delete", len(plan.delete) + k + 1, total)
    if total:
        log.info("%s: deleted steps %s and leftovers %s", store.url, list(plan.delete), list(plan.leftovers))


def collect_garbage(
    url: Where,
    *,
    keep_last: int,
    keep_anchor_every: int | None = None,
    consumer_max_age_s: float = 3600.0,
    dry_run: bool = False,
    storage_options: dict[str, Any] | None = None,
    progress: ProgressFn | None = None,
) -> GcPlan:
    """Plan a garbage collection of the stream at ``url`` (``plan_gc``) and, unless ``dry_run``, execute it.

    Fails, deleting nothing, when a manifest cannot be read. A heartbeat that cannot be read is not respected
    (it names no step), and is listed in the plan's ``unreadable``.
    """
    check_gc_options(keep_last, keep_anchor_every, consumer_max_age_s)  # before the store is touched
    store, _ = open_store(url, storage_options)
    manifests = [StepSummary.of(store.manifest(s)) for s in require_steps(StreamReader(store))]  # one at a time
    consumers, unreadable = read_heartbeats_checked(store)
    plan = plan_gc(
        manifests,
        keep_last=keep_last,
        keep_anchor_every=keep_anchor_every,
        consumers=consumers,
        now_unix_s=time.time(),
        consumer_max_age_s=consumer_max_age_s,
        folders=store.step_folders(),
        catchups=store.catchup_entries(),
    )
    plan = dataclasses.replace(plan, unreadable=tuple((u.file, u.error) for u in unreadable))
    if not dry_run:
        run_gc(store, plan, progress=progress)
    return plan
