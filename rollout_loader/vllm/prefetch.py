"""Fetch, verify and decode the next committed steps in the background, so an update finds them staged.

A :class:`Prepared` step is everything that can be done before the pause: the object downloaded and its
digest checked (``StreamReader.open``), its header checked against the engine, a delta decoded and mapped
onto this rank's elements (``state.stage``), an anchor's tensors read into memory; and, once the engine holds
the delta's base step, the delta sealed (``state.seal``: each patched tensor's checksum after the write,
from the bits held and the patch). What is left for the pause is a plain XOR scatter and the comparison of
the sealed checksums with the trainer's.

The :class:`Prefetcher` thread prepares the chain from the step the engine holds to the newest committed step, a
few steps ahead at most; the engine wakes it after each update, so the next step is sealed against the new bits
at once. Anything it fails at is dropped (logged once, retried with the follow loop's back-off): the update
prepares that step again in its own thread and raises the error there, where it is reported.

One watcher per engine: only the first tensor-parallel rank's prefetcher watches the stream (its
:class:`~deltasync.follow.watch.StepWatch`, its event feed or NIXL announcements) and resolves the chain; it decides
what to stage (a :class:`StagePlan`) and tells the engine's other ranks over a :class:`PlanBoard` (a socket it
serves, each rank admitted with a token the ranks exchanged when the engine was initialised). Each rank then
fetches, decodes and seals its own slices. Both sides drive the one follow loop
(:class:`~deltasync.follow.watch.FollowLoop`): the first rank over the stream, the others over the plans it posts
(:class:`PlanFeed`).
"""

from __future__ import annotations

import hmac
import json
import logging
import secrets
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch

from deltasync import StreamReader
from deltasync.engine import MAX_STEP, FollowLoop, Notifier, PollPolicy, StepHeader, StepWatch, retry_delay_s
from deltasync.errors import FormatError

from .state import Seal, Staged, WorkerState

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Prepared:
    """One step made ready for the write: a delta's staged patches, or an anchor's tensors."""

    step: int
    header: StepHeader
    where: str
    staged: list[Staged] | None = None
    anchor: dict[str, torch.Tensor] | None = None
    seal: Seal | None = None  # a delta's checksums after the write, over the bits held when sealed

    @property
    def ready(self) -> bool:
        """Nothing but the write and the comparison left (a sealed delta; an anchor is staged in the pause)."""
        return self.seal is not None or self.anchor is not None


def prepare(reader: StreamReader, state: WorkerState, step: int, *, base: int | None = None,
            held: int | None = None) -> Prepared:
    """Fetch, verify, decode and stage ``step`` against ``state`` (writes nothing). ``base``: the step the engine
    will hold before it (an anchor that carries its delta from there is prepared as that delta). ``held``: the
    step the engine holds now: a delta on it is sealed in the same pass as its decoding."""
    with reader.open(step, base=base) as obj:
        h = obj.header
        state.check_header(h, obj.where)
        if h.kind == "anchor":
            tensors = {name: obj.read_tensor(name) for name in state.homes}
            return Prepared(step=step, header=h, where=obj.where, anchor=tensors)
        staged, sealed = state.stage_object(obj, seal=held is not None and h.base_step == held)
        return Prepared(step=step, header=h, where=obj.where, staged=staged, seal=sealed)


@dataclass(frozen=True)
class StagePlan:
    """What an engine stages next: ``steps``, in order, each based on the one before it (the first on ``held``,
    the step the engine held when the plan was made). Decided once per engine, by the rank that watches the
    stream; a rank that does not hold ``held`` (yet) keeps the plan until it does."""

    held: int | None
    steps: tuple[int, ...]

    def encode(self) -> bytes:
        """One line of JSON (the board's message)."""
        return json.dumps({"held": self.held, "steps": list(self.steps)}).encode() + b"\n"

    @classmethod
    def decode(cls, raw: bytes, where: str) -> StagePlan:
        """The plan in ``raw``; ``FormatError`` naming what arrived unless it is one (a step number or null for
        ``held``, at most ``MAX_PLAN_STEPS`` increasing step numbers)."""
        try:
            doc = json.loads(raw)
        except (ValueError, UnicodeDecodeError) as e:
            raise FormatError(f"{where}: a stage plan is one line of JSON, got {raw[:80]!r}: {e}") from None
        held, steps = (doc.get("held", 0), doc.get("steps")) if isinstance(doc, dict) else (0, None)

        def is_step(v: object) -> bool:
            return isinstance(v, int) and not isinstance(v, bool) and 0 <= v <= MAX_STEP

        if not ((held is None or is_step(held)) and isinstance(steps, list) and len(steps) <= MAX_PLAN_STEPS
                and all(is_step(s) for s in steps) and steps == sorted(set(steps))
                and (held is None or not steps or steps[0] > held)):
            raise FormatError(f"{where}: expected a stage plan {{held: step or null, steps: up to {MAX_PLAN_STEPS} "
                              f"increasing steps after it}}, got {raw[:200]!r}")
        return cls(held=held, steps=tuple(steps))


