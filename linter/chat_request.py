"""Read-only helpers over an OpenAI chat-completions body that tolerate odd input.

Every helper skips malformed parts (a message that is not an object, content that
is neither a string nor a list of parts) instead of raising: the linter reports on
what it can understand and never crashes on a log record.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import orjson

STATIC_ROLES = frozenset({"system", "developer"})


def messages(body: Mapping[str, Any]) -> list[tuple[int, Mapping[str, Any]]]:
    """``(index, message)`` for every message that is an object."""
    raw = body.get("messages")
    if not isinstance(raw, list):
        return []
    return [(i, m) for i, m in enumerate(raw) if isinstance(m, (dict, Mapping))]


def role(message: Mapping[str, Any]) -> str:
    value = message.get("role")
    return value if isinstance(value, str) else ""


def content_texts(message: Mapping[str, Any], prefix: str) -> Iterator[tuple[str, str]]:
    """``(location, text)`` for a message's string content or each text part."""
    content = message.get("content")
    if isinstance(content, str):
        yield f"{prefix}.content", content
    elif isinstance(content, list):
        for j, part in enumerate(content):
            if isinstance(part, (dict, Mapping)) and isinstance(part.get("text"), str):
                yield f"{prefix}.content[{j}].text", part["text"]


def content_text(message: Mapping[str, Any]) -> str:
    """A message's text content joined (empty when there is none)."""
    return "".join(text for _, text in content_texts(message, ""))


def tools(body: Mapping[str, Any]) -> list[tuple[int, Mapping[str, Any]]]:
    """``(index, tool)`` for every tool that is an object."""
    raw = body.get("tools")
    if not isinstance(raw, list):
        return []
    return [(i, t) for i, t in enumerate(raw) if isinstance(t, (dict, Mapping))]


def tool_name(tool: Mapping[str, Any]) -> str:
    function = tool.get("function")
    if isinstance(function, (dict, Mapping)) and isinstance(function.get("name"), str):
        return str(function["name"])
    name = tool.get("name")
    return name if isinstance(name, str) else ""


def json_strings(value: Any, prefix: str) -> Iterator[tuple[str, str]]:
    """``(json path, string)`` for every string inside a JSON value (keys excluded)."""
    if isinstance(value, str):
        yield prefix, value
    elif isinstance(value, (dict, Mapping)):
        for key, child in value.items():
            yield from json_strings(child, f"{prefix}.{key}")
    elif isinstance(value, list):
        for i, child in enumerate(value):
            yield from json_strings(child, f"{prefix}[{i}]")


_JSON_TEXTS: dict[bytes, tuple[tuple[str, str], ...]] = {}
_JSON_TEXTS_LIMIT = 5_000


def json_texts(value: Any, prefix: str) -> tuple[tuple[str, str], ...]:
    """``tuple(json_strings(value, prefix))``, memoized by the value's serialization.

    Tool lists repeat in nearly every request of an application, so walking them
    once per distinct list keeps the per-request rules fast.
    """
    try:
        key = prefix.encode("utf-8") + b"\x00" + orjson.dumps(value)
    except (TypeError, orjson.JSONEncodeError):
        return tuple(json_strings(value, prefix))
    found = _JSON_TEXTS.get(key)
    if found is None:
        found = tuple(json_strings(value, prefix))
        if len(_JSON_TEXTS) >= _JSON_TEXTS_LIMIT:
            _JSON_TEXTS.clear()
        _JSON_TEXTS[key] = found
    return found


def static_texts(body: Mapping[str, Any]) -> Iterator[tuple[str, str]]:
    """The texts every request of a family shares: system/developer contents, tools, response_format."""
    for i, message in messages(body):
        if role(message) in STATIC_ROLES:
            yield from content_texts(message, f"messages[{i}]")
    raw_tools = body.get("tools")
    if isinstance(raw_tools, list):
        yield from json_texts(raw_tools, "tools")
    response_format = body.get("response_format")
    if isinstance(response_format, (dict, Mapping)):
        yield from json_texts(response_format, "response_format")


def tool_calls(message: Mapping[str, Any]) -> list[Mapping[str, Any]]:
    raw = message.get("tool_calls")
    if not isinstance(raw, list):
        return []
    return [c for c in raw if isinstance(c, (dict, Mapping))]
