"""Counting what a fuzz run found: outcomes per mutator and document kind, and failure classes with the first
example of each (its mutation, operation, error and traceback tail, and the command that replays it)."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from .mutations import describe

OUTCOMES = ("rejected", "exact", "failure")


@dataclass
class FailureClass:
    key: str  # an exception and where the library raised it, or "operation: what went wrong"
    ops: int = 0
    cases: set[str] = field(default_factory=set)
    operations: set[str] = field(default_factory=set)
    first: dict[str, Any] = field(default_factory=dict)
    examples: list[str] = field(default_factory=list)  # up to 20: "case op: mutation"


def class_key(op: str, why: str) -> str:
    """Failures with one cause share a class whichever operation met them: an exception raised at one place in
    the library, a timeout in one place, a crash; the others (wrong results, stray files, memory) are per operation."""
    if why.startswith(("timeout in ", "crash:")) or (" at " in why and not why.startswith("memory:")):
        return why
    return f"{op.split('@')[0]}: {why}"


@dataclass
class Report:
    seed: int
    corpus_digest: str
    cases: int = 0
    seconds: float = 0.0
    interrupted: bool = False
    by_mutator: Counter = field(default_factory=Counter)  # (mutator, outcome) -> operations
    by_kind: Counter = field(default_factory=Counter)  # (document kind, outcome) -> operations
    cases_by_mutator: Counter = field(default_factory=Counter)
    failed_cases_by_mutator: Counter = field(default_factory=Counter)
    classes: dict[str, FailureClass] = field(default_factory=dict)
    failed_case_ids: list[str] = field(default_factory=list)
    results: list[dict[str, Any]] = field(default_factory=list)  # kept only when asked (replay)
    op_seconds: Counter = field(default_factory=Counter)  # operation -> seconds, summed over cases
    slowest: list[tuple[float, str, str]] = field(default_factory=list)  # (seconds, case id, mutation), top 10

    @property
    def failures(self) -> int:
        return sum(n for (_, outcome), n in self.by_mutator.items() if outcome == "failure")

    def add(self, spec: dict[str, Any], outcomes: list[dict[str, Any]], *, keep: bool = False) -> None:
        self.cases += 1
        m = spec["mutator"]
        self.cases_by_mutator[m] += 1
        failed = False
        seconds = sum(o["seconds"] for o in outcomes)
        self.slowest = sorted([*self.slowest, (round(seconds, 2), spec["id"], describe(spec))], reverse=True)[:10]
        for o in outcomes:
            self.op_seconds[o["op"].split("@")[0]] += o["seconds"]
            if o["outcome"] not in OUTCOMES:
                continue
            self.by_mutator[m, o["outcome"]] += 1
            self.by_kind[spec["kind"], o["outcome"]] += 1
            if o["outcome"] == "failure":
                failed = True
                key = class_key(o["op"], o["why"])
                fc = self.classes.setdefault(key, FailureClass(key))
                fc.ops += 1
                if spec["id"] not in fc.cases and len(fc.examples) < 20:
                    fc.examples.append(f"{spec['id']} {o['op']}: {describe(spec)}")
                fc.cases.add(spec["id"])
                fc.operations.add(o["op"].split("@")[0])
                if not fc.first:
                    fc.first = {"case": spec["id"], "mutation": describe(spec), "directed": spec.get("directed"),
                                "op": o["op"], "detail": o["detail"], "trace": o["trace"]}
        if failed:
            self.failed_cases_by_mutator[m] += 1
            if len(self.failed_case_ids) < 500:
                self.failed_case_ids.append(spec["id"])
        if keep:
            self.results.append({"case": spec, "mutation": describe(spec), "outcomes": outcomes})

    def table(self) -> str:
        """Operations per outcome, by mutator and by document kind."""
        lines = [f"{'mutator':<14}{'cases':>7}{'rejected':>10}{'exact':>8}{'failure':>9}{'failed cases':>14}"]
        for m in sorted(self.cases_by_mutator):
            lines.append(f"{m:<14}{self.cases_by_mutator[m]:>7}" + "".join(
                f"{self.by_mutator[m, o]:>{w}}" for o, w in zip(OUTCOMES, (10, 8, 9), strict=True))
                         + f"{self.failed_cases_by_mutator[m]:>14}")
        totals = [sum(n for (_, o2), n in self.by_mutator.items() if o2 == o) for o in OUTCOMES]
        lines.append(f"{'total':<14}{self.cases:>7}"
                     + "".join(f"{t:>{w}}" for t, w in zip(totals, (10, 8, 9), strict=True))
                     + f"{sum(self.failed_cases_by_mutator.values()):>14}")
        lines.append("")
        lines.append(f"{'document':<14}{'':>7}{'rejected':>10}{'exact':>8}{'failure':>9}")
        for kind in sorted({k for k, _ in self.by_kind}):
            lines.append(f"{kind:<14}{'':>7}"
                         + "".join(f"{self.by_kind[kind, o]:>{w}}" for o, w in zip(OUTCOMES, (10, 8, 9), strict=True)))
        return "\n".join(lines)

    def failure_text(self, *, traces: bool = True) -> str:
        """Every failure class, most frequent first, with its first example."""
        if not self.classes:
            return "no failures"
        out = [f"{len(self.classes)} failure classes ({self.failures} failed operations in "
               f"{sum(self.failed_cases_by_mutator.values())} cases):"]
        for fc in sorted(self.classes.values(), key=lambda c: (-len(c.cases), c.key)):
            f = fc.first
            out.append(f"\n[{len(fc.cases)} cases, {fc.ops} ops: {', '.join(sorted(fc.operations))}] {fc.key}")
            out.append(f"    first: case {f['case']} ({f['op']}): {f['mutation']}")
            out.append(f"    {f['detail'][:600]}")
            out.append(f"    reproduce: python -m tests.fuzz --replay {f['case']}")
            if traces and f.get("trace"):
                out.append("    " + "\n    ".join(f["trace"].splitlines()[-12:]))
        return "\n".join(out)

    def to_dict(self) -> dict[str, Any]:
        return {
            "seed": self.seed,
            "corpus_digest": self.corpus_digest,
            "cases": self.cases,
            "seconds": round(self.seconds, 1),
            "interrupted": self.interrupted,
            "operations": {o: sum(n for (_, o2), n in self.by_mutator.items() if o2 == o) for o in OUTCOMES},
            "by_mutator": {m: {"cases": self.cases_by_mutator[m], "failed_cases": self.failed_cases_by_mutator[m],
                               **{o: self.by_mutator[m, o] for o in OUTCOMES}} for m in sorted(self.cases_by_mutator)},
            "by_document": {k: {o: self.by_kind[k, o] for o in OUTCOMES} for k in sorted({k for k, _ in self.by_kind})},
            "failure_classes": [{"class": fc.key, "ops": fc.ops, "cases": len(fc.cases),
                                 "operations": sorted(fc.operations), "first": fc.first, "examples": fc.examples}
                                for fc in sorted(self.classes.values(), key=lambda c: (-len(c.cases), c.key))],
            "failed_cases": self.failed_case_ids,
            "op_seconds": {k: round(v, 2) for k, v in self.op_seconds.most_common()},
            "slowest_cases": self.slowest,
            "results": self.results,
        }
