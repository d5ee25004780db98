"""Tests are excluded by default: slices, clocks and unsorted dumps here never reach a production request."""

from __future__ import annotations

import json
from datetime import datetime


def test_window_keeps_the_last_turns() -> None:
    messages = [{"role": "user", "content": str(i)} for i in range(20)]
    window = messages[-4:]
    assert [m["content"] for m in window] == ["16", "17", "18", "19"]


def test_system_prompt_renders() -> None:
    system_prompt = f"Now: {datetime.now()}"
    assert system_prompt.startswith("Now")
    assert json.dumps({"b": 1, "a": 2})
