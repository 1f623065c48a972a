"""Crash harness: a publisher SIGKILLed again and again, restarted with take-over each time.

A publisher process publishes deterministic steps (``truth(step)``: any process can recompute what a step
must hold) in a loop. The harness kills it at random moments, or it kills itself at an injected point
(right after an object upload, or between a manifest and the ``latest.json`` hint), and a new one takes
the stream over, as a restarted trainer would: from an older checkpoint, so it retries steps that may be
committed already, which must be refused. Step numbers have gaps (``is_step``), as a trainer that does not
publish every step makes them, so a stale hint cannot be corrected by looking at ``hint + 1``.

A monitor lists the manifests throughout, with plain file-system calls (not deltasync's), and records each
one's bytes and identity the first time it appears. The promises checked:

- no committed manifest ever changes or disappears (none is replaced);
- each restarted publisher resumes after the newest committed step;
- deltasync lists exactly the committed steps, between any two publishers and at the end (a killed
  writer's leftovers are never steps);
- at the end every committed step replays bit-exactly, ``verify`` passes, and the stream resumes once more.

Publishers are forked from a "zygote" process that imported torch and deltasync once, so a restart costs
milliseconds rather than seconds of imports. The harness kills a publisher only through the zygote, which
kills only its own child, by pid, before reaping it.

Long run (offline), local then S3::

    DELTASYNC_CRASH_KILLS=500 DELTASYNC_CRASH_SEED=1 DELTASYNC_CRASH_REPORT=crash.json \
        .venv/bin/python -m pytest -p no:cacheprovider tests/test_crash.py
    DELTASYNC_CRASH_KILLS=500 DELTASYNC_CRASH_SEED=1 DELTASYNC_CRASH_REPORT=crash.json \
        .venv/bin/python -m pytest -p no:cacheprovider tests/integration/test_crash_s3.py -k random_moments

``crash.json`` then holds the counts of each (publishers started, kills by kind, committed, replayed and
verified steps, failures). CI runs 16 kills locally and 12 on S3 with a fixed seed.
"""

from __future__ import annotations

import json
import os
import queue
import random
import select
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Protocol

import torch

ROOT = Path(__file__).resolve().parents[1]
KILLS = int(os.environ.get("DELTASYNC_CRASH_KILLS", "0"))  # 0: the CI default of each test
SEED = int(os.environ.get("DELTASYNC_CRASH_SEED", "8"))
REPORT = os.environ.get("DELTASYNC_CRASH_REPORT")
ANCHOR_EVERY = 4
MANIFEST = "manifest.json"  # docs/FORMAT.md section 5: steps/<12 digits>/manifest.json commits a step


def is_step(step: int) -> bool:
    """The steps the trainer publishes: every other one, so that step ``hint + 1`` never exists."""
    return step % 2 == 0


def next_step(after: int | None) -> int:
    s = 0 if after is None else after + 1
    while not is_step(s):
        s += 1
    return s


_BASE: dict[str, torch.Tensor] = {}


def truth(step: int) -> dict[str, torch.Tensor]:
    """The trainer's weights at ``step``: a fixed base with about 2% of its elements changed per step."""
    from tests.conftest import perturb

    if not _BASE:
        g = torch.Generator().manual_seed(0)
        _BASE.update(w=torch.randn(65536, generator=g).bfloat16(), b=torch.randn(512, generator=g).bfloat16())
    g = torch.Generator().manual_seed(1000 + step)
    return {k: perturb(v, 0.02, g) for k, v in _BASE.items()}


# --- the publisher process (forked from the zygote) ---


def _emit(**event: Any) -> None:
    """One event line to the harness; a single write of less than PIPE_BUF bytes is never interleaved."""
    os.write(1, (json.dumps(event) + "\n").encode())


