"""Running cases: worker processes reused until they die, each case bounded in time and memory.

A worker (a fresh interpreter: ``spawn``) first runs every operation on the
unmutated corpus: that warms it up and proves the oracle (every operation must be ``exact`` there, or
the run stops). It then limits its address space (``RLIMIT_AS``: its size after warm-up plus
``memory_mib``) and runs cases sent by the parent, one at a time, reporting each operation before it
starts. The parent kills a worker whose operation runs past ``op_timeout_s`` (a faulthandler dump names
where it hung) and starts another; a worker that dies is a crash. Each operation's peak resident memory
is measured (``/proc/self/clear_refs``): growth past ``rss_limit_mib`` is a failure, since the whole
corpus is a few hundred kilobytes. Workers are recycled after a memory failure.
"""

from __future__ import annotations

import faulthandler
import logging
import multiprocessing
import multiprocessing.connection
import os
import re
import resource
import shutil
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from .cases import Pristine, case
from .corpus import Corpus, build_corpus, load_truth, save_truth
from .mutations import apply, documents, read_document
from .operations import LIBRARY, CaseContext, Outcome, Reference, classify, library_frame, operations
from .report import Report

CASES_PER_WORKER = 300  # then a fresh worker: what one case leaks cannot pile up
APPLY_TIMEOUT_FACTOR = 3  # applying a mutation (an 85 MiB header, say) is the fuzzer's own work: more time
APPLYING = "(applying the mutation)"


@dataclass(frozen=True, kw_only=True)
class Options:
    seed: int = 0
    budget_s: float = 60.0  # no new case starts after this; running ones finish (each within op_timeout_s)
    workers: int = 2
    max_cases: int | None = None
    min_cases: int = 0  # cases that run even past the budget (the CI run: every directed case, every mutator once)
    start_index: int = 0
    op_timeout_s: float = 10.0  # per operation of a case (and for applying the mutation)
    memory_mib: int = 2048  # address space a worker may add after warm-up (RLIMIT_AS)
    rss_limit_mib: int = 512  # peak resident memory one operation may add
    tail_changes: bool = True
    keep_results: bool = False


class CorpusError(RuntimeError):
    """The unmutated corpus does not pass its own checks: nothing can be judged against it."""


# --- worker side ---


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return 0


def _reset_peak() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _listing(root: Path) -> dict[str, tuple[int, int]]:
    out = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            p = os.path.join(dirpath, name)
            try:
                st = os.lstat(p)
            except FileNotFoundError:
                continue
            out[os.path.relpath(p, root)] = (st.st_size if not os.path.isdir(p) else -1, st.st_mtime_ns)
    return out


def _allowed(op: str, rel: str, outcome: str) -> bool:
    """Paths an operation may create in its case folder: a replay's output (when it succeeded) and the folders
    the fuzzer made for it, the remote reader's cache."""
    if op.startswith("replay@"):
        s = f"replay/s{op.split('@')[1]}"
        made = {"replay", s, f"{s}/a", f"{s}/a/b"}
        return rel in made or (outcome == "exact" and (rel == f"{s}/a/b/out" or rel.startswith(f"{s}/a/b/out/")))
    return op.startswith("remote") and (rel == "cache" or rel.startswith("cache/"))


