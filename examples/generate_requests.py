"""Regenerates examples/requests.jsonl (planted cache breaks) and examples/clean/requests.jsonl.

Run ``python examples/generate_requests.py`` from the repository root. The
planted breaks and the lines they are on are listed in ``PLANTED``; the linter's
tests check that ``prefixgate lint`` finds exactly these.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather for a city.",
        "parameters": {
            "additionalProperties": False,
            "properties": {"city": {"description": "City name", "type": "string"}, "unit": {"enum": ["C", "F"], "type": "string"}},
            "required": ["city"],
            "type": "object",
        },
    },
}
SEARCH = {
    "type": "function",
    "function": {
        "name": "search_docs",
        "description": "Search the product documentation.",
        "parameters": {
            "properties": {"query": {"type": "string"}},
            "required": ["query"],
            "type": "object",
        },
    },
}
# The same search tool with its schema keys in another order (same data).
SEARCH_REORDERED = {
    "type": "function",
    "function": {
        "name": "search_docs",
        "description": "Search the product documentation.",
        "parameters": {"type": "object", "required": ["query"], "properties": {"query": {"type": "string"}}},
    },
}
TOOLS = [WEATHER, SEARCH]
SUPPORT = (
    "You are the support assistant of ACME Cloud. Answer briefly and precisely, cite the "
    "documentation when you use it, and call tools when you need live data. Never invent prices, "
    "limits or dates; say that you do not know instead. Keep a friendly, professional tone."
)
BILLING = (
    "You are the billing assistant of ACME Cloud. Explain invoices, plans, credits and refunds "
    "clearly and briefly. Quote amounts exactly as they appear on the invoice and never promise "
    "a refund; explain how to request one instead."
)
MODEL = "smollm2-135m"


def system(text: str) -> dict[str, Any]:
    return {"role": "system", "content": text}


def user(text: str) -> dict[str, Any]:
    return {"role": "user", "content": text}


def assistant(text: str) -> dict[str, Any]:
    return {"role": "assistant", "content": text}


def call(call_id: str, name: str, arguments: str) -> dict[str, Any]:
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


def calls(*items: dict[str, Any]) -> dict[str, Any]:
    return {"role": "assistant", "content": None, "tool_calls": list(items)}


def tool(call_id: str, content: str) -> dict[str, Any]:
    return {"role": "tool", "tool_call_id": call_id, "content": content}


def body(messages: list[dict[str, Any]], conversation: str, tools: list[dict[str, Any]] | None = None, **extra: Any) -> dict[str, Any]:
    out: dict[str, Any] = {"model": MODEL, "messages": messages}
    if tools is not None:
        out["tools"] = tools
    out["metadata"] = {"conversation_id": conversation}
    out.update(extra)
    return out


W_PARIS = call("call_1", "get_weather", '{"city":"Paris"}')
C1_T1 = [system(SUPPORT), user("What is the weather in Paris right now?")]
C1_T2 = [*C1_T1, calls(W_PARIS), tool("call_1", '{"sky":"sunny","temp_c":21}'), assistant("It is sunny and 21 °C in Paris."), user("And should I take an umbrella tomorrow?")]
C1_T3 = [*C1_T2, assistant("No rain is expected tomorrow, so you can leave it at home."), user("Thanks! How do I rotate my API key?")]
PAR = calls(call("call_a", "get_weather", '{"city":"Oslo"}'), call("call_b", "search_docs", '{"query":"snow chains"}'))


def planted() -> list[dict[str, Any] | tuple[str, dict[str, Any]]]:
    """Records in file order; a tuple wraps the body in a log record under that key."""
    return [
        # 1: clean first turn.
        body(C1_T1, "c1", TOOLS),
        # 2: clean second turn (appended), wrapped in a log record.
        ("request", body(C1_T2, "c1", TOOLS)),
        # 3: PS101 - a volatile timestamp in the billing instructions (first of its family).
        body([system("Current time: 2026-11-21T09:00:00Z. " + BILLING), user("Why was I charged twice?")], "b1"),
        # 4: PS101 + PS201 - the next billing request differs inside the timestamp.
        ("body", body([system("Current time: 2026-11-21T09:05:13Z. " + BILLING), user("How do I download an invoice?")], "b2")),
        # 5: PS202 - same support family, tools in another order.
        body([system(SUPPORT), user("Where are the docs for webhooks?")], "c2", [SEARCH, WEATHER]),
        # 6: PS104 + PS203 - same tools, search schema keys in another order.
        body([system(SUPPORT), user("How do I create a bucket?")], "c3", [WEATHER, SEARCH_REORDERED]),
        # 7: clean third turn of c1 (appended).
        body(C1_T3, "c1", TOOLS),
        # 8: PS204 - c1 again, history truncated in the middle (sliding window).
        body([system(SUPPORT), *C1_T3[4:], assistant("Go to Settings > API keys and click Rotate."), user("Does rotation break old tokens?")], "c1", TOOLS),
        # 9: PS105 - parallel tool results appended in completion order.
        body([system(SUPPORT), user("Weather in Oslo and docs on snow chains?"), PAR, tool("call_b", "Snow chains: see page 4."), tool("call_a", '{"sky":"snow","temp_c":-3}')], "c4", TOOLS),
        # 10: PS103 - a system message after the conversation started.
        body([system(SUPPORT), user("Hello!"), assistant("Hi, how can I help?"), system("From now on answer in French."), user("What is ACME Cloud?")], "c5", TOOLS),
        # 11: PS102 - user data in the instructions (a different family: per user).
        body([system(SUPPORT + " The customer's name is Ada Lovelace, email ada@example.com."), user("What plan am I on?")], "c6", TOOLS),
        # 12: PS106 - a trailing newline in the instructions.
        body([system(SUPPORT + "\n"), user("How fast is support?")], "c7", TOOLS),
        # 13: clean first turn.
        body([system(SUPPORT), user("Is it raining in Rome?")], "c8", TOOLS),
        # 14: PS205 - second turn changes tool_choice.
        body([system(SUPPORT), user("Is it raining in Rome?"), assistant("Let me check."), user("Please check now.")], "c8", TOOLS, tool_choice="required"),
        # 15: PS104 - tool-call arguments in an odd spacing.
        body([system(SUPPORT), user("Weather in Lyon in F?"), calls(call("call_9", "get_weather", '{"unit":  "F", "city": "Lyon"}')), tool("call_9", '{"sky":"cloudy","temp_f":60}')], "c9", TOOLS),
        # 16: PS203 - the next turn re-serializes those arguments with sorted keys.
        body([system(SUPPORT), user("Weather in Lyon in F?"), calls(call("call_9", "get_weather", '{"city":"Lyon","unit":"F"}')), tool("call_9", '{"sky":"cloudy","temp_f":60}'), assistant("Cloudy, 60 °F."), user("Thanks.")], "c9", TOOLS),
    ]


PLANTED: list[tuple[int, str]] = [
    (3, "PS101"), (4, "PS101"), (5, "PS202"), (6, "PS203"), (8, "PS204"), (14, "PS205"), (16, "PS203"),
]
"""(line, code) of every finding ``prefixgate lint examples/requests.jsonl`` must report with the default rules.