def _die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def hook_transport(transport: Any, *, before: Callable[[str], None] = lambda p: None,
                   after: Callable[[str], None] = lambda p: None) -> None:
    """Run ``before(path)``/``after(path)`` around each store path a transport call writes or reads.

    Every public method is hooked, whatever its name (the commit's primitives may change); methods are
    replaced on the instance, so the transport keeps its class. A list of ``(bytes, path)`` items is passed
    on one item per call, so that a hook can fall between two of them (a manifest and its hint). Only the
    outermost call runs hooks (a method calling another is one operation).
    """
    depth = threading.local()

    def wrap(method: Callable[..., Any]) -> Callable[..., Any]:
        def hooked(*args: Any, **kwargs: Any) -> Any:
            if getattr(depth, "n", 0):
                return method(*args, **kwargs)
            items = next((a for a in args if _is_items(a)), None)
            if items is not None and len(items) > 1:
                for item in items:
                    hooked(*[[item] if a is items else a for a in args], **kwargs)
                return None
            paths = [a for a in args if isinstance(a, str)] + [p for _, p in items or []]
            for p in paths:
                before(p)
            depth.n = 1
            try:
                out = method(*args, **kwargs)
            finally:
                depth.n = 0
            for p in paths:
                after(p)
            return out

        return hooked

    for name in dir(type(transport)):
        if not name.startswith("_") and callable(getattr(type(transport), name)):
            setattr(transport, name, wrap(getattr(transport, name)))


def _is_items(arg: Any) -> bool:
    return isinstance(arg, list) and bool(arg) and all(isinstance(i, tuple) and len(i) == 2 and isinstance(i[1], str)
                                                       for i in arg)


def is_object_path(path: str, step: int | None = None) -> bool:
    """A step's object (``steps/<step>/<name>.safetensors``), under its final name."""
    folder = f"steps/{step:012d}/" if step is not None else "steps/"  # a transport's key, or a path ending in one
    return (path.startswith(folder) or f"/{folder}" in path) and path.endswith(".safetensors")


def _arm(transport: Any, point: str, nth: int) -> None:
    """Kill this process at an injected point of its ``nth`` commit.

    ``object``: right after the object upload, before the manifest. ``hint``: after the manifest, before
    the ``latest.json`` hint.
    """
    count = [0]

    def after_object(path: str) -> None:
        if is_object_path(path):
            count[0] += 1
            if count[0] == nth:
                _die()

    def before_hint(path: str) -> None:
        if path == "latest.json" or path.endswith("/latest.json"):
            count[0] += 1
            if count[0] == nth:
                _die()

    if point == "object":
        hook_transport(transport, after=after_object)
    elif point == "hint":
        hook_transport(transport, before=before_hint)


def run_publisher(spec: dict[str, Any]) -> None:
    """Publish the trainer's steps from its checkpoint ``start`` up to ``stop``; refused steps are skipped."""
    from deltasync import DeltaPublisher
    from deltasync.errors import StepOrderError
    from deltasync.store import Store

    torch.set_num_threads(1)
    store = Store(spec["url"], storage_options=spec["storage_options"])
    _arm(store.transport, spec["point"], spec["nth"])
    pub = DeltaPublisher(
        store,
        truth(spec["start"]),
        take_over=True,
        anchor_every=ANCHOR_EVERY,
        on_backlog=spec["on_backlog"],
        spool_dir=spec["spool"],
    )
    _emit(ev="ready", last=pub.last_committed_step)
    s = spec["start"]
    while s <= spec["stop"]:
        pub.source = truth(s)
        try:
            pub.publish(s)
        except StepOrderError:
            _emit(ev="refused", step=s)  # committed before the crash: the trainer moves on
        s = next_step(s)
    pub.close()


