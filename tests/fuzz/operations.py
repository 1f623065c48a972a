"""What the fuzzer does with each mutated stream, and how it judges each result.

Every operation ends in one of three outcomes:

- ``rejected``: it raised a ``DeltaSyncError`` subclass (a ``VerifyReport`` with problems counts too), and
  left nothing behind: no file outside the case's folders, the store untouched, the output folder absent;
- ``exact``: it returned, and what it returned is right: weights bit-identical to the truth recorded when
  the stream was published, ``verify`` ok only when the stream does replay exactly, figures equal to
  those computed here from the truth (or, where the mutation changed what they are read from, well-formed);
- ``failure``: anything else (another exception type, wrong bits, a write outside its folder, a result that
  is not what the operation promises; the runner adds timeouts, memory and crashes).

The references are computed here from the truth and the corpus layout, independently of the library.
"""

from __future__ import annotations

import json
import math
import re
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from .corpus import (
    ANCHOR_EVERY,
    CONSUMER_ID,
    CONSUMER_STEP,
    FAR_FUTURE_UNIX_S,
    LAYER_OF,
    LEASE_OWNER,
    MODEL_FILES,
    TIED,
    Corpus,
)

_CONSUMER_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")  # README: 1-128 letters, digits, '.', '_', '-'
_PLAIN_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._+-]*$")


class Failed(Exception):
    """An operation returned something it must not: ``why`` names the class of failure, ``detail`` the case."""

    def __init__(self, why: str, detail: str = "") -> None:
        super().__init__(f"{why}: {detail}" if detail else why)
        self.why = why
        self.detail = detail


@dataclass
class Outcome:
    op: str
    outcome: str  # "rejected" | "exact" | "failure" | "skipped"
    why: str = ""  # a failure's class (what went wrong, and where)
    detail: str = ""  # the exception or the wrong result, in a line or two
    trace: str = ""  # the traceback's tail
    seconds: float = 0.0
    peak_mib: float = 0.0


@dataclass
class CaseContext:
    """One case's folders: ``root/stream`` (the mutated copy), replay outputs under ``root/replay``."""

    root: Path
    changed: frozenset[str]  # documents (paths in the stream) whose bytes differ from the corpus
    remote_url: str = ""
    state_dict_exact: dict[int, bool] = field(default_factory=dict)

    @property
    def stream(self) -> Path:
        return self.root / "stream"

    @property
    def url(self) -> str:
        return str(self.stream)

    def out_dir(self, step: int) -> Path:
        return self.root / "replay" / f"s{step}" / "a" / "b" / "out"

    @property
    def forged_header(self) -> bool:
        """An object was rewritten and its manifest made to agree with it (the store's own integrity check passes)."""
        return any(rel.endswith(".safetensors") and f"{rel.rsplit('/', 1)[0]}/manifest.json" in self.changed
                   for rel in self.changed)

    def changed_kind(self, prefix: str, suffix: str = "") -> bool:
        return any(rel.startswith(prefix) and rel.endswith(suffix) for rel in self.changed)


# --- references from the truth ---


def bits(t: torch.Tensor) -> np.ndarray:
    t = t.detach().contiguous()
    if not t.numel():
        return np.zeros((0, 1), np.uint8)
    return t.reshape(-1).view(torch.uint8).numpy().reshape(t.numel(), t.element_size())


def changed_elements(a: torch.Tensor, b: torch.Tensor) -> int:
    return int((bits(a) != bits(b)).any(axis=1).sum())


def anchor_of(step: int) -> int:
    return step - step % ANCHOR_EVERY


