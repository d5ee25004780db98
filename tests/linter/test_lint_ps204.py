"""PS204: fixture-driven pairs of requests (tests/linter/cases/ps204.json)."""

import pytest
from lint_cases import assert_pair_case, case_params


@pytest.mark.parametrize("case", case_params("PS204", "fail"))
def test_ps204_reports_first_divergence(case):
    assert_pair_case("PS204", case)


@pytest.mark.parametrize("case", case_params("PS204", "pass"))
def test_ps204_passes_extending_requests(case):
    assert_pair_case("PS204", case)
