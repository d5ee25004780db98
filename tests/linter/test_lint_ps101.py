"""PS101: fixture-driven pass and fail cases (tests/linter/cases/ps101.json)."""

import pytest
from lint_cases import assert_request_case, case_params


@pytest.mark.parametrize("case", case_params("PS101", "fail"))
def test_ps101_reports_expected_locations(case):
    assert_request_case("PS101", case)


@pytest.mark.parametrize("case", case_params("PS101", "pass"))
def test_ps101_passes_clean_requests(case):
    assert_request_case("PS101", case)