class _Worker:
    def __init__(self, conn: multiprocessing.connection.Connection, root: Path, truth: Path, options: Options) -> None:
        self.conn = conn
        self.options = options
        self.corpus = load_truth(truth)
        self.pristine = {d.rel: read_document(self.corpus.stream, d.rel) for d in documents(self.corpus.stream)}
        objects = {int(p.parent.name): p.stat().st_size for p in self.corpus.stream.glob("steps/*/*.safetensors")}
        self.reference = Reference(corpus=self.corpus, object_bytes=objects)
        self.ops = operations(self.corpus)
        self.cases_dir = root / "cases"
        self.tmp = Path(tempfile.mkdtemp(prefix=f"worker-{os.getpid()}-tmp-", dir=root))
        os.environ["TMPDIR"] = str(self.tmp)  # what the library leaves in the temp folder is found and counted
        tempfile.tempdir = str(self.tmp)
        self.trace_path = root / f"worker-{os.getpid()}.trace"
        self.trace = open(self.trace_path, "w+")
        self.peak_ok = _reset_peak()

    def run_case(self, spec: dict[str, Any] | None) -> tuple[list[Outcome], bool]:
        """Run every operation on a fresh copy of the corpus (mutated by ``spec``); (outcomes, recycle me)."""
        name = spec["id"] if spec else f"pristine-{os.getpid()}"
        root = self.cases_dir / name
        shutil.rmtree(root, ignore_errors=True)
        root.mkdir(parents=True)
        shutil.copytree(self.corpus.stream, root / "stream")
        if spec:
            self._arm(APPLY_TIMEOUT_FACTOR * self.options.op_timeout_s)
            try:
                apply(spec, root / "stream", root)
            finally:
                faulthandler.cancel_dump_traceback_later()
        changed = frozenset(rel for rel in {*self.pristine, *(p.relative_to(root / "stream").as_posix()
                                                              for p in (root / "stream").rglob("*") if p.is_file())}
                            if read_document(root / "stream", rel) != self.pristine.get(rel))
        ctx = CaseContext(root=root, changed=changed, remote_url=f"fuzz-{os.getpid()}-{name}")
        outcomes: list[Outcome] = []
        recycle = False
        try:
            for op, fn in self.ops:
                if recycle:
                    outcomes.append(Outcome(op, "skipped"))
                    continue
                self.conn.send(("op", op))
                self._arm(self.options.op_timeout_s)
                try:
                    outcome = self._run_op(op, fn, ctx)
                finally:
                    faulthandler.cancel_dump_traceback_later()
                outcomes.append(outcome)
                recycle = outcome.why.startswith(("memory:", "MemoryError"))
        finally:
            shutil.rmtree(root, ignore_errors=True)
        return outcomes, recycle

    def _arm(self, timeout_s: float) -> None:
        """Dump every thread's stack shortly before the parent kills this worker for running too long."""
        self.trace.seek(0)
        self.trace.truncate()
        faulthandler.dump_traceback_later(max(1.0, timeout_s - 0.5), file=self.trace)

    def _run_op(self, op: str, fn: Any, ctx: CaseContext) -> Outcome:
        before = _listing(ctx.root)
        self._reset_peak_memory()
        base_kib = _status_kib("VmRSS")
        t0 = time.perf_counter()
        outcome = classify(op, lambda: fn(ctx, self.reference))
        outcome.seconds = time.perf_counter() - t0
        outcome.peak_mib = (_status_kib("VmHWM") - base_kib) / 1024 if self.peak_ok else 0.0
        after = _listing(ctx.root)
        touched = sorted(rel for rel in set(before) | set(after) if before.get(rel) != after.get(rel))
        in_store = [rel for rel in touched if rel == "stream" or rel.startswith("stream/")]
        stray = [rel for rel in touched if rel not in in_store and not _allowed(op, rel, outcome.outcome)]
        left = sorted(os.listdir(self.tmp))
        problem = None
        if outcome.peak_mib > self.options.rss_limit_mib:
            problem = (f"memory: peak resident memory grew by more than {self.options.rss_limit_mib} MiB",
                       f"+{outcome.peak_mib:.0f} MiB "
                       f"({outcome.outcome}{': ' + outcome.detail[:200] if outcome.detail else ''})")
        elif in_store:
            problem = ("modified the store", f"{in_store[:5]}")
        elif stray and outcome.outcome == "rejected":
            problem = ("left files behind after a rejection (output folder or its parent)", f"{stray[:5]}")
        elif stray:
            problem = ("wrote outside its output folder", f"{stray[:5]}")
        elif left:
            problem = ("left files in the temporary folder", f"{left[:5]}")
        for name in left:
            shutil.rmtree(self.tmp / name, ignore_errors=True)
            (self.tmp / name).unlink(missing_ok=True)
        if op.startswith("remote"):
            shutil.rmtree(ctx.root / "cache", ignore_errors=True)
        if problem and outcome.outcome != "failure":
            outcome.outcome, (outcome.why, extra) = "failure", problem
            outcome.detail = f"{extra}; {outcome.detail}" if outcome.detail else extra
        return outcome

    def _reset_peak_memory(self) -> None:
        if self.peak_ok:
            _reset_peak()

    def serve(self) -> None:
        outcomes, _ = self.run_case(None)
        bad = [o for o in outcomes if o.outcome != "exact"]
        if bad:
            self.conn.send(("broken", [asdict(o) for o in bad]))
            return
        vsize = _status_kib("VmSize") << 10
        soft, hard = resource.getrlimit(resource.RLIMIT_AS)
        limit = vsize + (self.options.memory_mib << 20)
        resource.setrlimit(resource.RLIMIT_AS, (limit if hard == resource.RLIM_INFINITY else min(limit, hard), hard))
        self.conn.send(("ready", {"pid": os.getpid(), "trace": str(self.trace_path)}))
        for k in range(CASES_PER_WORKER):
            msg = self.conn.recv()
            if msg[0] == "stop":
                return
            spec = msg[1]
            outcomes, recycle = self.run_case(spec)
            last = recycle or k == CASES_PER_WORKER - 1  # said with the result: the parent sends it nothing more
            self.conn.send(("result", spec["id"], [asdict(o) for o in outcomes], last))
            if last:
                return


