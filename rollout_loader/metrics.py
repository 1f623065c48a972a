"""What a consumer holds and how far behind the stream it runs, for dashboards: a recorder and a Prometheus endpoint.

``FollowerStats`` records, without any dependency, what a follower saw and did (the newest committed step
it listed, each step it applied: bytes, seconds, pause; each failure). ``status()`` snapshots it as a
``FollowerStatus``, whose ``lag_steps`` is the provenance figure: how many steps the weights that serve
rollouts are behind the newest committed step.

With a target that keeps a replica record (``VllmTarget.record()``: when its step was applied, its runtime
fingerprint and configuration key, the comparison with a reference; docs/FORMAT.md section 5f) the endpoint adds
``deltasync_follower_last_applied_unix_seconds``, ``deltasync_follower_fingerprint_info`` and
``deltasync_follower_fingerprint_mismatch``.

``serve(source, port)`` exposes any object with a ``status()`` (a ``Follower``, or the command line's server
follower) over HTTP in Prometheus' text format, read afresh at every scrape. It needs prometheus-client
(``pip install 'deltasync[metrics]'``), imported only here, when a server is asked for.
"""

from __future__ import annotations

import logging
import math
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Protocol

from deltasync.errors import ConfigError, MissingDependencyError

log = logging.getLogger(__name__)

__all__ = ["FollowerStats", "FollowerStatus", "MetricsServer", "StatusSource", "serve"]

PREFIX = "deltasync_follower_"


@dataclass(frozen=True, kw_only=True)
class FollowerStatus:
    """One consumer's state at a moment. Steps are step numbers (a follower may skip steps: coalesced ones,
    or a jump to an anchor), so ``lag_steps`` counts step numbers, not objects left to apply."""

    stream: str
    held_step: int | None  # the step the target's weights are at (None: nothing applied or known yet)
    newest_step: int | None  # the newest committed step the follower has seen in the store
    steps_applied: int
    bytes_applied: int  # step objects' sizes, as committed (what the follower fetched or had fetched)
    errors: int  # failed attempts (each retried or, if permanent, fatal)
    last_apply_s: float | None  # fetching, verifying and applying the last step
    last_pause_s: float | None  # how long the engine stopped generating for it (None: a target that never pauses)

    @property
    def lag_steps(self) -> int | None:
        """How far the held step is behind the newest committed one (None until both are known)."""
        if self.held_step is None or self.newest_step is None:
            return None
        return max(0, self.newest_step - self.held_step)


class StatusSource(Protocol):
    """Anything ``serve`` can expose: it says where it stands when asked."""

    def status(self) -> FollowerStatus: ...


class FollowerStats:
    """A thread-safe record of a follower's progress (the follower's thread writes, a scrape reads)."""

    def __init__(self, stream: str) -> None:
        self.stream = stream
        self._lock = threading.Lock()
        self._newest: int | None = None
        self._applied = 0
        self._bytes = 0
        self._errors = 0
        self._apply_s: float | None = None
        self._pause_s: float | None = None

    def saw_newest(self, step: int | None) -> None:
        """The store's newest committed step, as just listed (never goes back: a stale listing changes nothing)."""
        if step is not None:
            with self._lock:
                self._newest = step if self._newest is None else max(self._newest, step)

    def applied(self, step: int, *, nbytes: int, apply_s: float, pause_s: float | None = None) -> None:
        """``step`` is live in the target."""
        with self._lock:
            self._newest = step if self._newest is None else max(self._newest, step)
            self._applied += 1
            self._bytes += nbytes
            self._apply_s = apply_s
            self._pause_s = pause_s

    def failed(self) -> None:
        with self._lock:
            self._errors += 1

    def status(self, held_step: int | None) -> FollowerStatus:
        """A snapshot, with ``held_step`` from the target itself (the one authority on what it holds)."""
        with self._lock:
            return FollowerStatus(
                stream=self.stream, held_step=held_step, newest_step=self._newest, steps_applied=self._applied,
                bytes_applied=self._bytes, errors=self._errors, last_apply_s=self._apply_s, last_pause_s=self._pause_s,
            )


