"""A cache-friendly assistant: stable instructions and tools, append-only history (no findings expected)."""

from __future__ import annotations

import json
import logging
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

log = logging.getLogger("assistant")

SYSTEM_PROMPT = (Path(__file__).parent / "prompts" / "assistant.md").read_text(encoding="utf-8") if False else (
    "You are a concise assistant for the Riverbend library. Answer in at most three sentences."
)
TOOLS: list[dict[str, Any]] = sorted(
    [
        {"type": "function", "function": {"name": "search_catalog", "description": "Search books.", "parameters": {"type": "object"}}},
        {"type": "function", "function": {"name": "opening_hours", "description": "Opening hours.", "parameters": {"type": "object"}}},
    ],
    key=lambda tool: tool["function"]["name"],
)
GENRES = {"fiction", "history", "science"}


def instructions() -> str:
    genres = ", ".join(sorted(GENRES))
    return f"{SYSTEM_PROMPT}\nShelves: {genres}."


class Assistant:
    def __init__(self, client: Any) -> None:
        self.client = client
        self.messages: list[dict[str, Any]] = [{"role": "system", "content": instructions()}]

    def ask(self, question: str) -> str:
        now = datetime.now(UTC).isoformat(timespec="minutes")
        self.messages.append({"role": "user", "content": f"(Now: {now})\n{question}"})
        started = time.perf_counter()
        response = self.client.chat.completions.create(model="gpt-4o-mini", messages=self.messages, tools=TOOLS)
        log.info(json.dumps({"latency": time.perf_counter() - started, "usage": response.usage.model_dump()}))
        message = response.choices[0].message
        self.messages.append(message.model_dump(exclude_none=True))
        return message.content or ""

    def add_tool_result(self, call_id: str, result: dict[str, Any]) -> None:
        self.messages.append({"role": "tool", "tool_call_id": call_id, "content": json.dumps(result, sort_keys=True)})

    def export(self, path: Path) -> None:
        path.write_text("\n".join(json.dumps(m) for m in self.messages), encoding="utf-8")

    def last_answers(self, n: int) -> list[str]:
        answers = [m["content"] for m in self.messages if m["role"] == "assistant"]
        return answers[-n:]


def send_event(session: Any, payload: dict[str, Any]) -> None:
    session.post("https://events.example.com/v1", data=json.dumps({**payload, "ts": time.time()}))
