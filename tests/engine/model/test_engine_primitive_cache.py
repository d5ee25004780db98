"""Importing engine.model raises oneDNN's primitive cache capacity, unless the
environment already chose one (a fresh interpreter each: the setting is per process)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from engine.model import PRIMITIVE_CACHE_CAPACITY

PROBE = "import os, engine.model; print(os.environ['ONEDNN_PRIMITIVE_CACHE_CAPACITY'])"


@pytest.mark.parametrize(("given", "expected"), [(None, str(PRIMITIVE_CACHE_CAPACITY)), ("2048", "2048")])
def test_the_capacity_is_raised_unless_the_environment_sets_it(given, expected):
    env = {k: v for k, v in os.environ.items() if k != "ONEDNN_PRIMITIVE_CACHE_CAPACITY"}
    if given is not None:
        env["ONEDNN_PRIMITIVE_CACHE_CAPACITY"] = given
    out = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == expected
    assert PRIMITIVE_CACHE_CAPACITY > 1024  # oneDNN's own default
