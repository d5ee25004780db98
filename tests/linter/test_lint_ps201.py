"""PS201: fixture-driven pairs of requests (tests/linter/cases/ps201.json)."""

import pytest
from lint_cases import assert_pair_case, case_params


@pytest.mark.parametrize("case", case_params("PS201", "fail"))
def test_ps201_reports_first_divergence(case):
    assert_pair_case("PS201", case)


@pytest.mark.parametrize("case", case_params("PS201", "pass"))
def test_ps201_passes_extending_requests(case):
    assert_pair_case("PS201", case)
