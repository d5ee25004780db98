"""Canonical JSON: one spelling per value, without reordering anything whose order means something.

Two spellings of one canonical form, for the gateway and the linter alike:

* :func:`sort_keys` / :func:`canonical_text`: keys sorted at every level, compact
  separators. For comparing values as data (is this the same tool, the same
  arguments?), never for what is sent upstream.
* :func:`sort_schema_keys`: the form the gateway sends and PS104 asks for. Keys
  of tools, tool schemas and ``response_format`` are sorted where their order is
  free, and kept where it is significant: the members of ``properties`` and
  ``patternProperties`` keep their order (constrained decoding, like OpenAI's
  Structured Outputs, writes an object's fields in the schema's order, so sorting
  them changes the answer), and the values of ``const``, ``enum``, ``default``
  and ``examples`` are data, kept exactly as sent. Arrays are never reordered
  (``prefixItems``, ``anyOf``/``oneOf``/``allOf``, ``enum``, ``required``).
* :func:`compact_arguments`: a tool call's JSON arguments re-serialized compactly,
  member order kept (the order the model wrote them in).

:func:`canonicalize_body` is the fix PS104 simulates; it returns the same object
when nothing changes.
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


ORDERED_MEMBERS = frozenset({"properties", "patternProperties"})
"""Schema keywords whose members' order is significant (generation order): kept."""
DATA_KEYWORDS = frozenset({"const", "enum", "default", "examples"})
"""Schema keywords whose value is data, not schema: kept exactly as sent."""


def sort_schema_keys(value: Any) -> Any:
    """``value`` (a tool, a schema, a ``response_format``) with order-free keys sorted.

    Members of ``properties``/``patternProperties`` keep their order (each member
    is a schema, handled recursively); ``const``/``enum``/``default``/``examples``
    values are kept as sent; lists keep their order. Idempotent.
    """
    if isinstance(value, (dict, Mapping)):
        out: dict[Any, Any] = {}
        for key in sorted(value, key=str):
            child = value[key]
            if key in DATA_KEYWORDS:
                out[key] = child
            elif key in ORDERED_MEMBERS and isinstance(child, (dict, Mapping)):
                out[key] = {name: sort_schema_keys(member) for name, member in child.items()}
            else:
                out[key] = sort_schema_keys(child)
        return out
    if isinstance(value, list):
        return [sort_schema_keys(v) for v in value]
    return value


def first_schema_unsorted(value: Any, path: str) -> str | None:
    """JSON path of the first object whose order-free keys are not sorted (see
    :func:`sort_schema_keys`), or None when ``value`` is in canonical form."""
    if isinstance(value, (dict, Mapping)):
        keys = [str(k) for k in value]
        if keys != sorted(keys):
            return path
        for key, child in value.items():
            if key in DATA_KEYWORDS:
                continue
            if key in ORDERED_MEMBERS and isinstance(child, (dict, Mapping)):
                for name, member in child.items():
                    found = first_schema_unsorted(member, f"{path}.{key}.{name}")
                    if found is not None:
                        return found
                continue
            found = first_schema_unsorted(child, f"{path}.{key}")
            if found is not None:
                return found
    elif isinstance(value, list):
        for i, child in enumerate(value):
            found = first_schema_unsorted(child, f"{path}[{i}]")
            if found is not None:
                return found
    return None


def is_schema_sorted(value: Any) -> bool:
    """True when ``value`` is in :func:`sort_schema_keys` form."""
    return first_schema_unsorted(value, "") is None


def compact_arguments(arguments: Any) -> str | None:
    """Tool-call ``arguments`` that parse as JSON, compact with member order kept; else None.

    None also when the text already is that form, or is nested too deep to re-encode.
    """
    if not isinstance(arguments, str):
        return None
    ok, value = parse_json(arguments)
    if not ok:
        return None
    try:
        compact = json.dumps(value, separators=(",", ":"), ensure_ascii=False)
    except (ValueError, RecursionError):
        return None
    return None if compact == arguments else compact


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
        compact = compact_arguments(args)
        if compact is not None:
            call = {**call, "function": {**function, "arguments": compact}}  # type: ignore[dict-item]
            changed = True
        new_calls.append(call)
    return {**message, "tool_calls": new_calls} if changed else message


def _sorted_parameters(tools: Any) -> Any:
    if not isinstance(tools, list):
        return tools
    out: list[Any] = []
    for tool in tools:
        function = tool.get("function") if isinstance(tool, (dict, Mapping)) else None
        if (isinstance(function, (dict, Mapping)) and "parameters" in function
                and not is_schema_sorted(function["parameters"])):
            tool = {**tool, "function": {**function, "parameters": sort_schema_keys(function["parameters"])}}
        out.append(tool)
    return out if any(a is not b for a, b in zip(out, tools, strict=True)) else tools


def canonicalize_body(body: Body, *, whole_tools: bool = True) -> Body:
    """``body`` with tools, response_format (:func:`sort_schema_keys`) and tool-call
    arguments (:func:`compact_arguments`) in canonical form.

    With ``whole_tools=False`` only each tool's ``parameters`` schema is sorted
    (the part PS104 checks); the envelope keys keep their order.
    """
    fixed: dict[str, Any] = dict(body)
    changed = False
    tools = body.get("tools")
    if whole_tools and tools is not None and not is_schema_sorted(tools):
        fixed["tools"] = sort_schema_keys(tools)
        changed = True
    elif not whole_tools and _sorted_parameters(tools) is not tools:
        fixed["tools"] = _sorted_parameters(tools)
        changed = True
    response_format = body.get("response_format")
    if response_format is not None and not is_schema_sorted(response_format):
        fixed["response_format"] = sort_schema_keys(response_format)
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
