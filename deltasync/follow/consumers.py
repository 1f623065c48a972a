"""Consumers' heartbeats: where each consumer of a stream says which step it holds.

A follower with a ``consumer_id`` writes ``consumers/<id>.json`` (docs/FORMAT.md) after each step it
applies; garbage collection keeps what a consumer with a recent heartbeat holds or may still need, and
``deltasync status`` shows the fleet. Its own module because both the follow side (writer) and the history
tools (readers) use it, and neither owns it.
"""

from __future__ import annotations

import logging
import time
from dataclasses import asdict, dataclass

from deltasync.errors import FormatError
from deltasync.format.documents import (  # ReplicaRecord: re-exported (declared beside the heartbeat it is part of)
    MAX_ERROR_CHARS,
    ConsumerPosition,
    ReplicaRecord,
    check_step,
    decode,
    encode,
)
from deltasync.format.names import CONSUMER_ID, check
from deltasync.store import Store

CONSUMERS_DIR = "consumers"
FUTURE_SKEW_S = 60.0
"""A heartbeat dated more than this ahead of the reader's clock is suspect: never live, never respected by gc (a
consumer's clock may run a little ahead; ten years ahead is a lie or a broken clock)."""

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class UnreadableHeartbeat:
    """A heartbeat file that could not be read as one: its file (``consumers/<name>``) and why."""

    file: str
    error: str


def write_heartbeat(store: Store, consumer_id: str, step: int, *, newest_step: int | None = None,
                    weight_version: str | None = None, errors: int | None = None,
                    record: ReplicaRecord | None = None) -> None:
    """Record that ``consumer_id`` holds ``step`` (``consumers/<consumer_id>.json``), with what it saw and, with
    ``record``, what it says of itself; garbage collection keeps what it needs while the heartbeat is recent,
    ``deltasync status`` shows it. A record that does not fit the document (a fingerprint that is not a SHA-256)
    is a ``FormatError``, and nothing is written."""
    fields = {k: v for k, v in asdict(record).items()} if record is not None else {}
    if fields.get("last_error") is not None:
        fields["last_error"] = str(fields["last_error"])[:MAX_ERROR_CHARS]
    position = ConsumerPosition(consumer_id=check_consumer_id(consumer_id), step=check_step(step),
                                updated_unix_s=time.time(),
                                newest_step=None if newest_step is None else check_step(newest_step),
                                weight_version=None if weight_version is None else str(weight_version)[:64],
                                errors=errors, **fields)
    data = encode(position)
    decode(data, ConsumerPosition, where=f"{store.url}/{CONSUMERS_DIR}/{consumer_id}.json (to be written)")
    store.write_bytes(f"{CONSUMERS_DIR}/{consumer_id}.json", data)


def check_consumer_id(consumer_id: str) -> str:
    """``consumer_id`` if it can name a heartbeat object, else ``FormatError`` (a ``ValueError``)."""
    if not check(CONSUMER_ID, consumer_id):
        raise FormatError(f"consumer id {consumer_id!r} must be 1-128 letters, digits, '.', '_' or '-', starting with "
                          "a letter or digit")
    return consumer_id


def read_heartbeats(store: Store) -> list[ConsumerPosition]:
    """Every consumer's last heartbeat that can be read (the others are logged, and skipped: see
    :func:`read_heartbeats_checked`)."""
    positions, unreadable = read_heartbeats_checked(store)
    for bad in unreadable:
        log.warning("%s/%s: unreadable heartbeat, skipped: %s", store.url, bad.file, bad.error)
    return positions


def read_heartbeats_checked(store: Store) -> tuple[list[ConsumerPosition], list[UnreadableHeartbeat]]:
    """Every consumer's last heartbeat, and the heartbeat files that could not be read as one.

    One bad heartbeat (a consumer's credentials can write only its own) costs that consumer only: the others are
    read all the same, ``deltasync status`` reports it on its own line, and garbage collection does not respect
    it (it names no step a consumer holds). Delete the file to forget that consumer.
    """
    paths = [e.key for e in store.list(CONSUMERS_DIR)]  # the transport lists afresh: other processes write heartbeats
    out, bad = [], []
    for path in sorted(p for p in paths if p.endswith(".json")):
        name = path.rsplit("/", 1)[-1]
        rel = f"{CONSUMERS_DIR}/{name}"
        try:
            position = store.read_document(rel, ConsumerPosition)
        except FileNotFoundError:
            continue  # removed since the listing
        except FormatError as e:
            bad.append(UnreadableHeartbeat(file=rel, error=str(e)))
            continue
        if f"{position.consumer_id}.json" != name:
            bad.append(UnreadableHeartbeat(file=rel, error=f"{store.url}/{rel}: heartbeat names consumer "
                                                           f"{position.consumer_id!r}, not its file name"))
            continue
        out.append(position)
    return out, bad
