"""Where every consumer of a stream stands, from their heartbeats: the fleet status ``deltasync status`` prints.

Each ``Follower(consumer_id=...)`` writes ``consumers/<id>.json`` (docs/FORMAT.md section 5): the step it
holds, the newest it had seen, its engine's weight version, its error count, and when; an engine's replica record
too (section 5f: when its step was applied, its pause, its runtime fingerprint and configuration key, the comparison
with a reference, its last error). Replicas of one configuration at one step whose fingerprints differ are
``disagreements``: one of them computes with other bytes, with or without a reference to say which. :func:`fleet_status`
reads them (one listing plus one read per consumer, and one listing of the manifests), counts how many
committed steps each consumer is behind, and flags those that have not reported within ``stale_after_s``.
:func:`prometheus_text` renders the same as Prometheus' text exposition format.
"""

from __future__ import annotations

import bisect
import time
from dataclasses import asdict, dataclass, field
from typing import Any

from deltasync.errors import ConfigError
from deltasync.fingerprints import disagreements
from deltasync.follow.consumers import FUTURE_SKEW_S, ReplicaRecord, UnreadableHeartbeat, read_heartbeats_checked
from deltasync.store import Store

__all__ = ["ConsumerStatus", "Disagreement", "FleetStatus", "UnreadableHeartbeat", "fleet_status", "prometheus_text"]


@dataclass(frozen=True, kw_only=True)
class ConsumerStatus:
    """One consumer as its last heartbeat tells: ``lag_steps`` counts committed steps after the one it holds."""

    consumer_id: str
    step: int
    lag_steps: int | None  # None: the stream's newest step is unknown (no committed step)
    age_s: float  # since its last heartbeat (negative: dated ahead of this clock)
    stale: bool  # no heartbeat within stale_after_s: stopped, cut off, or its heartbeats fail
    suspect: bool  # dated more than FUTURE_SKEW_S ahead of this clock: never live (a lie or a broken clock)
    newest_seen: int | None
    weight_version: str | None
    errors: int | None
    # the replica's record (docs/FORMAT.md section 5f; its fields None where its heartbeat has none)
    record: ReplicaRecord = field(default_factory=ReplicaRecord)
    disagrees: bool = False  # another replica of its configuration holds another fingerprint at the same step


@dataclass(frozen=True, kw_only=True)
class Disagreement:
    """Replicas of configuration ``config_key`` at ``step`` holding different runtime fingerprints: ``groups``
    maps each fingerprint to the consumers that hold it (a reference, where one exists, says which is right)."""

    config_key: str
    step: int
    groups: dict[str, list[str]]


@dataclass(frozen=True, kw_only=True)
class FleetStatus:
    """Every consumer of the stream at ``url``, oldest held step first."""

    url: str
    newest_step: int | None
    stale_after_s: float
    consumers: tuple[ConsumerStatus, ...]
    unreadable: tuple[UnreadableHeartbeat, ...] = ()  # heartbeat files that could not be read as one
    disagreements: tuple[Disagreement, ...] = ()

    @property
    def mismatched(self) -> tuple[ConsumerStatus, ...]:
        """Consumers whose runtime fingerprint differs from the reference for their configuration and step."""
        return tuple(c for c in self.consumers if c.record.fingerprint_check == "mismatch")

    @property
    def healthy(self) -> bool:
        """No replica disagrees with a reference or with a sibling of its configuration."""
        return not (self.disagreements or self.mismatched)

    @property
    def stale(self) -> tuple[ConsumerStatus, ...]:
        return tuple(c for c in self.consumers if c.stale)

    @property
    def suspect(self) -> tuple[ConsumerStatus, ...]:
        return tuple(c for c in self.consumers if c.suspect)

    def to_dict(self) -> dict[str, Any]:
        return {"url": self.url, "newest_step": self.newest_step, "stale_after_s": self.stale_after_s,
                "consumers": [_row(c) for c in self.consumers],
                "unreadable": [asdict(u) for u in self.unreadable],
                "disagreements": [asdict(d) for d in self.disagreements], "healthy": self.healthy}


def _row(consumer: ConsumerStatus) -> dict[str, Any]:
    """A status row as JSON has it (``deltasync status --json``): the replica's record beside the row's own fields,
    in one object, as in the heartbeat."""
    row = asdict(consumer)
    row.update(row.pop("record"))
    return row


