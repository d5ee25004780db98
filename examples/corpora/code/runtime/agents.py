"""Agents whose prompts and tools are built from attributes, imported helpers and format calls."""

from __future__ import annotations

import random
import time
from typing import Any

from .clock import build_label, plugin_names, session_tag, stable_note, stamp

MODULE_LIST = {"billing", "search", "shipping", "returns"}
PERSONAS = ["a patient tutor", "a brisk coach", "a friendly guide"]


class TutorAgent:
    def __init__(self, seed: int | None = None) -> None:
        self.rand = random.Random(seed)
        self.clock = time.time
        self.level = "beginner"

    def system_prompt(self) -> str:
        persona = PERSONAS[self.rand.randint(0, 2)]  # expect: PS301
        return "You are {}. Keep answers short for a {} learner.".format(persona, self.level)  # noqa: UP032

    def request(self, question: str) -> dict[str, Any]:
        return {"messages": [{"role": "system", "content": self.system_prompt()}, {"role": "user", "content": question}]}


class QuizAgent(TutorAgent):
    def request(self, question: str) -> dict[str, Any]:
        instructions = "Quiz started at %d." % self.clock()  # noqa: UP031  # expect: PS301
        return {"instructions": instructions, "input": question}


class RouterAgent:
    def __init__(self) -> None:
        self.modules = list(set(MODULE_LIST))  # expect: PS303
        self.name = "router"

    def tools(self) -> list[dict[str, Any]]:
        return [{"type": "function", "function": {
            "name": self.name, "description": f"Route the question to one of: {', '.join(self.modules)}.",
            "parameters": {"type": "object", "properties": {"module": {"type": "string"}}}}}]

    def request(self, question: str) -> dict[str, Any]:
        system = "Route questions (build %s)." % build_label()  # noqa: UP031  # expect: PS301
        return {"messages": [{"role": "system", "content": system}, {"role": "user", "content": question}],
                "tools": self.tools()}


def module_tool() -> dict[str, Any]:
    return {"type": "function", "function": {
        "name": "pick_module", "description": f"Pick one of {list(set(MODULE_LIST))}.",  # expect: PS303
        "parameters": {"type": "object", "properties": {"module": {"type": "string"}}}}}


def planner_request(goal: str) -> dict[str, Any]:
    system_prompt = f"Plan the steps. Generated at {stamp()}. {stable_note()}"  # expect: PS301
    return {"messages": [{"role": "system", "content": system_prompt}, {"role": "user", "content": goal}],
            "tools": [module_tool()]}


def tagged_request(goal: str) -> dict[str, Any]:
    instructions = "Session {tag}: plan carefully.".format(tag=session_tag())  # noqa: UP032  # expect: PS301
    return {"instructions": instructions, "input": goal}


def plugin_request(goal: str) -> dict[str, Any]:
    instructions = "Plugins: " + ", ".join(plugin_names())  # sorted in the helper: no finding
    return {"instructions": instructions, "input": goal}


def seeded_request(goal: str) -> dict[str, Any]:
    rng = random.Random(42)  # a fixed seed: the same persona in every process
    instructions = "You are {}.".format(PERSONAS[rng.randint(0, 2)])  # noqa: UP032
    return {"instructions": instructions, "input": goal}