def zygote_main() -> None:
    """Fork one publisher per ``spawn`` line on stdin, ``kill`` it on request, report how each ended.

    Only a child not yet reaped is ever signalled, so its pid cannot belong to another process. On EOF the
    zygote kills its child and exits: nothing outlives the harness.
    """
    from deltasync.transports import transient_errors

    transient_errors()  # the HTTP clients' imports, once, here rather than in every child
    import numba

    numba.njit(lambda x: x + 1)(1)  # numba's typing registries, likewise (no threads start)
    _emit(ev="zygote")
    child: int | None = None
    pending = b""
    while True:
        readable, _, _ = select.select([0], [], [], 0.01)
        if child is not None:
            pid, status = os.waitpid(child, os.WNOHANG)
            if pid:
                _emit(ev="exit", pid=pid, signal=os.WTERMSIG(status) if os.WIFSIGNALED(status) else None,
                      code=os.WEXITSTATUS(status) if os.WIFEXITED(status) else None)
                child = None
        if not readable:
            continue
        data = os.read(0, 1 << 16)
        if not data:
            if child is not None:
                os.kill(child, signal.SIGKILL)
                os.waitpid(child, 0)
            return
        pending += data
        while b"\n" in pending:
            line, pending = pending.split(b"\n", 1)
            cmd = json.loads(line)
            if cmd["cmd"] == "kill" and child is not None:
                os.kill(child, signal.SIGKILL)
            elif cmd["cmd"] == "spawn" and child is None:
                child = os.fork()
                if child == 0:
                    _child(cmd["spec"])
                _emit(ev="spawned", pid=child)


def _child(spec: dict[str, Any]) -> None:
    code = 0
    try:
        run_publisher(spec)
    except BaseException as e:  # noqa: BLE001 - reported to the harness as a failure
        _emit(ev="error", error=f"{type(e).__name__}: {e}")
        code = 3
    os._exit(code)


# --- the harness side ---


class Zygote:
    """The zygote process and the events it (and its children) report, one JSON object per line."""

    def __init__(self, workdir: Path) -> None:
        (workdir / "tmp").mkdir(exist_ok=True)
        env = {
            **os.environ,
            "PYTHONPATH": str(ROOT),
            "TMPDIR": str(workdir / "tmp"),  # what a killed publisher leaves stays in the test's folder
            "NUMBA_NUM_THREADS": "1",
            "OMP_NUM_THREADS": "1",
        }
        self.log_path = workdir / "publishers.log"
        self._log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(
            [sys.executable, "-c", "from tests.crash import zygote_main; zygote_main()"],
            cwd=ROOT, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._log,
        )
        self.events: queue.Queue[dict[str, Any]] = queue.Queue()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        started = self.next_event(120)
        if started is None or started.get("ev") != "zygote":
            self.close()
            raise RuntimeError(f"the zygote did not start: {started}; see {self.log_path}")

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.events.put(json.loads(line))
        self.events.put({"ev": "eof"})

    def send(self, **cmd: Any) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write((json.dumps(cmd) + "\n").encode())
        self.proc.stdin.flush()

    def next_event(self, timeout_s: float) -> dict[str, Any] | None:
        try:
            return self.events.get(timeout=max(timeout_s, 0.0))
        except queue.Empty:
            return None

    def log_tail(self, n: int = 1500) -> str:
        return self.log_path.read_bytes()[-n:].decode(errors="replace")

    def close(self) -> None:
        if self.proc.stdin and not self.proc.stdin.closed:
            self.proc.stdin.close()  # EOF: the zygote kills its child and exits
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self._reader.join(5)
        if self.proc.stdout:
            self.proc.stdout.close()
        self._log.close()


class ManifestListing(Protocol):
    """Plain access to a stream's manifests, written without deltasync (local folder, S3 bucket)."""

    def fingerprints(self) -> dict[int, Any]:
        """Every committed step, with something that changes whenever its manifest is rewritten."""

    def read(self, step: int) -> bytes: ...


