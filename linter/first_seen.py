"""Fixes that make requests consistent with the first spelling the log used (PS202, PS203).

A difference between requests is repaired by sending what the earlier request
sent: the same tool order for the same set of tools, the same bytes for equal
JSON. Rewriting every request into one canonical form would also work, but it
would change consistent requests too and shift their block boundaries, so the
estimate's gain would mix the repair with rendering noise. These fixers change
only the requests that deviate from the first spelling, which makes the gain of
the fix exactly what the deviating requests (and those after them) win back.

A fixer remembers what it has seen, so it must see the corpus in order;
:meth:`fresh` gives a new one for each replay (``estimate`` calls it).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import orjson

from linter import chat_request
from linter.canonical_json import canonical_text, parse_json, sort_keys
from linter.rule import Body


def _text(value: Any) -> str:
    try:
        return orjson.dumps(value).decode("utf-8")
    except (TypeError, orjson.JSONEncodeError):
        return repr(value)


class FirstToolOrder:
    """The PS202 fix: tools in the order in which the log first sent the same set of tools."""

    def __init__(self) -> None:
        self._orders: dict[tuple[str, ...], list[str]] = {}

    def fresh(self) -> FirstToolOrder:
        return FirstToolOrder()

    def __call__(self, body: Body) -> Body:
        tools = body.get("tools")
        if not isinstance(tools, list) or not all(isinstance(t, Mapping) for t in tools):
            return body
        names = [chat_request.tool_name(t) for t in tools]
        if len(set(names)) != len(names):
            return body
        first = self._orders.setdefault(tuple(sorted(names)), names)
        if first == names:
            return body
        by_name = {chat_request.tool_name(t): t for t in tools}
        return {**body, "tools": [by_name[name] for name in first]}


class FirstJsonSpelling:
    """The PS203 fix: tools, ``response_format`` and tool-call arguments spelled as the log first spelled equal data."""

    def __init__(self) -> None:
        self._values: dict[str, Any] = {}
        self._arguments: dict[str, str] = {}

    def fresh(self) -> FirstJsonSpelling:
        return FirstJsonSpelling()

    def _value(self, value: Any) -> Any:
        key = canonical_text(sort_keys(value)) if isinstance(value, (dict, list)) else None
        if key is None:
            return value
        first = self._values.setdefault(key, value)
        return first if _text(first) != _text(value) else value

    def _calls(self, message: Any) -> Any:
        calls = message.get("tool_calls") if isinstance(message, Mapping) else None
        if not isinstance(calls, list):
            return message
        new_calls = []
        for call in calls:
            function = call.get("function") if isinstance(call, Mapping) else None
            args = function.get("arguments") if isinstance(function, Mapping) else None
            if isinstance(args, str):
                ok, value = parse_json(args)
                if ok:
                    first = self._arguments.setdefault(canonical_text(value), args)
                    if first != args:
                        call = {**call, "function": {**function, "arguments": first}}  # type: ignore[dict-item]
            new_calls.append(call)
        return {**message, "tool_calls": new_calls} if any(a is not b for a, b in zip(new_calls, calls, strict=True)) else message

    def __call__(self, body: Body) -> Body:
        fixed: dict[str, Any] = dict(body)
        tools = body.get("tools")
        if isinstance(tools, list):
            new_tools = [self._value(t) for t in tools]
            if any(a is not b for a, b in zip(new_tools, tools, strict=True)):
                fixed["tools"] = new_tools
        if body.get("response_format") is not None:
            fixed["response_format"] = self._value(body["response_format"])
        raw = body.get("messages")
        if isinstance(raw, list):
            new_messages = [self._calls(m) for m in raw]
            if any(a is not b for a, b in zip(new_messages, raw, strict=True)):
                fixed["messages"] = new_messages
        changed = any(fixed.get(k) is not body.get(k) for k in ("tools", "response_format", "messages"))
        return fixed if changed else body
