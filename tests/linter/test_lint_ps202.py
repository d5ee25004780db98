"""PS202: fixture-driven pairs of requests (tests/linter/cases/ps202.json)."""

import pytest
from lint_cases import assert_pair_case, case_params


@pytest.mark.parametrize("case", case_params("PS202", "fail"))
def test_ps202_reports_first_divergence(case):
    assert_pair_case("PS202", case)


@pytest.mark.parametrize("case", case_params("PS202", "pass"))
def test_ps202_passes_extending_requests(case):
    assert_pair_case("PS202", case)
