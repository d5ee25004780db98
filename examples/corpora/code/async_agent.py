"""An asynchronous tool-calling loop with per-workspace tools and a token budget (labelled)."""

from __future__ import annotations

import asyncio
import json
from typing import Any

PROJECT_TOOL = {"type": "function", "function": {"name": "open_issue", "description": "Open an issue in a project.", "parameters": {"type": "object", "properties": {"project": {"type": "string"}, "title": {"type": "string"}}, "required": ["project", "title"]}}}


def workspace_tools(member: Any) -> list[dict[str, Any]]:
    issue_tool = json.loads(json.dumps(PROJECT_TOOL))
    issue_tool["function"]["parameters"]["properties"]["project"]["enum"] = sorted(member.project_keys)  # expect: PS304
    tools = [issue_tool]
    tools.append({"type": "function", "function": {"name": "my_issues", "description": "Issues assigned to me.", "parameters": {"type": "object", "properties": {"state": {"enum": member.states}}}}})  # expect: PS304
    return tools


class AgentLoop:
    def __init__(self, client: Any, system: str, max_messages: int = 40) -> None:
        self.client = client
        self.messages: list[dict[str, Any]] = [{"role": "system", "content": system}]
        self.max_messages = max_messages

    async def run_tools(self, calls: list[Any], handlers: dict[str, Any]) -> None:
        results = await asyncio.gather(*(handlers[c.function.name](**json.loads(c.function.arguments)) for c in calls))
        for call, result in zip(calls, results, strict=True):
            self.messages.append({"role": "tool", "tool_call_id": call.id, "content": json.dumps(result, sort_keys=True)})

    def trim(self) -> None:
        if len(self.messages) > self.max_messages:
            del self.messages[1:3]  # expect: PS305

    async def step(self, tools: list[dict[str, Any]], handlers: dict[str, Any]) -> str | None:
        self.trim()
        response = await self.client.chat.completions.create(model="gpt-4.1", messages=self.messages, tools=tools)
        message = response.choices[0].message
        self.messages.append(message.model_dump(exclude_none=True))
        if message.tool_calls:
            await self.run_tools(message.tool_calls, handlers)
            return None
        return message.content


async def summarize_thread(client: Any, thread: list[dict[str, Any]]) -> str:
    recent = thread[-6:]
    text = "\n".join(m.get("content") or "" for m in recent)
    response = await client.chat.completions.create(
        model="gpt-4.1-mini",
        messages=[{"role": "system", "content": "Summarize the thread in one line."}, {"role": "user", "content": text}],
    )
    return response.choices[0].message.content or ""
