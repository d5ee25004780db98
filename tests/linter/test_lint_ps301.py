"""PS301: every marked line of tests/linter/cases/ps301_cases.py is reported, nothing else."""

from lint_cases import assert_source_cases


def test_ps301_reports_marked_lines_only():
    assert_source_cases("PS301")