Line 4's timestamp also makes the family's prefix diverge (PS201): one cause, reported once, as PS101."""

PLANTED_OPT_IN: list[tuple[int, str]] = [
    (6, "PS104"), (9, "PS105"), (10, "PS103"), (11, "PS102"), (11, "PS102"), (12, "PS106"), (15, "PS104"),
]
"""What the opt-in hygiene rules add with ``--select ALL``."""


def clean() -> list[dict[str, Any]]:
    """A corpus that follows every rule: stable prefix, append-only history, canonical JSON."""
    d1 = [system(SUPPORT), user("Current time: 2026-11-21T09:00:00Z\n\nWhat is the weather in Paris?")]
    d2 = [*d1, calls(W_PARIS), tool("call_1", '{"sky":"sunny","temp_c":21}'), assistant("Sunny, 21 °C."), user("And in Oslo and docs on snow chains?")]
    d3 = [*d2, PAR, tool("call_a", '{"sky":"snow","temp_c":-3}'), tool("call_b", "Snow chains: see page 4."), assistant("Snowy in Oslo; chains are on page 4."), user("Thanks!")]
    e1 = [system(SUPPORT), user("How do I rotate my API key?")]
    e2 = [*e1, assistant("Settings > API keys > Rotate."), user("Does rotation break old tokens?")]
    return [
        body(d1, "d1", TOOLS), body(d2, "d1", TOOLS), body(e1, "e1", TOOLS), body(d3, "d1", TOOLS), body(e2, "e1", TOOLS),
        body([system(BILLING), user("Why was I charged twice?")], "f1"),
        body([system(BILLING), user("How do I download an invoice?")], "f2"),
    ]


def _line(record: dict[str, Any] | tuple[str, dict[str, Any]]) -> str:
    if isinstance(record, tuple):
        key, inner = record
        return json.dumps({"time": "2026-11-21T09:00:00Z", key: inner}, ensure_ascii=False)
    return json.dumps(record, ensure_ascii=False)


def main() -> None:
    (HERE / "requests.jsonl").write_text("".join(_line(r) + "\n" for r in planted()), encoding="utf-8")
    (HERE / "clean" / "requests.jsonl").write_text("".join(_line(r) + "\n" for r in clean()), encoding="utf-8")


if __name__ == "__main__":
    main()