def same_state(got: Any, want: dict[str, torch.Tensor], what: str, *, aliases_may_differ: bool = False) -> None:
    """Raise ``Failed`` unless ``got`` holds exactly ``want``'s tensors, bit for bit.

    With ``aliases_may_differ`` (a step header was rewritten and its manifest made to agree: a forged but
    consistent object), tied names may be missing or added, as long as each added one is bit-identical to a
    stored tensor.
    """
    if not isinstance(got, dict):
        raise Failed("returned the wrong tensor names", f"{what}: returned a {type(got).__name__}")
    stored = {n: t for n, t in want.items() if n not in TIED}
    names, expected = set(got), set(want)
    if aliases_may_differ:
        expected = set(stored) | (names - set(stored))
        # an alias shares its target's storage (checked against the truth below); else compare its bits
        shared = {(t.data_ptr(), t.dtype, t.shape) for n, t in got.items() if n in stored
                  and isinstance(t, torch.Tensor)}
        for name in names - set(stored):
            g = got[name]
            if isinstance(g, torch.Tensor) and (g.data_ptr(), g.dtype, g.shape) in shared:
                continue
            if not any(isinstance(g, torch.Tensor) and g.dtype == t.dtype and g.shape == t.shape
                       and np.array_equal(bits(g), bits(t)) for t in stored.values()):
                raise Failed("returned an alias that is no stored tensor", f"{what}: {name!r}")
        want = stored  # the aliases are checked
    if names != expected:
        raise Failed("returned the wrong tensor names",
                     f"{what}: returned {sorted(names)[:8]}, expected {sorted(expected)[:8]}")
    for name, w in want.items():
        g = got[name]
        if not isinstance(g, torch.Tensor) or g.dtype != w.dtype or tuple(g.shape) != tuple(w.shape):
            desc = (g.dtype, tuple(g.shape)) if isinstance(g, torch.Tensor) else type(g).__name__
            raise Failed("returned a tensor of the wrong dtype or shape",
                         f"{what}: {name!r} is {desc}, expected {(w.dtype, tuple(w.shape))}")
        if not np.array_equal(bits(g), bits(w)):
            raise Failed("returned wrong bits",
                         f"{what}: {name!r} differs from the truth in {changed_elements(g, w)} elements")


@dataclass
class Reference:
    """What each operation must return for the corpus, computed from the truth and the corpus layout."""

    corpus: Corpus
    object_bytes: dict[int, int]

    @property
    def steps(self) -> tuple[int, ...]:
        return self.corpus.steps

    def stats_rows(self) -> list[tuple]:
        rows = []
        names = self.corpus.names
        numel = sum(self.corpus.truth[0][n].numel() for n in names)
        for s in self.steps:
            anchor = s % ANCHOR_EVERY == 0
            changed = numel if anchor else sum(changed_elements(self.corpus.truth[s - 1][n], self.corpus.truth[s][n])
                                               for n in names)
            rows.append((s, "anchor" if anchor else "delta", None if anchor else s - 1, self.object_bytes[s],
                         self.object_bytes[anchor_of(s)], numel, changed))
        return rows

    def layer_density(self) -> tuple[tuple[str, ...], tuple[tuple[float | None, ...], ...]]:
        layers = tuple(dict.fromkeys(LAYER_OF[n] for n in self.corpus.names))
        grid = []
        for layer in layers:
            row: list[float | None] = []
            members = [n for n in self.corpus.names if LAYER_OF[n] == layer]
            for s in self.steps:
                if s % ANCHOR_EVERY == 0:
                    row.append(None)
                    continue
                total = sum(self.corpus.truth[s][n].numel() for n in members)
                diff = sum(changed_elements(self.corpus.truth[s - 1][n], self.corpus.truth[s][n]) for n in members)
                row.append(diff / total if total else 0.0)
            grid.append(tuple(row))
        return layers, tuple(grid)

    def compare(self, a: int, b: int) -> list[tuple[str, int, int]]:
        t = self.corpus.truth
        return [(n, t[a][n].numel(), changed_elements(t[a][n], t[b][n])) for n in self.corpus.names]

    def gc_plan(self) -> tuple[set[int], set[int]]:
        """keep_last=1 and one live consumer at CONSUMER_STEP: (kept, deleted)."""
        keep: set[int] = set()
        for s in {self.steps[-1], *[s for s in self.steps if s >= CONSUMER_STEP]}:
            keep.update(range(anchor_of(s), s + 1))
        return keep, set(self.steps) - keep


# --- the operations (each imports the library itself: a worker sets NUMBA_NUM_THREADS before numba loads) ---


