"""The mutation fuzzer's short run (issue 8), and checks that the fuzzer itself sees what it should.

The engine is ``tests/fuzz/``; the long run is ``python -m tests.fuzz --minutes N --seed S``. Here a fixed
seed runs for about a minute on 2 cores: every case issue 8 names, every mutator at least once, then as
many random cases as the budget allows. Any outcome other than a ``DeltaSyncError`` with nothing left
behind, or a bit-exact result, fails the test with the failure classes and one reproducing case each.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from deltasync.errors import FormatError
from tests.fuzz import Options, run
from tests.fuzz.cases import MUTATORS, Pristine, case, directed_cases
from tests.fuzz.corpus import build_corpus
from tests.fuzz.mutations import apply, read_document
from tests.fuzz.operations import Failed, classify

CI_SEED = 8
CI_BUDGET_S = 15.0  # past every directed case and every mutator once (min_cases), plus the cases in flight
# when it runs out, each operation within 10 s; long runs: python -m tests.fuzz --minutes N


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return build_corpus(tmp_path_factory.mktemp("fuzz-corpus"))


@pytest.fixture(scope="module")
def pristine(corpus):
    return Pristine.load(corpus.stream)


def test_fuzz_short_run_finds_no_failure(corpus, pristine, tmp_path):
    must_run = len(directed_cases(pristine)) + len(MUTATORS)
    report = run(Options(seed=CI_SEED, budget_s=CI_BUDGET_S, workers=2, min_cases=must_run), corpus=corpus,
                 work_dir=tmp_path)
    assert report.cases >= must_run
    assert set(report.cases_by_mutator) >= set(MUTATORS)
    assert report.failures == 0, f"{report.table()}\n\n{report.failure_text()}"
    assert not any(tmp_path.iterdir()), "the fuzz run left files behind"


def test_corpus_is_the_same_bytes_in_every_build(corpus, tmp_path):
    """A case id names a mutation of these exact bytes: ``--replay`` rebuilds the corpus and must find them."""
    again = build_corpus(tmp_path)
    assert again.digest == corpus.digest


def test_cases_are_reproducible_and_change_their_document(pristine, tmp_path):
    """The same id gives the same mutation, and every mutation (directed, then a few of each mutator) changes bytes."""
    n = len(directed_cases(pristine)) + 2 * len(MUTATORS)
    for index in range(n):
        spec = case(CI_SEED, index, pristine)
        assert case(CI_SEED, index, pristine) == spec
        stream = tmp_path / f"case-{index}" / "stream"
        shutil.copytree(pristine.stream, stream)
        apply(spec, stream, stream.parent)
        assert read_document(stream, spec["doc"]) != pristine.raw[spec["doc"]], spec
        shutil.rmtree(stream.parent)


def test_outcomes_are_classified_by_what_happened():
    """The oracle itself: a DeltaSyncError is a rejection, a wrong result or any other exception a failure
    that names where it was raised, a return an exact result."""

    def raises(e: BaseException):
        def fn():
            raise e

        return fn

    assert classify("op", raises(FormatError("bad"))).outcome == "rejected"
    assert classify("op", lambda: None).outcome == "exact"
    wrong = classify("op", raises(Failed("returned wrong bits", "tensor 'w'")))
    assert (wrong.outcome, wrong.why) == ("failure", "returned wrong bits")
    import json

    crash = classify("op", lambda: json.loads("[" * 100_000))
    assert crash.outcome == "failure" and crash.why.startswith("RecursionError at ") and "json" in crash.trace
    assert classify("op", raises(MemoryError())).outcome == "failure"


def test_input_fuzzer_short_run_finds_no_failure():
    """Version-2 manifests, RDMA control messages and announcements, init_info/update_info, the server's HTTP
    replies, heartbeats as status shows them, ranks' status replies, event-feed lines and node-cache entries
    (tests/fuzz/inputs.py): every target reached, both accepted and rejected inputs seen."""
    from tests.fuzz.inputs import TARGETS, run_inputs

    report = run_inputs(CI_SEED, 8000)
    assert set(report.targets) == set(TARGETS)
    for name, t in report.targets.items():
        assert t.cases > 20 and t.outcomes["rejected"] > 0, (name, t)
    assert report.failures == 0, f"{report.table()}\n{report.failure_text()}"


def test_input_fuzzer_sees_a_planted_defect(monkeypatch):
    """The oracle: an update_info check removed, and a consumer's announcement table left unbounded, are found."""
    from deltasync.rdma import link
    from rollout_loader.vllm.engine import DeltasyncUpdateInfo
    from tests.fuzz.inputs import run_inputs

    monkeypatch.setattr(DeltasyncUpdateInfo, "__post_init__", lambda self: None)
    report = run_inputs(CI_SEED, 400, targets=("update_info",))
    assert report.targets["update_info"].outcomes["failure"] > 0
    assert "accepted update_info step" in report.failure_text()

    monkeypatch.setattr(link, "MAX_ANNOUNCED", 2)
    original = link.ConsumerLink.file

    def unbounded(self, msg):
        original(self, msg)
        self._ready[len(self._ready) + 10_000]  # a table that grows on every message (defaultdict)

    monkeypatch.setattr(link.ConsumerLink, "file", unbounded)
    report = run_inputs(CI_SEED, 200, targets=("announcement",))
    assert "grew past its bound" in report.failure_text()