class LocalManifests:
    """Manifests in a local folder: an inode and an mtime as fingerprint (a rewrite changes one)."""

    def __init__(self, root: Path) -> None:
        self.root = root

    def fingerprints(self) -> dict[int, Any]:
        out = {}
        try:
            entries = list(os.scandir(self.root / "steps"))
        except FileNotFoundError:
            return {}
        for entry in entries:
            if len(entry.name) == 12 and entry.name.isdigit():
                try:
                    st = os.stat(os.path.join(entry.path, MANIFEST))
                except FileNotFoundError:
                    continue
                out[int(entry.name)] = (st.st_ino, st.st_size, st.st_mtime_ns)
        return out

    def read(self, step: int) -> bytes:
        return (self.root / "steps" / f"{step:012d}" / MANIFEST).read_bytes()


class Monitor:
    """Records every manifest the first time it is listed; reports any that changes or disappears."""

    def __init__(self, listing: ManifestListing, poll_s: float) -> None:
        self.listing = listing
        self.poll_s = poll_s
        self.first_bytes: dict[int, bytes] = {}
        self.fingerprint: dict[int, Any] = {}
        self.problems: list[str] = []
        self.scans = 0
        self.listing_errors = 0
        self._reported: set[int] = set()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        pause_s = self.poll_s
        while not self._stop.wait(pause_s):
            t0 = time.monotonic()
            try:
                self.scan()
            except Exception:  # noqa: BLE001 - a listing that failed while a writer runs is retried; the final scans must work
                self.listing_errors += 1
            pause_s = max(self.poll_s, 2 * (time.monotonic() - t0))  # a long stream: list at most half the time

    def scan(self) -> list[int]:
        """List once; returns the committed steps."""
        with self._lock:
            now = self.listing.fingerprints()
            self.scans += 1
            for step, fp in now.items():
                if step not in self.fingerprint:
                    self.fingerprint[step] = fp
                    self.first_bytes[step] = self.listing.read(step)
                elif fp != self.fingerprint[step] and step not in self._reported:
                    self._reported.add(step)
                    self.problems.append(f"step {step}: its manifest was rewritten ({self.fingerprint[step]} -> {fp})")
            for step in self.fingerprint.keys() - now.keys() - self._reported:
                self._reported.add(step)
                self.problems.append(f"step {step}: its committed manifest disappeared")
            return sorted(now)

    def check_bytes(self) -> None:
        """Every manifest still holds the bytes it was first seen with."""
        with self._lock:
            for step, data in self.first_bytes.items():
                try:
                    now = self.listing.read(step)
                except FileNotFoundError:
                    now = None
                if now != data and step not in self._reported:
                    self._reported.add(step)
                    self.problems.append(f"step {step}: its manifest changed from {data[:200]!r} to "
                                         f"{now[:200] if now else now!r}")


@dataclass
class CrashCounts:
    """What a crash run did (reported by the long run)."""

    seed: int
    publishers: int = 0  # publisher processes started
    kills: int = 0  # publishers that died by SIGKILL
    kills_by_point: Counter = field(default_factory=Counter)  # random, object, hint
    injected_not_reached: int = 0  # injected kills whose point the publisher never reached (killed anyway)
    committed_steps: int = 0
    restarts_with_leftovers: int = 0  # restarts that found a killed writer's uncommitted step folder
    refused_republish: int = 0  # committed steps a restarted trainer published again, refused (StepOrderError)
    listing_errors: int = 0  # monitor listings that failed while a publisher ran (retried)
    manifest_scans: int = 0
    replayed_steps: int = 0  # committed steps whose state_dict equals truth(step), at the end
    verified_steps: int = 0  # committed steps deltasync.verify passed, at the end
    leftover_folders_at_end: int = 0  # uncommitted step folders (young leftovers are kept), never listed as steps
    elapsed_s: float = 0.0
    failures: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "kills_by_point": dict(self.kills_by_point)}


@dataclass
class CrashRun:
    """One stream under crash test: how to reach it, and how to read it independently."""

    url: str
    storage_options: dict[str, Any]
    listing: ManifestListing
    workdir: Path
    reader: Callable[[], Any]  # a deltasync StreamReader on the stream, closed by the caller
    max_delay_s: float
    poll_s: float
    event_timeout_s: float = 120.0