def operations(corpus: Corpus) -> list[tuple[str, Callable[[CaseContext, Reference], None]]]:
    """(name, run-and-check) for every operation a case runs, in order (state dicts first: verify's check uses them)."""
    last = corpus.last
    ops: list[tuple[str, Callable[[CaseContext, Reference], None]]] = []
    for s in corpus.steps:
        ops.append((f"state_dict@{s}", lambda c, r, s=s: op_state_dict(c, r, s)))
    ops += [
        (f"remote_state_dict@{last}", op_remote),
        ("verify", op_verify),
        *[(f"replay@{s}", lambda c, r, s=s: op_replay(c, r, s)) for s in (2, 3, last)],
        ("gc_dry_run", op_gc),
        ("follower_sync", op_follow),
        ("latest_step", op_latest),
        ("stream_stats", op_stats),
        ("layer_density", op_layer_density),
        (f"compare@1-{last}", lambda c, r: op_compare(c, r, 1, last)),
        (f"compare@3-{last}", lambda c, r: op_compare(c, r, 3, last)),
        ("read_heartbeats", op_heartbeats),
        ("read_lease", op_lease),
    ]
    return ops


def op_state_dict(c: CaseContext, r: Reference, step: int) -> None:
    from deltasync import StreamReader

    c.state_dict_exact[step] = False
    same_state(StreamReader(c.url).state_dict(step), r.corpus.truth[step], f"state_dict({step})",
               aliases_may_differ=c.forged_header)
    c.state_dict_exact[step] = True


def op_remote(c: CaseContext, r: Reference) -> None:
    """The reader of a remote store downloads into its cache: the object names from the store make its paths."""
    import fsspec

    from deltasync import StreamReader

    fs = fsspec.filesystem("memory")
    for p in sorted(c.stream.rglob("*")):
        if p.is_file():
            fs.pipe_file(f"{c.remote_url}/{p.relative_to(c.stream).as_posix()}", p.read_bytes())
    try:
        reader = StreamReader(f"memory://{c.remote_url}", cache_dir=c.root / "cache")
        same_state(reader.state_dict(r.corpus.last), r.corpus.truth[r.corpus.last], "remote state_dict",
                   aliases_may_differ=c.forged_header)
    finally:
        fs.rm(c.remote_url, recursive=True)


def op_verify(c: CaseContext, r: Reference) -> None:
    from deltasync import verify

    report = verify(c.url)
    if not report.ok:
        raise _Rejected(f"verify found {len(report.problems)} problem(s): {report.problems[0].message[:200]}")
    broken = [s for s in r.steps if not c.state_dict_exact.get(s)]
    if broken:
        raise Failed("verify passed a stream that a reader refuses or reads wrong",
                     f"state_dict({broken[0]}) does not give the truth")
    if tuple(report.verified) != r.steps:
        raise Failed("verify is ok without verifying every step",
                     f"verified {report.verified}, the stream holds {r.steps}")


class _Rejected(Exception):
    """A result that counts as a rejection (a report with problems)."""


def op_replay(c: CaseContext, r: Reference, step: int) -> None:
    import safetensors.torch

    from deltasync import replay_to_folder

    out = c.out_dir(step)
    out.parent.mkdir(parents=True)
    result = replay_to_folder(c.url, step, out)
    if Path(result.path) != out or result.step != step:
        raise Failed("replay reported another path or step",
                     f"{result.path} step {result.step}, asked for {out} step {step}")
    names = {p.name for p in out.iterdir()}
    weights = out / "model.safetensors"
    if not weights.is_file():
        raise Failed("replay wrote no model.safetensors", f"the folder holds {sorted(names)}")
    want = {n: t for n, t in r.corpus.truth[step].items() if n not in TIED}
    same_state(safetensors.torch.load_file(str(weights)), want, f"replayed model.safetensors of step {step}")
    files = c.stream / "files"
    stored = {p.name: p.read_bytes() for p in files.iterdir() if p.is_file()} if files.is_dir() else {}
    for name in names - {"model.safetensors"}:
        if not _PLAIN_NAME.match(name) or stored.get(name) != (out / name).read_bytes():
            raise Failed("replay wrote a model file that is not a stored one", repr(name))
    if not c.changed_kind("files"):
        expected = set(MODEL_FILES) | {"model.safetensors"}
        if names != expected:
            raise Failed("replay wrote the wrong set of files", f"{sorted(names)}, expected {sorted(expected)}")