MAX_PLAN_STEPS = 16
MAX_PLAN_BYTES = 4096
TOKEN_BYTES = 32


class PlanBoard:
    """How the rank that watches the stream tells the engine's other tensor-parallel ranks what to stage.

    The watching rank serves a socket (:meth:`serve`); every other rank joins it (:meth:`join`) with the address
    and token the ranks exchanged at initialisation (over the engine's own process group) and is admitted once its
    token matches. :meth:`post` sends a plan to every admitted rank; :meth:`receive` hands a rank the newest plan
    sent to it. A peer that sends anything but the token, or a plan that is not one, is refused (``FormatError``): the
    board only ever carries step numbers, and a step is read and verified from the store by every rank."""

    def __init__(self, *, server: socket.socket | None = None, peer: socket.socket | None = None,
                 token: bytes = b"", expected: int = 0, where: str = "stage plans") -> None:
        self._server = server
        self._peer = peer  # a joining rank's connection
        self._token = token
        self._expected = expected  # ranks to admit (a serving rank)
        self._peers: list[socket.socket] = []
        self._lock = threading.Lock()
        self._closed = threading.Event()
        self._buffer = b""
        self.where = where
        self._accepting: threading.Thread | None = None
        if server is not None:
            self._accepting = threading.Thread(target=self._accept, name="deltasync-plan-board", daemon=True)
            self._accepting.start()

    @classmethod
    def serve(cls, ranks: int, *, host: str = "127.0.0.1") -> PlanBoard:
        """A board for ``ranks`` other ranks, listening on ``host`` (any free port: :attr:`address`)."""
        server = socket.create_server((host, 0))
        server.settimeout(0.5)  # the accepting thread checks for close() this often
        return cls(server=server, token=secrets.token_bytes(TOKEN_BYTES), expected=ranks)

    @property
    def address(self) -> tuple[int, str]:
        """(port, token as hex): what the other ranks need to :meth:`join` (with the serving rank's host)."""
        assert self._server is not None
        return self._server.getsockname()[1], self._token.hex()

    @classmethod
    def join(cls, host: str, port: int, token_hex: str, *, timeout_s: float = 30.0) -> PlanBoard:
        """Join the board served at ``host:port``; raises ``OSError`` when it cannot be reached."""
        token = bytes.fromhex(token_hex)
        peer = socket.create_connection((host, port), timeout=timeout_s)
        peer.sendall(token)
        peer.settimeout(0.5)
        return cls(peer=peer, token=token, where=f"stage plans from {host}:{port}")

    def _accept(self) -> None:
        assert self._server is not None
        while not self._closed.is_set() and len(self._peers) < self._expected:
            try:
                conn, addr = self._server.accept()
            except TimeoutError:
                continue
            except OSError:
                return  # closed
            try:
                conn.settimeout(5.0)
                got = b""
                while len(got) < TOKEN_BYTES:
                    chunk = conn.recv(TOKEN_BYTES - len(got))
                    if not chunk:
                        break
                    got += chunk
                if not hmac.compare_digest(got, self._token):
                    raise FormatError(f"{self.where}: a peer at {addr} sent no valid token: refused")
                conn.settimeout(5.0)  # a rank that stops reading is dropped, never waited for
            except (OSError, FormatError) as e:
                log.warning("deltasync: %s", e)
                conn.close()
                continue
            with self._lock:
                self._peers.append(conn)

    def post(self, plan: StagePlan) -> None:
        """Send ``plan`` to every admitted rank (a rank that cannot take it is dropped, logged)."""
        data = plan.encode()
        with self._lock:
            for conn in list(self._peers):
                try:
                    conn.sendall(data)
                except OSError as e:
                    log.warning("deltasync: a rank stopped hearing stage plans (%s): it stages nothing ahead", e)
                    self._peers.remove(conn)
                    conn.close()

    def receive(self) -> StagePlan | None:
        """The newest plan sent to this rank, waiting up to half a second for one; None when none came."""
        assert self._peer is not None
        try:
            chunk = self._peer.recv(MAX_PLAN_BYTES)
        except TimeoutError:
            return None
        if not chunk:
            raise ConnectionError(f"{self.where}: the watching rank closed the board")
        self._buffer += chunk
        lines = self._buffer.split(b"\n")
        self._buffer = lines.pop()
        if len(self._buffer) > MAX_PLAN_BYTES:
            raise FormatError(f"{self.where}: a stage plan longer than {MAX_PLAN_BYTES} bytes")
        return StagePlan.decode(lines[-1], self.where) if lines else None

    def close(self) -> None:
        self._closed.set()
        with self._lock:
            conns, self._peers = [*self._peers, self._peer, self._server], []
        for conn in conns:
            if conn is not None:
                conn.close()
        if self._accepting is not None:
            self._accepting.join(timeout=5)