POINTS = ("random", "object", "random", "hint")  # the kinds of kill, in turn


def crash_publishers(run: CrashRun, kills: int, seed: int) -> CrashCounts:
    """Start, kill and restart publishers ``kills`` times, then one that ends cleanly; returns the counts."""
    rng = random.Random(seed)
    counts = CrashCounts(seed=seed)
    t0 = time.monotonic()
    monitor = Monitor(run.listing, run.poll_s)
    spool = run.workdir / "spool"
    spool.mkdir(exist_ok=True)
    zygote = Zygote(run.workdir)
    reader = run.reader()
    monitor.start()
    try:
        for i in range(kills):
            point = POINTS[i % len(POINTS)]
            _one_publisher(run, zygote, monitor, reader, counts, rng, point=point, spool=spool)
            if len(counts.failures) > 20:
                break
        committed = monitor.scan()
        stop = next_step(next_step(next_step(committed[-1] if committed else None)))
        _one_publisher(run, zygote, monitor, reader, counts, rng, point="none", spool=spool, stop=stop)
    finally:
        monitor.stop()
        zygote.close()
        reader.store.close()
    committed = monitor.scan()
    monitor.check_bytes()
    counts.failures += monitor.problems
    counts.manifest_scans = monitor.scans
    counts.listing_errors = monitor.listing_errors
    counts.committed_steps = len(committed)
    counts.elapsed_s = round(time.monotonic() - t0, 1)
    if not committed or committed[-1] != stop:
        counts.failures.append(f"the last publisher, which ended cleanly, did not commit step {stop} (committed: "
                               f"{committed[-5:]})")
    return counts


def _one_publisher(
    run: CrashRun,
    zygote: Zygote,
    monitor: Monitor,
    reader: Any,
    counts: CrashCounts,
    rng: random.Random,
    *,
    point: str,
    spool: Path,
    stop: int = 10**9,
) -> None:
    """Start one publisher from a checkpoint at or behind the stream's end and end it as ``point`` says."""
    committed = monitor.scan()  # no writer runs now: every committed manifest is recorded before the next starts
    _check_listing(reader, committed, counts)
    start = rng.choice(committed[-3:]) if committed else 0  # the trainer's checkpoint lags the stream
    spec = {
        "url": run.url,
        "storage_options": run.storage_options,
        "start": start,
        "stop": stop,
        "point": point if point in ("object", "hint") else "none",
        "nth": rng.randint(1, 3),
        "on_backlog": "block" if point == "none" else rng.choice(["coalesce", "block"]),
        "spool": str(spool),
    }
    counts.publishers += 1
    name = f"publisher {counts.publishers} ({point}, from step {start})"
    zygote.send(cmd="spawn", spec=spec)
    t0 = time.monotonic()
    kill_at = t0 + rng.uniform(0, run.max_delay_s) if point == "random" else t0 + run.event_timeout_s
    killed_at: float | None = None
    errors: list[str] = []
    while True:
        now = time.monotonic()
        if killed_at is None and now >= kill_at:
            if point in ("object", "hint"):
                counts.injected_not_reached += 1
            elif point == "none":
                counts.failures.append(f"{name} did not finish within {run.event_timeout_s}s")
            zygote.send(cmd="kill")
            killed_at = now
        if killed_at is not None and now > killed_at + 60:
            raise RuntimeError(f"the zygote stopped answering; see {zygote.log_path}:\n{zygote.log_tail()}")
        event = zygote.next_event(min(max(kill_at - now, 0.0), 0.5) if killed_at is None else 0.5)
        if event is None:
            continue
        if event["ev"] == "ready":
            _check_resume(name, event["last"], committed, counts)
        elif event["ev"] == "refused":
            counts.refused_republish += 1
        elif event["ev"] == "error":
            errors.append(event["error"])
        elif event["ev"] == "eof":
            raise RuntimeError(f"the zygote died; see {zygote.log_path}:\n{zygote.log_tail()}")
        elif event["ev"] == "exit":
            break
    if errors:
        counts.failures.append(f"{name} failed: {errors}")
    if point == "none":
        if event["code"] != 0:
            counts.failures.append(f"{name} did not end cleanly: {event}")
    elif event["signal"] == signal.SIGKILL:
        counts.kills += 1
        counts.kills_by_point[point] += 1
    elif not errors:
        counts.failures.append(f"{name} ended without being killed: {event}")