def op_gc(c: CaseContext, r: Reference) -> None:
    from deltasync import collect_garbage

    plan = collect_garbage(c.url, keep_last=1, dry_run=True)
    keep, delete = set(plan.keep), set(plan.delete)
    if keep & delete or keep | delete != set(r.steps) or r.corpus.last not in keep:
        raise Failed("gc plan is inconsistent", f"keeps {sorted(keep)} and deletes {sorted(delete)} of steps {r.steps}")
    if not (c.changed_kind("steps/", "manifest.json") or c.changed_kind("consumers/")):
        want_keep, want_delete = r.gc_plan()
        if keep != want_keep or delete != want_delete:
            raise Failed("gc plan differs from the truth",
                         f"keeps {sorted(keep)} deletes {sorted(delete)}; expected keep {sorted(want_keep)}")


def op_follow(c: CaseContext, r: Reference) -> None:
    from rollout_loader import Follower, StateDictTarget

    follower = Follower(c.url, StateDictTarget())
    follower.sync()
    if follower.step != r.corpus.last:
        raise Failed("follower sync() stopped short of the latest step",
                     f"holds {follower.step}, latest is {r.corpus.last}")
    same_state(follower.target.state_dict(), r.corpus.truth[r.corpus.last], "follower state",
               aliases_may_differ=c.forged_header)


def op_latest(c: CaseContext, r: Reference) -> None:
    from deltasync import Store

    got = Store(c.url).latest_step()
    if got != r.corpus.last:
        raise Failed("latest_step() is not the latest committed step", f"{got!r}, expected {r.corpus.last}")


