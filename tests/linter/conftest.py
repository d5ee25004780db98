"""Linter test setup: assertion rewriting for the shared case helpers, and an offline environment."""

import pytest

pytest.register_assert_rewrite("lint_cases")
