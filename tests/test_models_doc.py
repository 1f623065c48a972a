"""docs/MODELS.md shows the support matrix the model tests are parametrized from, not a hand-kept copy."""

from __future__ import annotations

from pathlib import Path

from tests.integration.families import FAMILIES, MATRIX, MOE, OUTSIDE_CI, OUTSIDE_CI_NOTE, matrix_markdown
from tests.integration.test_vllm_models import CASES

DOC = Path(__file__).resolve().parents[1] / "docs" / "MODELS.md"


def test_models_doc_shows_the_generated_matrix() -> None:
    assert matrix_markdown() in DOC.read_text(), "regenerate it: python -m tests.integration.families"


def test_every_family_case_the_tests_run_is_a_matrix_row() -> None:
    family = "test_vllm_models::test_family_follows_a_stream_bit_exact_against_fresh_engines["
    rows = {r["test"].removesuffix(OUTSIDE_CI_NOTE).rsplit("[", 1)[1].rstrip("]") for r in MATRIX
            if r["test"].startswith(family)}
    assert rows == {"-".join(case.values if hasattr(case, "values") else case) for case in CASES}
    outside = {"-".join(case.values) for case in CASES if hasattr(case, "marks") and case.marks}
    assert outside == {"-".join(c) for c in OUTSIDE_CI}  # what the matrix says is left out is what the tests leave out
    assert set(MOE) <= set(FAMILIES)
