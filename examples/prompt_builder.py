"""An example prompt builder with the mistakes ``prefixgate lint`` finds (PS301-PS305).

Each planted mistake is marked with a comment naming the rule; ``PLANTED`` in
tests/linter/test_lint_corpus.py lists their lines. Compare with
examples/clean/prompt_builder.py, which builds the same prompts cache-friendly.
"""

from __future__ import annotations

import json
import uuid
from datetime import datetime
from typing import Any

TOOL_SPECS: dict[str, dict[str, Any]] = {
    "get_weather": {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}},
    "search_docs": {"type": "function", "function": {"name": "search_docs", "parameters": {"type": "object"}}},
}
SYSTEM_PROMPT = "You are the support assistant of ACME Cloud."


def build_messages(history: list[dict[str, Any]], question: str) -> list[dict[str, Any]]:
    now = datetime.now().isoformat()  # PS301: it reaches the system message below
    system = {"role": "system", "content": f"{SYSTEM_PROMPT} Time: {now}"}
    trace = f"trace {uuid.uuid4()}"  # volatile, but it goes into the newest user turn: fine
    recent = history[-10:]  # PS305
    return [system, *recent, {"role": "user", "content": f"{trace}\n{question}"}]


def build_tools(enabled: set[str], user_name: str) -> list[dict[str, Any]]:
    tools = [TOOL_SPECS[name] for name in enabled]  # PS303
    tools.append(
        {
            "type": "function",
            "function": {"name": "list_orders", "description": f"Orders of {user_name}"},  # PS304
        }
    )
    return tools


LIMITS = {"free": 10, "pro": 100, "team": 1000}


def limits_message(plans: set[str]) -> dict[str, Any]:
    limits = {plan: LIMITS[plan] for plan in plans}
    return {"role": "system", "content": "Request limits: " + json.dumps(limits)}  # PS302


def tool_message(call_id: str, result: dict[str, Any]) -> dict[str, Any]:
    return {"role": "tool", "tool_call_id": call_id, "content": json.dumps(result)}  # a tool result: history, fine


def debug_prompt(plans: set[str]) -> dict[str, Any]:
    limits = {plan: LIMITS[plan] for plan in plans}
    return {"role": "system", "content": "debug: " + json.dumps(limits)}  # prefixgate: noqa: PS302