def fleet_status(store: Store, *, stale_after_s: float = 900.0, now_unix_s: float | None = None) -> FleetStatus:
    """Read every heartbeat of ``store``'s stream and say where each consumer stands.

    Args:
        store: the stream's store.
        stale_after_s: a consumer whose last heartbeat is older is flagged stale (followers report every
            5 minutes while idle by default, so 15 minutes means three missed reports).
        now_unix_s: the time to measure ages from (tests).

    A heartbeat that cannot be read is reported in ``unreadable`` (the others are read all the same); one dated
    more than a minute ahead of this clock is ``suspect`` (never live). Raises ``ConfigError`` for a bad
    ``stale_after_s``; store errors as the store raises them.

    Example: ``[c.consumer_id for c in fleet_status(Store(url)).stale]``
    """
    if not (isinstance(stale_after_s, (int, float)) and 0 < stale_after_s < 1e9):
        raise ConfigError(f"stale_after_s must be a positive number of seconds, not {stale_after_s!r}")
    now = time.time() if now_unix_s is None else now_unix_s
    steps = store.steps()
    newest = steps[-1] if steps else None
    consumers = []
    positions, unreadable = read_heartbeats_checked(store)
    split = disagreements(positions)
    for p in positions:
        lag = None if newest is None else len(steps) - bisect.bisect_right(steps, p.step)
        age = now - p.updated_unix_s
        suspect = age < -FUTURE_SKEW_S
        age = age if suspect else max(0.0, age)
        consumers.append(ConsumerStatus(consumer_id=p.consumer_id, step=p.step, lag_steps=lag, age_s=round(age, 3),
                                        stale=not suspect and age > stale_after_s, suspect=suspect,
                                        newest_seen=p.newest_step, weight_version=p.weight_version, errors=p.errors,
                                        record=p.record, disagrees=(p.config_key, p.fingerprint_step) in split))
    consumers.sort(key=lambda c: (c.step, c.consumer_id))
    return FleetStatus(url=store.url, newest_step=newest, stale_after_s=float(stale_after_s),
                       consumers=tuple(consumers), unreadable=tuple(unreadable),
                       disagreements=tuple(Disagreement(config_key=k, step=s, groups=g) for (k, s), g in split.items()))


def _label(value: str) -> str:
    """A label value in the text format: its escapes, and no other control character (a store's text is shown
    inert wherever it lands, a scrape that ends up on a terminal too)."""
    value = "".join(c if c.isprintable() or c == "\n" else "\ufffd" for c in value)
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def prometheus_text(status: FleetStatus) -> str:
    """The fleet as Prometheus text exposition: per consumer its held step, lag, heartbeat age and staleness,
    and the stream's newest committed step (``deltasync_fleet_*``)."""
    lines = []

    def family(name: str, help_text: str, samples: list[tuple[str, float]]) -> None:
        lines.append(f"# HELP deltasync_fleet_{name} {help_text}")
        lines.append(f"# TYPE deltasync_fleet_{name} gauge")
        lines.extend(f"deltasync_fleet_{name}{labels} {value:g}" for labels, value in samples)

    stream = f'stream="{_label(status.url)}"'
    family("newest_step", "Newest committed step of the stream.",
           [("{" + stream + "}", status.newest_step)] if status.newest_step is not None else [])
    family("consumers", "Consumers with a heartbeat.", [("{" + stream + "}", len(status.consumers))])
    family("stale_consumers", "Consumers whose last heartbeat is older than stale_after_s.",
           [("{" + stream + "}", len(status.stale))])
    family("suspect_consumers", "Consumers whose heartbeat is dated ahead of this clock (never live).",
           [("{" + stream + "}", len(status.suspect))])
    family("unreadable_heartbeats", "Heartbeat files that could not be read as one.",
           [("{" + stream + "}", len(status.unreadable))])
    per = [(c, "{" + f'{stream},consumer="{_label(c.consumer_id)}"' + "}") for c in status.consumers]
    family("consumer_step", "Step the consumer holds.", [(lab, c.step) for c, lab in per])
    family("consumer_lag_steps", "Committed steps after the one the consumer holds.",
           [(lab, c.lag_steps) for c, lab in per if c.lag_steps is not None])
    family("consumer_heartbeat_age_seconds", "Seconds since the consumer's last heartbeat.",
           [(lab, c.age_s) for c, lab in per])
    family("consumer_stale", "1 if the consumer's last heartbeat is older than stale_after_s.",
           [(lab, float(c.stale)) for c, lab in per])
    family("disagreeing_consumers", "Consumers whose runtime fingerprint differs from a sibling's of the same "
           "configuration at the same step (docs/FORMAT.md section 5f).",
           [("{" + stream + "}", sum(c.disagrees for c in status.consumers))])
    family("fingerprint_mismatches", "Consumers whose runtime fingerprint differs from the reference.",
           [("{" + stream + "}", len(status.mismatched))])
    family("consumer_disagrees", "1 if another replica of the consumer's configuration holds another runtime "
           "fingerprint at the same step.", [(lab, float(c.disagrees)) for c, lab in per if c.record.fingerprint])
    family("consumer_fingerprint_mismatch", "1 if the consumer's runtime fingerprint differs from the reference, 0 "
           "if it matches (absent: not compared).",
           [(lab, float(c.record.fingerprint_check == "mismatch")) for c, lab in per
            if c.record.fingerprint_check in ("match", "mismatch")])
    family("consumer_applied_unix_seconds", "When the consumer applied the step it holds (its clock).",
           [(lab, c.record.applied_unix_s) for c, lab in per if c.record.applied_unix_s is not None])
    family("consumer_pause_seconds", "Seconds generation paused for the consumer's last step.",
           [(lab, c.record.pause_s) for c, lab in per if c.record.pause_s is not None])
    family("consumer_fingerprint_info", "1, labelled with the consumer's configuration key, the step fingerprinted, "
           "the runtime fingerprint and the comparison with a reference.",
           [("{" + f'{lab[1:-1]},config_key="{_label(str(r.config_key))}",step="{r.fingerprint_step}",'
             f'fingerprint="{_label(r.fingerprint)}",check="{_label(str(r.fingerprint_check))}"' + "}", 1.0)
            for r, lab in ((c.record, lab) for c, lab in per) if r.fingerprint])
    return "\n".join(lines) + "\n"
