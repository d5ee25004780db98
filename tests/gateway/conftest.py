"""Fixtures for the gateway tests (helpers live in gw_fakes.py)."""

from __future__ import annotations

import os

import pytest
from gw_fakes import FakeUpstream

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


@pytest.fixture
def fake_upstream() -> FakeUpstream:
    return FakeUpstream()