def worker_main(conn: multiprocessing.connection.Connection, root: str, truth: str, options: Options) -> None:
    # one thread per kernel: the workers share the cores, and numba's parallel regions on tiny tensors stall
    # (tens of milliseconds each) whenever another process holds a core
    os.environ["NUMBA_NUM_THREADS"] = "1"
    import torch

    torch.set_num_threads(1)
    logging.disable(logging.CRITICAL)  # the library's warnings about damaged documents are expected here
    worker = _Worker(conn, Path(root), Path(truth), options)
    try:
        worker.serve()
    finally:
        shutil.rmtree(worker.tmp, ignore_errors=True)
        worker.trace.close()
        Path(worker.trace_path).unlink(missing_ok=True)
        conn.close()


# --- parent side ---


@dataclass
class _Slot:
    proc: multiprocessing.process.BaseProcess
    conn: multiprocessing.connection.Connection
    ready: bool = False
    trace: str = ""
    spec: dict[str, Any] | None = None
    op: str = "(before the first operation)"
    started: float = 0.0
    leaving: bool = False  # its last result came: it exits by itself


def _context() -> multiprocessing.context.BaseContext:
    # spawn, not fork (the parent has threads) nor forkserver (it outlives the run, with a temporary folder)
    return multiprocessing.get_context("spawn")


def hang_location(trace: str) -> str:
    """Where a timed-out worker was: the innermost library (or fuzzer) frame of a thread that was running
    library (or fuzzer) code, rather than waiting for another thread."""
    packages = (*LIBRARY, "/tests/fuzz/")
    blocks = re.split(r"\n(?=(?:Current thread|Thread) 0x)", trace)
    threads = [re.findall(r'File "([^"]+)", line (\d+) in (\S+)', b) for b in blocks]
    busy = [fr for fr in threads if fr and any(p in fr[0][0] for p in packages)]
    for frames in busy + threads:
        # faulthandler: innermost first
        where = library_frame([(f, int(n), fn) for f, n, fn in reversed(frames)], packages)
        if where != "outside the library":
            return where
    return "an unknown place"


class _Pool:
    """The parent's view of the workers: which is starting, idle or busy with which case and operation."""

    def __init__(self, options: Options, root: Path, truth: Path) -> None:
        self.options, self.root, self.truth = options, root, truth
        self.ctx = _context()
        # one worker first: its warm-up compiles and caches the numba kernels; workers compiling them at the
        # same time can load each other's half-written cache files (a segfault)
        self.slots: list[_Slot] = [self._start()]
        self.requeue: list[dict[str, Any]] = []  # cases sent to a worker that had just exited

    def _start(self) -> _Slot:
        parent, child = self.ctx.Pipe()
        proc = self.ctx.Process(target=worker_main, args=(child, str(self.root), str(self.truth), self.options),
                                daemon=True)
        proc.start()
        child.close()
        return _Slot(proc=proc, conn=parent, started=time.monotonic())

    def idle(self) -> list[_Slot]:
        return [s for s in self.slots if s.ready and s.spec is None and s.proc.is_alive()]

    def busy(self) -> bool:
        return any(s.spec is not None for s in self.slots)

    def send(self, slot: _Slot, spec: dict[str, Any]) -> None:
        slot.spec, slot.op, slot.started = spec, APPLYING, time.monotonic()
        try:
            slot.conn.send(("case", spec))
        except OSError:  # it exited (recycled) since it said it was idle: another worker takes the case
            slot.spec, slot.ready = None, False
            self.requeue.append(spec)

    def poll(self, report: Report, timeout_s: float) -> None:
        if len(self.slots) < self.options.workers and any(s.ready for s in self.slots):
            self.slots += [self._start() for _ in range(self.options.workers - len(self.slots))]
        waitables = [s.conn for s in self.slots] + [s.proc.sentinel for s in self.slots]
        multiprocessing.connection.wait(waitables, timeout=timeout_s)
        for i, slot in enumerate(list(self.slots)):
            self._read(slot, report)
            now = time.monotonic()
            limit = self.options.op_timeout_s * (APPLY_TIMEOUT_FACTOR if slot.op == APPLYING else 1)
            if slot.spec is not None and now - slot.started > limit:
                slot.proc.kill()
                slot.proc.join()
                self._read(slot, report)  # a result that arrived just in time still counts
                if slot.spec is not None:
                    trace = Path(slot.trace).read_text() if slot.trace and Path(slot.trace).exists() else ""
                    self._lost(report, slot, f"timeout in {hang_location(trace)}", f"no result within {limit:.0f}s",
                               trace)
            elif slot.proc.is_alive():
                if not slot.ready and not slot.leaving and now - slot.started > 300:
                    raise CorpusError("a fuzz worker did not start within 300 s")
                continue
            slot.proc.join()
            self._read(slot, report)
            if slot.spec is not None and slot.proc.exitcode == 0 and slot.op == APPLYING:
                self.requeue.append(slot.spec)  # it left before taking the case
                slot.spec = None
            elif slot.spec is not None:
                self._lost(report, slot, f"crash: the worker died with exit code {slot.proc.exitcode}",
                           f"exit code {slot.proc.exitcode} during {slot.op}", "")
            elif not slot.ready and not slot.leaving:
                raise CorpusError(f"a fuzz worker died while starting (exit code {slot.proc.exitcode})")
            slot.conn.close()
            self.slots[i] = self._start()

    def _read(self, slot: _Slot, report: Report) -> None:
        try:
            while slot.conn.poll():
                msg = slot.conn.recv()
                if msg[0] == "ready":
                    slot.ready, slot.trace = True, msg[1]["trace"]
                elif msg[0] == "broken":
                    raise CorpusError(_broken_text(msg[1]))
                elif msg[0] == "op":
                    slot.op, slot.started = msg[1], time.monotonic()  # the time limit is per operation
                elif msg[0] == "result":
                    report.add(slot.spec, msg[2], keep=self.options.keep_results)
                    slot.spec = None
                    if msg[3]:  # recycled: it exits now
                        slot.ready, slot.leaving = False, True
        except (EOFError, OSError):
            pass

    def _lost(self, report: Report, slot: _Slot, why: str, detail: str, trace: str) -> None:
        outcomes = [asdict(Outcome(slot.op, "failure", why=why, detail=detail,
                                   trace="\n".join(trace.splitlines()[:40])))]
        report.add(slot.spec, outcomes, keep=self.options.keep_results)
        shutil.rmtree(self.root / "cases" / slot.spec["id"], ignore_errors=True)
        slot.spec = None

    def close(self) -> None:
        for slot in self.slots:
            try:
                if slot.proc.is_alive() and slot.ready and slot.spec is None:
                    slot.conn.send(("stop",))
                    slot.proc.join(timeout=10)
            except OSError:
                pass
            if slot.proc.is_alive():
                slot.proc.kill()
            slot.proc.join()
            slot.conn.close()


