"""PS104: fixture-driven pass and fail cases (tests/linter/cases/ps104.json)."""

import pytest
from lint_cases import assert_request_case, case_params


@pytest.mark.parametrize("case", case_params("PS104", "fail"))
def test_ps104_reports_expected_locations(case):
    assert_request_case("PS104", case)


@pytest.mark.parametrize("case", case_params("PS104", "pass"))
def test_ps104_passes_clean_requests(case):
    assert_request_case("PS104", case)
