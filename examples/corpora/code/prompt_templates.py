"""Prompts assembled from templates: str.format, %-formatting, string.Template, message classes (labelled)."""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from string import Template
from typing import Any

REVIEWER_TEMPLATE = "You review pull requests for {team}. Languages we use: {languages}. Style: {style}."
SUPPORTED_LANGUAGES = {"python", "typescript", "go", "rust"}
SEVERITY_LEVELS = {"blocker": 3, "major": 2, "minor": 1}


@dataclass
class SystemMessage:
    content: str


@dataclass
class HumanMessage:
    content: str


def reviewer_prompt(team: str) -> SystemMessage:
    languages = ", ".join(SUPPORTED_LANGUAGES)  # expect: PS303
    return SystemMessage(REVIEWER_TEMPLATE.format(team=team, languages=languages, style="PEP 8"))


def reviewer_prompt_sorted(team: str) -> SystemMessage:
    languages = ", ".join(sorted(SUPPORTED_LANGUAGES))
    return SystemMessage(REVIEWER_TEMPLATE.format(team=team, languages=languages, style="PEP 8"))


def triage_prompt(enabled: set[str]) -> SystemMessage:
    weights = {level: SEVERITY_LEVELS[level] for level in enabled}
    return SystemMessage("Severity weights: %s" % json.dumps(weights))  # noqa: UP031  # expect: PS302


def triage_prompt_sorted_keys(enabled: set[str]) -> SystemMessage:
    weights = {level: SEVERITY_LEVELS[level] for level in enabled}
    return SystemMessage("Severity weights: %s" % json.dumps(weights, sort_keys=True))  # noqa: UP031


CHECKLIST = Template("Checklist for $repo (generated $stamp):\n$items")


def checklist_message(repo: str, items: list[str]) -> dict[str, Any]:
    stamp = time.strftime("%H:%M:%S")  # expect: PS301
    content = CHECKLIST.substitute(repo=repo, stamp=stamp, items="\n".join(items))
    return {"role": "developer", "content": content}


def playbook_instructions(folder: str) -> str:
    sections = []
    for name in os.listdir(folder):  # expect: PS303
        with open(os.path.join(folder, name), encoding="utf-8") as fh:
            sections.append(fh.read())
    return "\n\n".join(sections)


def user_turn(question: str) -> HumanMessage:
    return HumanMessage(f"[{time.strftime('%H:%M')}] {question}")
