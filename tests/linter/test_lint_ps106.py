"""PS106: fixture-driven pass and fail cases (tests/linter/cases/ps106.json)."""

import pytest
from lint_cases import assert_request_case, case_params


@pytest.mark.parametrize("case", case_params("PS106", "fail"))
def test_ps106_reports_expected_locations(case):
    assert_request_case("PS106", case)


@pytest.mark.parametrize("case", case_params("PS106", "pass"))
def test_ps106_passes_clean_requests(case):
    assert_request_case("PS106", case)