class PlanFeed:
    """The plans a :class:`PlanBoard` brings, as a :class:`~deltasync.follow.watch.Polled` source: a rank that does not
    watch the stream drives the follow loop over it. A thread listens to the board; each plan wakes the loop."""

    def __init__(self, board: PlanBoard, policy: PollPolicy | None = None) -> None:
        self.board = board
        self.policy = policy or PollPolicy()
        self.wake = threading.Event()
        self._plan: StagePlan | None = None
        self._error: Exception | None = None
        self._closed = threading.Event()
        self.received = 0  # plans heard
        self._thread = threading.Thread(target=self._listen, name="deltasync-plan-feed", daemon=True)
        self._thread.start()

    def newest(self) -> StagePlan | None:
        """The newest plan heard (None before the first); raises what broke the board, once."""
        error, self._error = self._error, None
        if error is not None:
            raise error
        return self._plan

    def delay(self) -> float:
        return self.policy.push_poll_s  # every plan wakes the loop: this only bounds a wait

    def retry_delay(self, failures: int) -> float:
        return retry_delay_s(failures, poll_s=self.policy.fast_s, max_s=max(self.policy.retry_max_s,
                                                                             self.policy.fast_s))

    def close(self) -> None:
        self._closed.set()
        self.board.close()
        self._thread.join(timeout=5)

    def _listen(self) -> None:
        while not self._closed.is_set():
            try:
                plan = self.board.receive()
            except Exception as e:  # noqa: BLE001 - reported by the loop (newest raises it), then heard no more
                if not self._closed.is_set():
                    self._error = e
                    self.wake.set()
                return
            if plan is not None:
                self._plan = plan
                self.received += 1
                self.wake.set()


