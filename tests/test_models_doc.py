"""docs/MODELS.md shows the support matrix the model tests are parametrized from, not a hand-kept copy."""

from __future__ import annotations

from pathlib import Path

from tests.integration.families import FAMILIES, MATRIX, MOE, matrix_markdown
from tests.integration.test_vllm_models import CASES

DOC = Path(__file__).resolve().parents[1] / "docs" / "MODELS.md"


def test_models_doc_shows_the_generated_matrix() -> None:
    assert matrix_markdown() in DOC.read_text(), "regenerate it: python -m tests.integration.families"


def test_every_family_case_the_tests_run_is_a_matrix_row() -> None:
    rows = {r["test"].rsplit("[", 1)[1].rstrip("]") for r in MATRIX if "[" in r["test"]}
    assert rows == {f"{f}-{k}-{d}" for f, k, d in CASES}
    assert set(MOE) <= set(FAMILIES)
