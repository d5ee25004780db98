"""PS206: fixture-driven pairs of requests (tests/linter/cases/ps206.json)."""

import pytest
from lint_cases import assert_pair_case, case_params


@pytest.mark.parametrize("case", case_params("PS206", "fail"))
def test_ps206_reports_first_divergence(case):
    assert_pair_case("PS206", case)


@pytest.mark.parametrize("case", case_params("PS206", "pass"))
def test_ps206_passes_extending_requests(case):
    assert_pair_case("PS206", case)
