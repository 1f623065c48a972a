"""``python -m tests.fuzz``: the long fuzz run, or one case replayed (see tests/fuzz/__init__.py)."""

from __future__ import annotations

import argparse
import datetime as dt
import json
import signal
import sys
from pathlib import Path

from . import CorpusError, Options, run
from .cases import Pristine, case
from .corpus import build_corpus
from .inputs import run_inputs
from .mutations import describe


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tests.fuzz", description=__doc__)
    ap.add_argument("--minutes", type=float, default=10.0, help="time budget (no case starts after it)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--max-cases", type=int, default=None)
    ap.add_argument("--op-timeout-s", type=float, default=10.0)
    ap.add_argument("--memory-mib", type=int, default=2048, help="address space a worker may add (RLIMIT_AS)")
    ap.add_argument("--rss-limit-mib", type=int, default=512, help="peak resident memory one operation may add")
    ap.add_argument("--no-tail-changes", action="store_true",
                    help="publish the corpus without changes in tensors' tails (for code with issue 8's defect 1)")
    ap.add_argument("--json", default=None,
                    help="where to write the results (default bench/results/fuzz-SEED-DATE.json)")
    ap.add_argument("--replay", metavar="CASE_ID", help="run one case (SEED-INDEX) and print every operation's outcome")
    ap.add_argument("--show", metavar="CASE_ID", help="print one case's mutation and exit")
    ap.add_argument("--inputs", type=int, metavar="N", default=None,
                    help="instead: N cases of the input fuzzer (manifests v2, RDMA messages, init/update_info, HTTP "
                         "replies)")
    args = ap.parse_args(argv)
    if args.inputs is not None:
        signal.signal(signal.SIGTERM, _stop)

        def progress(r) -> None:
            print(f"  {r.cases} cases, {r.failures} failures, {r.seconds:.0f} s", file=sys.stderr, flush=True)

        report = run_inputs(args.seed, args.inputs, on_progress=progress)
        print(report.table())
        print(report.failure_text())
        return _write(args, f"fuzz-inputs-{args.seed}", report)
    common = dict(workers=args.workers, op_timeout_s=args.op_timeout_s, memory_mib=args.memory_mib,
                  rss_limit_mib=args.rss_limit_mib, tail_changes=not args.no_tail_changes)
    if args.show or args.replay:
        seed, index = (int(x) for x in (args.show or args.replay).rsplit("-", 1))
        if args.show:
            import tempfile

            with tempfile.TemporaryDirectory(prefix="deltasync-fuzz-") as tmp:
                corpus = build_corpus(Path(tmp), tail_changes=not args.no_tail_changes)
                spec = case(seed, index, Pristine.load(corpus.stream))
            print(describe(spec))
            print(json.dumps(spec, indent=1))
            return 0
        opts = Options(seed=seed, start_index=index, max_cases=1, budget_s=3600, keep_results=True,
                       **{**common, "workers": 1})
        report = _run(opts)
        if report is None:
            return 1
        for r in report.results:
            print(f"case {r['case']['id']}: {r['mutation']}")
            for o in r["outcomes"]:
                print(f"  {o['op']:<24} {o['outcome']:<9} {o['why']}  {o['detail'][:300]}")
                if o["trace"]:
                    print("    " + "\n    ".join(o["trace"].splitlines()))
        return 1 if report.failures else 0
    opts = Options(seed=args.seed, budget_s=args.minutes * 60, max_cases=args.max_cases, **common)
    report = _run(opts, progress=True)
    if report is None:
        return 1
    print(f"\nfuzz seed {opts.seed}: {report.cases} cases in {report.seconds / 60:.1f} min"
          f"{' (interrupted)' if report.interrupted else ''} "
          f"(corpus {report.corpus_digest[:16]}, tail changes {'on' if opts.tail_changes else 'off'})")
    print(report.table())
    print()
    print(report.failure_text())
    return _write(args, f"fuzz-{opts.seed}", report)


def _write(args: argparse.Namespace, name: str, report) -> int:
    """The run's figures as JSON (``--json``, else bench/results/NAME-DATE.json); the exit status."""
    path = Path(args.json) if args.json else Path(__file__).resolve().parents[2] / "bench" / "results" / (
        f"{name}-{dt.date.today().isoformat()}.json")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"options": vars(args), **report.to_dict()}, indent=1))
    print(f"wrote {path}")
    return 1 if report.failures else 0


def _stop(signum: int, frame: object) -> None:
    raise KeyboardInterrupt  # a long run stopped with kill reports what it found and cleans up, as with Ctrl-C


def _run(opts: Options, *, progress: bool = False):
    signal.signal(signal.SIGTERM, _stop)
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:  # started in the background by a shell
        signal.signal(signal.SIGINT, _stop)

    def tick(report) -> None:
        if report.cases % 50 == 0:
            print(f"  {report.cases} cases, {report.failures} failed operations", file=sys.stderr, flush=True)

    try:
        return run(opts, on_case=tick if progress else None)
    except CorpusError as e:
        print(e, file=sys.stderr)
        return None


if __name__ == "__main__":
    sys.exit(main())