def _finite(x: Any, *, optional: bool = False) -> bool:
    if x is None:
        return optional
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def _count(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x >= 0


def op_stats(c: CaseContext, r: Reference) -> None:
    from deltasync import stream_stats

    stats = stream_stats(c.url)
    stats.summary()
    try:
        json.dumps(stats.to_dict(), allow_nan=False)  # `deltasync stats --json` must print JSON
    except ValueError as e:
        raise Failed("stream_stats returned a non-finite number", str(e)) from None
    if not c.changed_kind("steps/"):
        got = [(s.step, s.kind, s.base_step, s.object_bytes, s.full_bytes, s.numel, s.changed) for s in stats.steps]
        if got != r.stats_rows():
            raise Failed("stream_stats differs from the truth", f"{got[:2]}... expected {r.stats_rows()[:2]}...")
        return
    for s in stats.steps:
        ok = (s.kind in ("anchor", "delta") and _count(s.step) and (s.base_step is None or _count(s.base_step))
              and _count(s.object_bytes) and _count(s.numel) and _count(s.changed) and _finite(s.density)
              and _finite(s.capture_s, optional=True) and _finite(s.encode_s, optional=True)
              and _finite(s.created_unix_s)
              and all(_count(x) for x in s.coalesced_steps))
        if not ok:
            raise Failed("stream_stats accepted a malformed manifest", str(s)[:300])


def op_layer_density(c: CaseContext, r: Reference) -> None:
    from deltasync.history import layer_density

    d = layer_density(c.url)
    layers, grid = r.layer_density()
    if not c.changed_kind("steps/"):
        if (tuple(d.layers), tuple(d.steps), tuple(tuple(row) for row in d.density)) != (layers, r.steps, grid):
            raise Failed("layer_density differs from the truth", f"{d.density} expected {grid}")
        return
    for row in d.density:
        if not all(v is None or (_finite(v) and 0 <= v <= 1) for v in row):
            raise Failed("layer_density returned densities outside [0, 1]", str(row)[:300])


def op_compare(c: CaseContext, r: Reference, a: int, b: int) -> None:
    from deltasync import compare

    got = compare(c.url, a, b)
    rows = [(t.name, t.numel, t.changed) for t in got.tensors]
    if rows != r.compare(a, b):
        raise Failed("compare differs from the truth",
                     f"({a}, {b}) per tensor (name, numel, changed) {rows[:3]}... expected {r.compare(a, b)[:3]}...")
    if sum(layer.changed for layer in got.layers) != sum(x[2] for x in rows):
        raise Failed("compare's layers do not add up to its tensors", f"({a}, {b})")


def op_heartbeats(c: CaseContext, r: Reference) -> None:
    from deltasync import Store
    from deltasync.follow.consumers import read_heartbeats

    beats = read_heartbeats(Store(c.url))
    got = [(b.consumer_id, b.step, b.updated_unix_s) for b in beats]
    if not c.changed_kind("consumers/"):
        if got != [(CONSUMER_ID, CONSUMER_STEP, FAR_FUTURE_UNIX_S)]:
            raise Failed("read_heartbeats differs from the stored heartbeat", str(got))
        return
    for consumer_id, step, updated in got:
        if not (isinstance(consumer_id, str) and _CONSUMER_ID.match(consumer_id) and consumer_id == CONSUMER_ID
                and _count(step) and _finite(updated)):
            raise Failed("read_heartbeats accepted an invalid heartbeat", f"consumers/{CONSUMER_ID}.json gave "
                         f"consumer_id={str(consumer_id)[:80]!r} step={str(step)[:40]} updated_unix_s={updated!r}")


def op_lease(c: CaseContext, r: Reference) -> None:
    from deltasync import Store

    lease = Store(c.url).lease()
    if "writer.json" not in c.changed:
        if lease is None or (lease.owner, lease.expires_unix_s) != (LEASE_OWNER, FAR_FUTURE_UNIX_S):
            raise Failed("lease() differs from the stored lease", repr(lease))
        return
    # an unreadable lease may come back as a placeholder held forever (inf): it claims nothing false
    if lease is not None and not (isinstance(lease.owner, str) and 0 < len(lease.owner) <= 256
                                  and isinstance(lease.expires_unix_s, float) and not math.isnan(lease.expires_unix_s)):
        raise Failed("lease() accepted an invalid writer.json",
                     f"owner={str(lease.owner)[:80]!r} expires_unix_s={lease.expires_unix_s!r}")


# --- classification ---


LIBRARY = ("/deltasync/", "/rollout_loader/")


def library_frame(frames: list[tuple[str, int, str]], packages: tuple[str, ...] = LIBRARY) -> str:
    """The innermost (last) of ``(file, line, function)`` frames in ``packages`` (the library by default),
    as ``path:line function``."""
    for filename, lineno, name in reversed(frames):
        f = filename.replace("\\", "/")
        for pkg in packages:
            if pkg in f:
                return f"{pkg.strip('/')}/{f.split(pkg, 1)[1]}:{lineno} {name}"
    return "outside the library"


def classify(op: str, run: Callable[[], None]) -> Outcome:
    """Run one operation (its checks included) and say which outcome it had."""
    from deltasync import DeltaSyncError

    try:
        run()
    except Failed as e:
        return Outcome(op, "failure", why=e.why, detail=e.detail[:2000])
    except _Rejected as e:
        return Outcome(op, "rejected", detail=str(e))
    except DeltaSyncError as e:
        return Outcome(op, "rejected", detail=f"{type(e).__name__}: {str(e)[:300]}")
    except BaseException as e:  # noqa: BLE001 - every other exception is what the fuzzer looks for
        if isinstance(e, KeyboardInterrupt):
            raise
        frames = [(f.filename, f.lineno or 0, f.name) for f in traceback.extract_tb(e.__traceback__)]
        where = library_frame(frames)
        if where == "outside the library":  # raised by the checks on a result (or a bug of the fuzzer)
            where = f"{library_frame(frames, ('/tests/fuzz/',))} (the fuzzer's check of the result)"
        text = "".join(traceback.format_exception(type(e), e, e.__traceback__))
        return Outcome(op, "failure", why=f"{type(e).__name__} at {where}",
                       detail=f"{type(e).__name__}: {str(e)[:500]}",
                       trace=_tail(text))
    return Outcome(op, "exact")


def _tail(text: str, lines: int = 30) -> str:
    return "\n".join(text.rstrip().splitlines()[-lines:])
