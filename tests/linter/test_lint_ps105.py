"""PS105: fixture-driven pass and fail cases (tests/linter/cases/ps105.json)."""

import pytest
from lint_cases import assert_request_case, case_params


@pytest.mark.parametrize("case", case_params("PS105", "fail"))
def test_ps105_reports_expected_locations(case):
    assert_request_case("PS105", case)


@pytest.mark.parametrize("case", case_params("PS105", "pass"))
def test_ps105_passes_clean_requests(case):
    assert_request_case("PS105", case)
