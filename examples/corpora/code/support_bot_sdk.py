"""A support bot written directly against the OpenAI SDK (labelled: ``# expect: PSNNN`` marks each cause)."""

from __future__ import annotations

import json
import logging
import time
import uuid
from datetime import UTC, datetime
from typing import Any

log = logging.getLogger("support")

MODEL = "gpt-4o-mini"
BASE_PROMPT = """You are Nimbus, the support assistant of Larkspur Outdoor Gear.
Look orders up with the tools before answering and never guess an order status."""

TOOL_SPECS: dict[str, dict[str, Any]] = {
    "get_order": {
        "type": "function",
        "function": {
            "name": "get_order",
            "description": "Look up an order by its number.",
            "parameters": {"type": "object", "properties": {"order_id": {"type": "string"}}, "required": ["order_id"]},
        },
    },
    "search_kb": {
        "type": "function",
        "function": {
            "name": "search_kb",
            "description": "Search the help-center articles.",
            "parameters": {"type": "object", "properties": {"query": {"type": "string"}}, "required": ["query"]},
        },
    },
}
ENABLED_BY_DEFAULT = {"get_order", "search_kb"}
RETURN_WINDOWS = {"tents": 30, "boots": 60, "jackets": 30}


def system_message(store_name: str) -> dict[str, str]:
    now = datetime.now(UTC).strftime("%Y-%m-%d %H:%M")  # expect: PS301
    return {"role": "system", "content": f"{BASE_PROMPT}\nStore: {store_name}. Current time: {now}."}


def system_prompt_with_policies(categories: set[str]) -> str:
    windows = {category: RETURN_WINDOWS[category] for category in categories}
    return BASE_PROMPT + "\nReturn windows in days: " + json.dumps(windows)  # expect: PS302


def system_prompt_with_sorted_policies(categories: set[str]) -> str:
    windows = {category: RETURN_WINDOWS[category] for category in sorted(categories)}
    return BASE_PROMPT + "\nReturn windows in days: " + json.dumps(windows)


def enabled_tools(extra: set[str]) -> list[dict[str, Any]]:
    names = ENABLED_BY_DEFAULT | extra
    return [TOOL_SPECS[name] for name in names if name in TOOL_SPECS]  # expect: PS303


class ChatSession:
    """Keeps the turns of one customer chat."""

    def __init__(self, client: Any, store_name: str, max_turns: int = 12) -> None:
        self.client = client
        self.store_name = store_name
        self.max_turns = max_turns
        self.history: list[dict[str, Any]] = []
        self.session_id = str(uuid.uuid4())

    def ask(self, question: str, extra_tools: set[str]) -> str:
        self.history.append({"role": "user", "content": question})
        started = time.monotonic()
        response = self.client.chat.completions.create(
            model=MODEL,
            messages=[system_message(self.store_name), *self.history[-self.max_turns :]],  # expect: PS305
            tools=enabled_tools(extra_tools),
            user=self.session_id,
        )
        log.info("completion %s took %.2fs: %s", self.session_id, time.monotonic() - started, json.dumps(response.usage.model_dump()))
        answer = response.choices[0].message.content or ""
        self.history.append({"role": "assistant", "content": answer})
        return answer

    def tool_result(self, call_id: str, result: dict[str, Any]) -> None:
        self.history.append({"role": "tool", "tool_call_id": call_id, "content": json.dumps(result)})

    def recent_for_display(self) -> list[str]:
        return [m["content"] for m in self.history[-5:] if m.get("content")]
