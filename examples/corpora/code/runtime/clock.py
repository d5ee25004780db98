"""Helpers imported by the agents in this package: the volatile calls sit here, the prompts in
agents.py, so each finding is reported where the helper's value enters a prompt."""

from __future__ import annotations

import time
import uuid
from datetime import datetime

PLUGINS = {"calendar", "mail", "maps", "notes"}


def stamp() -> str:
    return datetime.now().strftime("%Y-%m-%d %H:%M")


def session_tag() -> str:
    return "sess-" + uuid.uuid4().hex[:8]


def build_label() -> str:
    return "%s" % time.strftime("%H%M%S")  # noqa: UP031


def plugin_names() -> list[str]:
    return sorted(PLUGINS)


def stable_note() -> str:
    return "Answer in English."
