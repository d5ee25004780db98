"""PS103: fixture-driven pass and fail cases (tests/linter/cases/ps103.json)."""

import pytest
from lint_cases import assert_request_case, case_params


@pytest.mark.parametrize("case", case_params("PS103", "fail"))
def test_ps103_reports_expected_locations(case):
    assert_request_case("PS103", case)


@pytest.mark.parametrize("case", case_params("PS103", "pass"))
def test_ps103_passes_clean_requests(case):
    assert_request_case("PS103", case)
