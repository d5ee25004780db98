"""Canonical JSON: keys sorted at every level, compact separators.

Two JSON values that are equal as data have the same canonical form, so a
template that serializes canonical values renders equal tools, schemas and
tool-call arguments to identical tokens. :func:`canonicalize_body` is the fix
PS104 simulates; it returns the same object when nothing changes.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from linter import chat_request
from linter.rule import Body


def sort_keys(value: Any) -> Any:
    """``value`` with every object's keys sorted (recursively)."""
    if isinstance(value, (dict, Mapping)):
        return {k: sort_keys(value[k]) for k in sorted(value, key=str)}
    if isinstance(value, list):
        return [sort_keys(v) for v in value]
    return value


def is_sorted(value: Any) -> bool:
    """True when every object inside ``value`` lists its keys in sorted order."""
    if isinstance(value, (dict, Mapping)):
        keys = [str(k) for k in value]
        return keys == sorted(keys) and all(is_sorted(v) for v in value.values())
    if isinstance(value, list):
        return all(is_sorted(v) for v in value)
    return True


def canonical_text(value: Any) -> str:
    """The canonical serialization: sorted keys, ``(",", ":")`` separators, UTF-8 kept."""
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def parse_json(text: str) -> tuple[bool, Any]:
    """``(True, value)`` when ``text`` is JSON, else ``(False, None)``."""
    try:
        return True, json.loads(text)
    except (ValueError, RecursionError):
        return False, None


def _canonical_arguments(message: Mapping[str, Any]) -> Mapping[str, Any]:
    calls = message.get("tool_calls")
    if not isinstance(calls, list):
        return message
    new_calls: list[Any] = []
    changed = False
    for call in calls:
        function = call.get("function") if isinstance(call, (dict, Mapping)) else None
        args = function.get("arguments") if isinstance(function, (dict, Mapping)) else None
        if isinstance(args, str):
            ok, value = parse_json(args)
            if ok and canonical_text(value) != args:
                call = {**call, "function": {**function, "arguments": canonical_text(value)}}  # type: ignore[dict-item]
                changed = True
        new_calls.append(call)
    return {**message, "tool_calls": new_calls} if changed else message


def _sorted_parameters(tools: Any) -> Any:
    if not isinstance(tools, list):
        return tools
    out: list[Any] = []
    for tool in tools:
        function = tool.get("function") if isinstance(tool, (dict, Mapping)) else None
        if isinstance(function, (dict, Mapping)) and "parameters" in function and not is_sorted(function["parameters"]):
            tool = {**tool, "function": {**function, "parameters": sort_keys(function["parameters"])}}
        out.append(tool)
    return out if any(a is not b for a, b in zip(out, tools, strict=True)) else tools


def canonicalize_body(body: Body, *, whole_tools: bool = True) -> Body:
    """``body`` with tools, response_format and tool-call arguments in canonical form.

    With ``whole_tools=False`` only each tool's ``parameters`` schema is sorted
    (the part PS104 checks); the envelope keys keep their order.
    """
    fixed: dict[str, Any] = dict(body)
    changed = False
    tools = body.get("tools")
    if whole_tools and tools is not None and not is_sorted(tools):
        fixed["tools"] = sort_keys(tools)
        changed = True
    elif not whole_tools and _sorted_parameters(tools) is not tools:
        fixed["tools"] = _sorted_parameters(tools)
        changed = True
    response_format = body.get("response_format")
    if response_format is not None and not is_sorted(response_format):
        fixed["response_format"] = sort_keys(response_format)
        changed = True
    raw = body.get("messages")
    if isinstance(raw, list):
        new_messages = [_canonical_arguments(m) if isinstance(m, (dict, Mapping)) else m for m in raw]
        if any(a is not b for a, b in zip(new_messages, raw, strict=True)):
            fixed["messages"] = new_messages
            changed = True
    return fixed if changed else body


def tool_names(body: Body) -> list[str]:
    return [chat_request.tool_name(t) for _, t in chat_request.tools(body)]
