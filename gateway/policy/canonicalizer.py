"""Canonicalization of chat-completions bodies so equal prompts get equal prefixes.

Every step is deterministic, idempotent (applying it twice equals applying it once)
and changes only what carries no meaning: JSON values compare equal before and
after, and nothing whose order is significant is reordered. Kept as sent: the
member order of every ``properties`` object (constrained decoding writes an
object's fields in the schema's order, as OpenAI's Structured Outputs do), every
array (``prefixItems``, ``anyOf``/``oneOf``/``allOf``, ``enum``, ``required``),
the values of ``const``/``enum``/``default``/``examples``, the member order of
tool-call arguments (the order the model wrote them in), and the order of
messages and content parts. User and assistant turns are never reordered or
edited. The canonical JSON form is :func:`linter.canonical_json.sort_schema_keys`
(one definition for the gateway and the linter). Steps that changed something are
reported by name, in this order:

- ``tools.keys_sorted``: order-free object keys of each tool sorted recursively
  (a tool's envelope, its schema keywords; ``properties`` members keep their order);
- ``tools.ordered_by_name`` (opt-in, switch ``tool_order``): tools ordered by
  ``function.name`` (only when every tool has a string name; a stable sort keeps
  duplicates in their order). The model reads the tools in the order given: on the
  bundled model this changed a temperature-0 answer, so it is off by default;
- ``response_format.keys_sorted``: order-free keys of ``response_format`` sorted
  recursively, as for tools;
- ``tool_calls.arguments_canonical``: assistant ``tool_calls[].function.arguments``
  that parse as JSON re-serialized compactly, member order kept (else left as sent);
- ``tool_results.reordered``: a run of tool messages right after an assistant turn
  put in that turn's ``tool_calls`` order (only when every id in the run is one
  of that turn's call ids and none repeats);
- ``content.single_text_part``: a content list holding exactly one
  ``{"type": "text", "text": str}`` part becomes that string;
- ``image_url.object_form``: an ``image_url`` part whose ``image_url`` is a bare URL
  string gets OpenAI's object form ``{"url": ...}`` (prefixgate's engine reads both);
- ``image_url.detail_auto_dropped``: ``"detail": "auto"`` is removed from an
  ``image_url`` object: ``auto`` is the default of OpenAI's API and vLLM and
  prefixgate's engine ignore ``detail``, so every upstream reads the part alike.

Whether each step can change what a model generates or how a request is
validated is tabled in docs/gateway.md ("Canonicalization") and checked on the
real model by ``tests/gateway/test_gw_canonical_faithful.py``.

Image steps never touch the URL (a ``data:`` URL's bytes, a remote address) and so
never the pixels; ``detail`` values other than ``auto`` are kept (they change what
OpenAI's models see).

The input body is never mutated: changed parts are copied.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from gateway.config.config_file import CanonicalizeSwitches
from linter.canonical_json import compact_arguments, is_schema_sorted, sort_schema_keys

Body = dict[str, Any]


def sorted_json(value: Any) -> tuple[Any, bool]:
    """``value`` in canonical schema form (order-free keys sorted, order-significant
    parts kept: :func:`linter.canonical_json.sort_schema_keys`), and whether that changed it."""
    if is_schema_sorted(value):
        return value, False
    return sort_schema_keys(value), True


def sort_field_keys(body: Body, field: str) -> bool:
    """Put ``body[field]`` (when a list or object) in canonical schema form; whether that changed it."""
    value = body.get(field)
    if not isinstance(value, list | dict):
        return False
    new_value, changed = sorted_json(value)
    if changed:
        body[field] = new_value
    return changed


def sort_tool_keys(body: Body) -> bool:
    return sort_field_keys(body, "tools") if isinstance(body.get("tools"), list) else False


def _tool_name(tool: Any) -> str | None:
    if isinstance(tool, dict):
        function = tool.get("function")
        if isinstance(function, dict) and isinstance(function.get("name"), str):
            return str(function["name"])
    return None


def order_by_name(body: Body, name_of: Callable[[Any], str | None]) -> bool:
    """Order ``body["tools"]`` by the names ``name_of`` gives (kept as is when one has none);
    whether that changed it."""
    tools = body.get("tools")
    if not isinstance(tools, list) or len(tools) < 2:
        return False
    names = [name_of(tool) for tool in tools]
    if any(name is None for name in names):
        return False
    order = sorted(range(len(tools)), key=lambda i: names[i] or "")
    if order == list(range(len(tools))):
        return False
    body["tools"] = [tools[i] for i in order]
    return True


def order_tools_by_name(body: Body) -> bool:
    return order_by_name(body, _tool_name)


def sort_response_format_keys(body: Body) -> bool:
    return sort_field_keys(body, "response_format") if isinstance(body.get("response_format"), dict) else False


def map_items(body: Body, field: str, edit: Callable[[Any], Any | None]) -> bool:
    """Apply ``edit`` (a new item, or None for unchanged) to each item of the list
    ``body[field]``; the list is copied when one changes. Whether one did."""
    items = body.get(field)
    if not isinstance(items, list):
        return False
    result, changed = list(items), False
    for index, item in enumerate(items):
        new = edit(item)
        if new is not None:
            result[index] = new
            changed = True
    if changed:
        body[field] = result
    return changed


def _compact_message_arguments(message: Any) -> Body | None:
    if not isinstance(message, dict) or not isinstance(message.get("tool_calls"), list):
        return None
    new_calls = list(message["tool_calls"])
    touched = False
    for position, call in enumerate(new_calls):
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict):
            continue
        canonical = compact_arguments(function.get("arguments"))
        if canonical is not None:
            new_calls[position] = {**call, "function": {**function, "arguments": canonical}}
            touched = True
    return {**message, "tool_calls": new_calls} if touched else None


def canonicalize_tool_call_arguments(body: Body) -> bool:
    return map_items(body, "messages", _compact_message_arguments)


def _tool_call_ids(message: Any) -> list[str] | None:
    if not isinstance(message, dict) or message.get("role") != "assistant":
        return None
    calls = message.get("tool_calls")
    if not isinstance(calls, list):
        return None
    ids = [call.get("id") for call in calls if isinstance(call, dict)]
    if len(ids) != len(calls) or not all(isinstance(i, str) for i in ids):
        return None
    return [str(i) for i in ids]


def reorder_tool_results(body: Body) -> bool:
    messages = body.get("messages")
    if not isinstance(messages, list):
        return False
    result = list(messages)
    changed = False
    index = 0
    while index < len(result):
        call_ids = _tool_call_ids(result[index])
        index += 1
        if not call_ids or len(set(call_ids)) != len(call_ids):
            continue
        start = index
        while index < len(result) and isinstance(result[index], dict) and result[index].get("role") == "tool":
            index += 1
        run = result[start:index]
        run_ids = [message.get("tool_call_id") for message in run]
        if len(run) < 2 or len(set(run_ids)) != len(run_ids) or not set(run_ids) <= set(call_ids):
            continue
        rank = {call_id: position for position, call_id in enumerate(call_ids)}
        ordered = sorted(run, key=lambda message: rank[message["tool_call_id"]])
        if [message["tool_call_id"] for message in ordered] != run_ids:
            result[start:index] = ordered
            changed = True
    if changed:
        body["messages"] = result
    return changed


def _single_text(content: Any) -> str | None:
    if isinstance(content, list) and len(content) == 1:
        part = content[0]
        if (
            isinstance(part, dict)
            and set(part) == {"type", "text"}
            and part["type"] == "text"
            and isinstance(part["text"], str)
        ):
            return str(part["text"])
    return None


def _flattened(message: Any) -> Body | None:
    text = _single_text(message.get("content")) if isinstance(message, dict) else None
    return None if text is None else {**message, "content": text}


def flatten_single_text_parts(body: Body) -> bool:
    return map_items(body, "messages", _flattened)


def _map_image_parts(body: Body, edit: Callable[[dict[str, Any]], dict[str, Any] | None]) -> bool:
    """Apply ``edit`` (a new part, or None for unchanged) to every image_url part; copy on change."""

    def edit_message(message: Any) -> Body | None:
        content = message.get("content") if isinstance(message, dict) else None
        if not isinstance(content, list):
            return None
        parts = list(content)
        touched = False
        for position, part in enumerate(content):
            if isinstance(part, dict) and part.get("type") == "image_url":
                new = edit(part)
                if new is not None:
                    parts[position] = new
                    touched = True
        return {**message, "content": parts} if touched else None

    return map_items(body, "messages", edit_message)


def _object_form(part: dict[str, Any]) -> dict[str, Any] | None:
    url = part.get("image_url")
    return {**part, "image_url": {"url": url}} if isinstance(url, str) else None


def _drop_auto_detail(part: dict[str, Any]) -> dict[str, Any] | None:
    spec = part.get("image_url")
    if not isinstance(spec, dict) or spec.get("detail") != "auto":
        return None
    return {**part, "image_url": {k: v for k, v in spec.items() if k != "detail"}}


def image_object_form(body: Body) -> bool:
    return _map_image_parts(body, _object_form)


def drop_auto_image_detail(body: Body) -> bool:
    return _map_image_parts(body, _drop_auto_detail)


STEPS: tuple[tuple[str, str, Callable[[Body], bool]], ...] = (
    ("tools", "tools.keys_sorted", sort_tool_keys),
    ("tool_order", "tools.ordered_by_name", order_tools_by_name),
    ("response_format", "response_format.keys_sorted", sort_response_format_keys),
    ("tool_call_arguments", "tool_calls.arguments_canonical", canonicalize_tool_call_arguments),
    ("tool_result_order", "tool_results.reordered", reorder_tool_results),
    ("single_text_part", "content.single_text_part", flatten_single_text_parts),
    ("image_parts", "image_url.object_form", image_object_form),
    ("image_parts", "image_url.detail_auto_dropped", drop_auto_image_detail),
)
STEP_NAMES: tuple[str, ...] = tuple(name for _, name, _ in STEPS)


def canonicalize(body: Body, switches: CanonicalizeSwitches) -> tuple[Body, list[str]]:
    """A canonical copy of ``body`` (shallow where unchanged) and the steps applied."""
    result = dict(body)
    applied: list[str] = []
    for switch, name, step in STEPS:
        if getattr(switches, switch) and step(result):
            applied.append(name)
    return result, applied