# name, kind, help, how to read it from a status
_METRICS: tuple[tuple[str, str, str, str], ...] = (
    ("held_step", "gauge", "The step the follower's target holds (NaN: none yet).", "held_step"),
    ("newest_step", "gauge", "The newest committed step the follower has seen in the store (NaN: none yet).",
     "newest_step"),
    ("lag_steps", "gauge", "How many steps the held step is behind the newest committed step (NaN: unknown).",
     "lag_steps"),
    ("steps_applied", "counter", "Steps applied to the target.", "steps_applied"),
    ("applied_bytes", "counter", "Bytes of the step objects applied (as committed).", "bytes_applied"),
    ("errors", "counter", "Failed attempts to follow (retried, or permanent).", "errors"),
    ("last_apply_seconds", "gauge", "Seconds to fetch, verify and apply the last step (NaN: none yet).",
     "last_apply_s"),
    ("last_pause_seconds", "gauge", "Seconds generation was paused for the last step (NaN: none, or no pause).",
     "last_pause_s"),
)


def replica_record(source: Any) -> Any:
    """The replica record of a source's target (``VllmTarget.record()``), None where it has none or fails (a scrape
    never fails on it)."""
    record = getattr(getattr(source, "target", None), "record", None)
    if not callable(record):
        return None
    try:
        return record()
    except Exception:  # noqa: BLE001 - a metric left out, never a failed scrape
        log.warning("metrics: the target's record could not be read", exc_info=True)
        return None


def _number(value: float | None) -> float:
    return math.nan if value is None else float(value)


class _Collector:
    """Reads the source's status at each scrape (nothing is copied between scrapes)."""

    def __init__(self, source: StatusSource) -> None:
        self.source = source

    def describe(self) -> list[Any]:
        return []  # unchecked collector: the registry does not call collect() at registration

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        status = self.source.status()
        for name, kind, doc, attr in _METRICS:
            make = GaugeMetricFamily if kind == "gauge" else CounterMetricFamily
            family = make(PREFIX + name, doc, labels=["stream"])
            family.add_metric([status.stream], _number(getattr(status, attr)))
            yield family
        record = replica_record(self.source)
        if record is None:
            return
        applied = GaugeMetricFamily(PREFIX + "last_applied_unix_seconds", "When the held step was applied (the "
                                    "engine's clock; NaN: unknown).", labels=["stream"])
        applied.add_metric([status.stream], _number(record.applied_unix_s))
        yield applied
        info = GaugeMetricFamily(PREFIX + "fingerprint_info", "The engine's runtime fingerprint (docs/FORMAT.md "
                                 "section 5f): 1, labelled with its configuration key, step, digest and the comparison "
                                 "with a reference.", labels=["stream", "config_key", "step", "fingerprint", "check"])
        if record.fingerprint is not None:
            info.add_metric([status.stream, str(record.config_key), str(record.fingerprint_step), record.fingerprint,
                             str(record.fingerprint_check)], 1.0)
        yield info
        bad = GaugeMetricFamily(PREFIX + "fingerprint_mismatch", "1 when the engine's runtime fingerprint differs "
                                "from the reference for its configuration and step (NaN: not compared).",
                                labels=["stream"])
        check = record.fingerprint_check
        bad.add_metric([status.stream], 1.0 if check == "mismatch" else 0.0 if check == "match" else math.nan)
        yield bad


class MetricsServer:
    """A running Prometheus endpoint (``http://addr:port/metrics``); ``close()`` stops it and frees the port."""

    def __init__(self, server: Any, thread: threading.Thread) -> None:
        self._server = server
        self._thread = thread
        self.addr, self.port = server.server_address[:2]

    @property
    def url(self) -> str:
        return f"http://{self.addr}:{self.port}/metrics"

    def close(self) -> None:
        server, self._server = self._server, None
        if server is not None:
            server.shutdown()
            server.server_close()
            self._thread.join()

    def __enter__(self) -> MetricsServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def serve(source: StatusSource, port: int, *, addr: str = "127.0.0.1") -> MetricsServer:
    """Serve ``source.status()`` as Prometheus metrics on ``addr:port`` (port 0: any free port, see ``.port``)
    from a daemon thread, with a registry of its own (several followers in one process each serve theirs).

    Raises ``MissingDependencyError`` without prometheus-client, ``ConfigError`` when the port cannot be bound.
    """
    try:
        from prometheus_client import CollectorRegistry, start_http_server
    except ImportError as e:
        raise MissingDependencyError("a metrics endpoint needs prometheus-client: pip install 'deltasync[metrics]' "
                                     f"({e})") from e
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Collector(source))
    try:
        server, thread = start_http_server(port, addr=addr, registry=registry)
    except OSError as e:
        raise ConfigError(f"metrics endpoint: cannot listen on {addr}:{port}: {e.strerror or e}") from e
    metrics = MetricsServer(server, thread)
    log.info("follower metrics at %s", metrics.url)
    return metrics
