"""A mutation fuzzer for deltasync streams (issue 8): every stored document damaged in many ways, every
reading operation run on the result, each outcome judged ``rejected`` (a ``DeltaSyncError``, nothing left
behind), ``exact`` (bit-identical to the truth recorded at publishing) or ``failure`` (anything else).

``run(Options(seed=..., budget_s=...))`` returns a ``Report``; ``python -m tests.fuzz --minutes N --seed S``
is the long run (a table of counts per mutator and outcome, the failure classes with one reproducing case
each, JSON). ``tests/test_fuzz.py`` is the short run in CI.

Modules: ``corpus`` (the seed stream and its truth), ``edits`` (JSON, safetensors and zstd at the byte
level), ``mutations`` (applying a mutation), ``cases`` (which mutations: directed, then random from the
seed), ``operations`` (what runs on a mutated stream, and the oracle), ``runner`` (bounded worker
processes), ``report`` (counts and failure classes).
"""

from .report import Report
from .runner import CorpusError, Options, run

__all__ = ["CorpusError", "Options", "Report", "run"]
