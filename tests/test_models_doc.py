"""docs/MODELS.md shows the support matrix the model tests are parametrized from, not a hand-kept copy."""

from __future__ import annotations

from pathlib import Path

from tests.integration.families import (
    FAMILIES,
    MATRIX,
    MOE,
    OUTSIDE_CI,
    OUTSIDE_CI_NOTE,
    STARTS,
    matrix_markdown,
    poisoned_markdown,
)
from tests.integration.test_vllm_models import CASES
from tests.integration.test_vllm_poisoned_start import POISONED

DOC = Path(__file__).resolve().parents[1] / "docs" / "MODELS.md"


def test_models_doc_shows_the_generated_matrix() -> None:
    assert matrix_markdown() in DOC.read_text(), "regenerate it: python -m tests.integration.families"


def test_models_doc_shows_the_generated_poisoned_start_table() -> None:
    assert poisoned_markdown() in DOC.read_text(), "regenerate it: python -m tests.integration.families"


def test_every_family_case_the_tests_run_is_a_matrix_row() -> None:
    family = "test_vllm_models::test_family_follows_a_stream_bit_exact_against_fresh_engines["
    rows = {r["test"].removesuffix(OUTSIDE_CI_NOTE).rsplit("[", 1)[1].rstrip("]") for r in MATRIX
            if r["test"].startswith(family)}
    assert rows == {"-".join(case.values if hasattr(case, "values") else case) for case in CASES}
    outside = {"-".join(case.values) for case in CASES if hasattr(case, "marks") and case.marks}
    assert outside == {"-".join(c) for c in OUTSIDE_CI}  # what the matrix says is left out is what the tests leave out
    assert set(MOE) <= set(FAMILIES)


def test_every_poisoned_start_case_the_tests_run_is_a_table_row() -> None:
    """Each row names its case and says where each start runs: what the test's marks say."""
    rows = {row.split("[")[-1].split("-{")[0]: row for row in poisoned_markdown().splitlines()[2:]}
    for case in POISONED:
        *family, start = case.values
        cell = rows["-".join(family)].split(" | ")[3 + STARTS.index(start)]
        assert cell == ("bit-equal (outside CI)" if case.marks else "bit-equal (CI)"), (case.values, cell)
    assert len(POISONED) == len(rows) * len(STARTS)
