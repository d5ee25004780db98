"""PS102: fixture-driven pass and fail cases (tests/linter/cases/ps102.json)."""

import pytest
from lint_cases import assert_request_case, case_params


@pytest.mark.parametrize("case", case_params("PS102", "fail"))
def test_ps102_reports_expected_locations(case):
    assert_request_case("PS102", case)


@pytest.mark.parametrize("case", case_params("PS102", "pass"))
def test_ps102_passes_clean_requests(case):
    assert_request_case("PS102", case)