def test_input_fuzzer_sees_planted_trust_defects(monkeypatch):
    """Issue 30's surfaces: status output that prints a heartbeat raw, a node cache that writes through links, an
    event parser that keeps only the largest step, are each found."""
    import importlib

    import deltasync.store.node_cache
    import deltasync_cli.stream
    from deltasync.notify import EventParser
    from tests.fuzz.inputs import run_inputs

    raw = lambda text: str(text)  # noqa: E731 - the planted defect: what a heartbeat says, shown as it is
    monkeypatch.setattr(deltasync_cli.stream, "shown", lambda text: str(text).replace("[", "\\["))
    monkeypatch.setattr(deltasync_cli.stream, "inert", raw)  # (status shows ids and versions through these two)
    monkeypatch.setattr(importlib.import_module("deltasync_cli.app"), "inert", raw)  # (the Typer app shadows it)
    report = run_inputs(CI_SEED, 1000, targets=("heartbeat",))
    assert "status output holds control character" in report.failure_text(), report.table()

    import os

    def careless(self, digest, data):  # noqa: ANN001 - written in place, following whatever is there
        fd = os.open(self._path(digest), os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NONBLOCK)
        with os.fdopen(fd, "wb") as f:
            f.write(data)

    monkeypatch.setattr(deltasync.store.node_cache.NodeCache, "_add", careless)
    monkeypatch.setattr(deltasync.store.node_cache, "_remove", lambda path: None)  # and what is found there stays
    report = run_inputs(CI_SEED, 300, targets=("node_cache",))
    assert "a write went through a link" in report.failure_text(), report.table()

    real = EventParser.feed
    monkeypatch.setattr(EventParser, "feed", lambda self, line: 10**13 if real(self, line) is not None else None)
    report = run_inputs(CI_SEED, 400, targets=("event_line",))
    assert "announced 10000000000000" in report.failure_text(), report.table()


def test_the_long_run_entry_point_writes_its_figures(tmp_path):
    import json
    import subprocess
    import sys

    out = tmp_path / "inputs.json"
    r = subprocess.run([sys.executable, "-m", "tests.fuzz", "--inputs", "600", "--seed", "3", "--json", str(out)],
                       capture_output=True, text=True, timeout=300, cwd=Path(__file__).parent.parent)
    assert r.returncode == 0, r.stdout + r.stderr
    figures = json.loads(out.read_text())
    assert figures["cases"] == 600 and figures["failures"] == 0 and figures["seed"] == 3
    assert "total" in r.stdout
