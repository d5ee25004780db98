"""The cache-friendly version of examples/prompt_builder.py: ``prefixgate lint`` finds nothing here.

* the instructions are a constant; the time goes into the newest user message;
* tools come from a sorted list and are the same for every user;
* JSON is serialized canonically;
* the history is only appended to.
"""

from __future__ import annotations

import json
from datetime import UTC, datetime
from typing import Any

TOOL_SPECS: dict[str, dict[str, Any]] = {
    "get_weather": {"function": {"name": "get_weather", "parameters": {"type": "object"}}, "type": "function"},
    "search_docs": {"function": {"name": "search_docs", "parameters": {"type": "object"}}, "type": "function"},
}
SYSTEM_PROMPT = "You are the support assistant of ACME Cloud."
TOOLS = [TOOL_SPECS[name] for name in sorted(TOOL_SPECS)]


def canonical(value: Any) -> str:
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def build_messages(history: list[dict[str, Any]], question: str) -> list[dict[str, Any]]:
    now = datetime.now(UTC).isoformat(timespec="seconds")
    system = {"role": "system", "content": SYSTEM_PROMPT}
    return [system, *history, {"role": "user", "content": f"Current time: {now}\n\n{question}"}]


def append_turn(history: list[dict[str, Any]], answer: str) -> None:
    history.append({"role": "assistant", "content": answer})


def tool_message(call_id: str, result: dict[str, Any]) -> dict[str, Any]:
    return {"role": "tool", "tool_call_id": call_id, "content": canonical(result)}
