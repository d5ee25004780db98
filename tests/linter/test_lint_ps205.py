"""PS205: fixture-driven pairs of requests (tests/linter/cases/ps205.json)."""

import pytest
from lint_cases import assert_pair_case, case_params


@pytest.mark.parametrize("case", case_params("PS205", "fail"))
def test_ps205_reports_first_divergence(case):
    assert_pair_case("PS205", case)


@pytest.mark.parametrize("case", case_params("PS205", "pass"))
def test_ps205_passes_extending_requests(case):
    assert_pair_case("PS205", case)
