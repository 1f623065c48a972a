"""Who hears of a publisher's commits: the sinks of its one commit announcement.

Once a step is committed (its manifest written: the store is the history and the safety net, so it comes
first), the publisher announces it once, to every sink its options named:

- ``events=`` (:class:`EventSink`): an event feed (:class:`deltasync.notify.EventServer`); followers given its
  URL fetch the step at once instead of at their next poll;
- ``rdma=`` (:func:`rdma_sink`): the step's object offered over NIXL from this trainer rank's ring
  (:class:`deltasync.rdma.trainer.RdmaTrainer`), read by consumers that follow with an ``RdmaConsumer``.

A sink never fails a commit: the step is in the store whatever happens after, so what a sink raises is logged
and the next sink still hears of the step (a follower that missed an announcement finds the step by polling).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Protocol

from deltasync.errors import ConfigError
from deltasync.notify import EventServer, host_port
from deltasync.rdma.options import RdmaOptions, rdma_options

if TYPE_CHECKING:
    from deltasync.format.documents import Manifest

log = logging.getLogger(__name__)

__all__ = ["CommitAnnouncement", "CommitSink", "EventSink", "rdma_sink"]


class CommitSink(Protocol):
    """What hears of each committed step (see the module docstring)."""

    @property
    def object_bytes(self) -> int:
        """The largest step object whose bytes this sink wants handed to ``committed`` (0: never)."""

    def committed(self, step: int, manifest: Manifest | None, data: bytes | None) -> None:
        """``step`` is committed. ``manifest``: what this publisher committed (None: a sharded step, whose parts
        the ranks wrote); ``data``: the bytes of its single object when they are at most ``object_bytes``."""

    def close(self) -> None: ...


class EventSink:
    """``events=``: serve an event feed on ``HOST:PORT`` (port 0: any free one) announcing each committed step.

    Raises:
        ConfigError: ``events`` is not ``HOST:PORT``, or nothing can listen there.
    """

    object_bytes = 0

    def __init__(self, events: str) -> None:
        host, port = host_port(events, what="publish option events")
        try:
            self.server = EventServer(host, port)
        except OSError as e:
            raise ConfigError(f"publish option events: cannot listen on {events!r} ({e.strerror or e})") from None

    @property
    def url(self) -> str:
        return self.server.url

    def committed(self, step: int, manifest: Manifest | None, data: bytes | None) -> None:
        self.server.announce(step)

    def close(self) -> None:
        self.server.close()


def rdma_sink(options: str | RdmaOptions | dict[str, Any]) -> CommitSink:
    """``rdma=``: this trainer rank's RDMA offer (one NIXL agent, its registered ring, its controller link), for
    ``options`` as :func:`deltasync.rdma.options.rdma_options` takes them.

    Raises:
        MissingDependencyError: NIXL or pyzmq is not installed (``pip install 'deltasync[rdma]'``).
        ConfigError: no cluster secret (``DELTASYNC_RDMA_SECRET`` or the ``secret`` option).
    """
    from deltasync.rdma.trainer import RdmaTrainer

    return RdmaTrainer(rdma_options(options))


class CommitAnnouncement:
    """The publisher's one commit announcement: each committed step to every sink, in order, none failing it."""

    def __init__(self, sinks: Sequence[CommitSink] = ()) -> None:
        self.sinks = list(sinks)

    @property
    def object_bytes(self) -> int:
        """The largest object some sink wants the bytes of (the publisher reads only those before committing)."""
        return max((s.object_bytes for s in self.sinks), default=0)

    def committed(self, step: int, manifest: Manifest | None, data: bytes | None = None) -> None:
        for sink in self.sinks:
            try:
                sink.committed(step, manifest, data if data is not None and len(data) <= sink.object_bytes else None)
            except Exception:  # the step is committed: a sink's failure costs its followers a poll, never the step
                log.exception("announcing committed step %d to %r failed", step, sink)

    def close(self) -> None:
        """Close every sink (the RDMA offer waits, at most its ack deadline, for reads in flight)."""
        errors = []
        for sink in self.sinks:
            try:
                sink.close()
            except Exception as e:  # noqa: BLE001 - every sink is closed; the first failure is raised after
                errors.append(e)
        self.sinks = []
        if errors:
            raise errors[0]