def _check_listing(reader: Any, committed: list[int], counts: CrashCounts) -> None:
    """Between two publishers: deltasync lists exactly the committed steps, whatever a killed one left."""
    listed = reader.steps()
    if listed != committed:
        counts.failures.append(f"deltasync lists steps {sorted(set(listed) ^ set(committed))} differently from the "
                               "manifests")
    if set(reader.store.step_folders()) - set(committed):
        counts.restarts_with_leftovers += 1


def _check_resume(name: str, last: int | None, committed: list[int], counts: CrashCounts) -> None:
    """A restarted publisher resumes after the newest committed step (manifests, not the hint).

    ``committed`` was listed before the publisher started; a step can only have been added since.
    """
    if committed and (last is None or last < committed[-1]):
        counts.failures.append(f"{name} resumed after step {last}, but step {committed[-1]} is committed")


def check_stream(run: CrashRun, counts: CrashCounts) -> None:
    """The end state: every committed step replays exactly, verify passes, leftovers are not steps.

    Adds what is wrong to ``counts.failures`` (so that a long run reports it with its counts).
    """
    from deltasync import verify
    from tests.conftest import states_equal

    failures = counts.failures
    committed = sorted(run.listing.fingerprints())
    if not committed:
        failures.append("nothing was committed")
        return
    if any(not is_step(s) for s in committed):
        failures.append(f"steps the trainer never published are committed: {[s for s in committed if not is_step(s)]}")
    reader = run.reader()
    try:
        if reader.steps() != committed:
            failures.append(f"deltasync lists steps {sorted(set(reader.steps()) ^ set(committed))} differently from "
                            "the manifests")
        if reader.latest_step() != committed[-1]:
            failures.append(f"the latest step is {reader.latest_step()}, the newest manifest {committed[-1]}")
        # a killed writer's folder stays until it is older than a lease (remove_uncommitted): invisible
        counts.leftover_folders_at_end = len(set(reader.store.step_folders()) - set(committed))
        for s in committed:
            if states_equal(reader.state_dict(s), truth(s)):
                counts.replayed_steps += 1
            else:
                failures.append(f"step {s} does not replay to its weights")
        report = verify(reader)
        counts.verified_steps = len(report.verified)
        if not report.ok or list(report.verified) != committed:
            failures.append(f"verify: {len(report.verified)} of {len(committed)} steps verified; problems: "
                            f"{report.problems}")
    finally:
        reader.store.close()


def assert_crash_run(counts: CrashCounts, kills: int) -> None:
    """No failure, and the run did what it says: every kind of kill, leftovers, refused republishing."""
    assert not counts.failures, "\n".join(counts.failures[:30])
    summary = counts.to_dict()
    assert counts.kills == kills and counts.kills_by_point["object"] and counts.kills_by_point["hint"], summary
    assert counts.committed_steps >= counts.kills_by_point["hint"] + 3, summary  # each hint kill follows a commit
    assert counts.replayed_steps == counts.verified_steps == counts.committed_steps, summary
    assert counts.restarts_with_leftovers and counts.refused_republish, summary


def write_report(counts: CrashCounts, where: str) -> None:
    if REPORT:
        path = Path(REPORT)
        reports = json.loads(path.read_text()) if path.exists() else {}
        reports[where] = counts.to_dict()
        path.write_text(json.dumps(reports, indent=1))


def crash_timeout_s(kills: int, per_kill_s: float) -> int:
    return int(max(600, 120 + kills * per_kill_s * 3))
