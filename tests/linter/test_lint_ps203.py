"""PS203: fixture-driven pairs of requests (tests/linter/cases/ps203.json)."""

import pytest
from lint_cases import assert_pair_case, case_params


@pytest.mark.parametrize("case", case_params("PS203", "fail"))
def test_ps203_reports_first_divergence(case):
    assert_pair_case("PS203", case)


@pytest.mark.parametrize("case", case_params("PS203", "pass"))
def test_ps203_passes_extending_requests(case):
    assert_pair_case("PS203", case)