def _broken_text(outcomes: list[dict[str, Any]]) -> str:
    lines = ["the unmutated corpus stream does not pass its own checks (a library defect on honest input, or the "
             "fuzzer's oracle is wrong); nothing can be judged against it:"]
    for o in outcomes:
        lines.append(f"  {o['op']}: {o['outcome']}: {o['why']}: {o['detail'][:400]}")
    return "\n".join(lines)


def run(options: Options, *, corpus: Corpus | None = None, work_dir: Path | None = None,
        on_case: Any = None) -> Report:
    """Fuzz until ``options.budget_s`` has passed (or ``max_cases`` ran); returns the counts and failure classes.

    Works in a fresh temporary folder (removed afterwards); ``corpus`` reuses an already published one.
    """
    root = Path(tempfile.mkdtemp(prefix="deltasync-fuzz-", dir=work_dir))
    t0 = time.monotonic()
    pool = None
    try:
        if corpus is None:
            (root / "corpus").mkdir()
            corpus = build_corpus(root / "corpus", tail_changes=options.tail_changes)
        save_truth(corpus, root / "truth.pt")
        pristine = Pristine.load(corpus.stream)
        report = Report(seed=options.seed, corpus_digest=corpus.digest)
        pool = _Pool(options, root, root / "truth.pt")
        index, sent = options.start_index, 0
        deadline = t0 + options.budget_s
        try:
            while True:
                more = (time.monotonic() < deadline or sent < options.min_cases) and (
                    options.max_cases is None or sent < options.max_cases)
                for slot in pool.idle():
                    if pool.requeue:
                        pool.send(slot, pool.requeue.pop())
                    elif more and (options.max_cases is None or sent < options.max_cases):
                        pool.send(slot, case(options.seed, index, pristine))
                        index, sent = index + 1, sent + 1
                if not more and not pool.busy() and not pool.requeue:
                    break
                done = report.cases
                pool.poll(report, 0.1)
                if on_case and report.cases != done:
                    on_case(report)
        except KeyboardInterrupt:  # a long run stopped by hand still reports what it found
            report.interrupted = True
        report.seconds = time.monotonic() - t0
        return report
    finally:
        if pool is not None:
            pool.close()
        shutil.rmtree(root, ignore_errors=True)