class Prefetcher:
    """A background thread keeping up to ``ahead`` prepared steps past ``held()``.

    ``held`` returns the step the engine holds (None: nothing yet, so the chain starts at an anchor).
    ``take(step)`` hands over a prepared step (or None). ``stop()`` ends the thread and drops what it holds.

    With ``plans`` (a :class:`PlanBoard` this rank joined) this rank does not watch the stream: it stages what the
    watching rank posts. Otherwise it watches (``policy``, ``notifier``) and decides, posting each plan to
    ``board`` (the board it serves, if the engine has other ranks).
    """

    def __init__(self, reader: StreamReader, state: WorkerState, held: Callable[[], int | None], *,
                 policy: PollPolicy | None = None, notifier: Notifier | None = None, ahead: int = 2,
                 anchor_deltas: bool = True, board: PlanBoard | None = None, plans: PlanBoard | None = None) -> None:
        self.reader = reader
        self.anchor_deltas = anchor_deltas  # open anchors by their own delta where the engine holds its base
        self.state = state
        self.held = held
        self.ahead = ahead
        self.board = board
        self._posted: StagePlan | None = None
        self.watch: StepWatch | None = None
        self.feed: PlanFeed | None = None
        self._ready: dict[int, Prepared] = {}
        # seconds per step prepared here, by part ("find": the poll and the chain, "prepare": fetch, verify,
        # decode and route, and seal when the engine held the base; "seal": a seal after the engine moved), the
        # last 16 steps: where the time from a commit to a ready step goes
        self.timings: dict[int, dict[str, float]] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._logged: str | None = None
        self._loop: FollowLoop
        if plans is None:
            # one small read per poll, timed by the stream's cadence; at once when a step is pushed (RDMA
            # announcements, an event feed)
            self.watch = StepWatch(reader, policy, notifier=notifier)
            self._loop = FollowLoop(self.watch, self._decide, on_error=self._dropped, on_success=self._recovered,
                                    give_up=False)
            self._wake = self.watch.wake
        else:
            self.feed = PlanFeed(plans, policy)
            self._loop = FollowLoop(self.feed, self._follow_plan, on_error=self._dropped,
                                    on_success=self._recovered, give_up=False)
            self._wake = self.feed.wake
        self._thread = threading.Thread(target=self._loop.run, args=(self._stop,), name="deltasync-prefetch",
                                        daemon=True)
        self._thread.start()

    def has(self, step: int) -> bool:
        """Whether ``step`` is prepared and sealed (an update to it would only write and compare)."""
        with self._lock:
            p = self._ready.get(step)
            return p is not None and p.ready

    def peek(self, step: int) -> Prepared | None:
        with self._lock:
            return self._ready.get(step)

    def take(self, step: int) -> Prepared | None:
        with self._lock:
            return self._ready.pop(step, None)

    def wake(self) -> None:
        """Look again now (the engine moved: seal the next step against its new bits)."""
        self._wake.set()

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout=60)
        if self.watch is not None:
            self.watch.close()
        if self.feed is not None:
            self.feed.close()
        if self.board is not None:
            self.board.close()
        with self._lock:
            self._ready.clear()

    def _dropped(self, e: Exception) -> None:
        """A failed turn: logged once (the update prepares the step itself and reports the error)."""
        if str(e) != self._logged:
            self._logged = str(e)
            log.info("deltasync prefetch: %s: %s (the update will fetch the step itself)", type(e).__name__, e)

    def _recovered(self) -> None:
        self._logged = None

    def _decide(self, latest: int | None) -> None:
        """The watching rank's act: the chain from the step held to ``latest``, the first ``ahead`` steps of it
        posted to the other ranks, then staged here."""
        t0 = time.perf_counter()
        held = self.held()
        if latest is None or latest == held:
            return
        plan = StagePlan(held=held, steps=tuple(self.reader.chain(latest, start=held)[: self.ahead]))
        if self.board is not None and plan != self._posted:
            self.board.post(plan)
            self._posted = plan
        self._stage(plan, find_s=self._loop.poll_s + time.perf_counter() - t0)

    def _follow_plan(self, plan: StagePlan | None) -> None:
        """Another rank's act: stage the newest plan once this rank holds the step it starts from."""
        if plan is not None and plan.steps and plan.held == self.held():
            self._stage(plan, find_s=0.0)

    def _stage(self, plan: StagePlan, *, find_s: float) -> None:
        """Prepare ``plan``'s steps not prepared yet (dropping others), then seal the first against the bits held."""
        held, wanted = plan.held, list(plan.steps)
        with self._lock:
            for s in list(self._ready):
                if s not in wanted:  # the engine moved past it, or the chain changed
                    del self._ready[s]
        for before, s in zip([held, *wanted], wanted, strict=False):  # each step after the one before it
            if self._stop.is_set():
                return
            with self._lock:
                if s in self._ready:
                    continue
            t2 = time.perf_counter()
            # the first step after the one held is sealed as it is decoded (its base is what the engine holds)
            prepared = prepare(self.reader, self.state, s, base=before if self.anchor_deltas else None,
                               held=held if before == held else None)
            with self._lock:
                if self.held() != held:  # the engine moved meanwhile: stage against what it holds now
                    return
                self._ready[s] = prepared
                self._timed(s, find=find_s, prepare=time.perf_counter() - t2)
        self._seal_next(wanted[0], held)

    def _seal_next(self, step: int, held: int | None) -> None:
        """Seal the next step (its base is the step held) against the bits held now, once."""
        with self._lock:
            prepared = self._ready.get(step)
        if prepared is None or prepared.staged is None or prepared.seal is not None:
            return
        if prepared.header.base_step != held or held is None:
            return
        t0 = time.perf_counter()
        sealed = self.state.seal(prepared.staged)
        with self._lock:
            if self.held() == held and self._ready.get(step) is prepared:
                self._ready[step] = replace(prepared, seal=sealed)
                self._timed(step, seal=time.perf_counter() - t0)

    def _timed(self, step: int, **parts: float) -> None:  # under the lock
        self.timings.setdefault(step, {}).update(parts)
        while len(self.timings) > 16:
            del self.timings[min(self.timings)]
