"""Linter test setup: assertion rewriting for the shared case helpers (lint_cases.py)."""

import pytest

pytest.register_assert_rewrite("lint_cases")
