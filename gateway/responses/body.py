"""Responses API bodies in the gateway: their chat view and their canonicalization.

The gateway treats ``POST /v1/responses`` like chat. Two helpers make that possible
without a second implementation of either side:

* :func:`chat_view` is the chat request a Responses request stands for (the
  engine's own translation, :func:`engine.contract.responses_request.to_chat_body`: pure
  Python, no torch), used for prefix warnings, block keys and the OpenAI
  ``prompt_cache_key`` family; None when the body cannot be translated (the
  upstream then answers the 400 itself);
* :func:`canonicalize_responses` applies the chat canonicalizer's steps to the
  Responses spellings of the same fields, under the same switches and step names:
  ``tools`` (flat ``{"type": "function", "name", ...}``: keys sorted, ordered by
  name), ``text.format`` (keys sorted, reported as ``response_format.keys_sorted``)
  and ``function_call`` items' ``arguments`` (compact JSON with sorted keys).
  ``instructions`` and ``input`` texts are never edited. The input body is never
  mutated;
* :func:`canonical_chat_view` is the chat view of a canonical Responses body put
  through the chat canonicalizer too, so a tool (or schema, or call) has one
  canonical form whichever endpoint carried it: the same tool sent through
  ``/v1/responses`` and then ``/v1/chat/completions`` compares equal in the prefix
  warnings (the Responses tool's flat keys would otherwise be nested in the
  engine's translation order, a false PS203).
"""

from __future__ import annotations

from typing import Any

import orjson

from gateway.config.config_file import CanonicalizeSwitches
from gateway.policy.canonicalizer import (
    canonicalize,
    map_items,
    order_by_name,
    sort_tool_keys,
    sorted_json,
)
from linter.canonical_json import compact_arguments

Body = dict[str, Any]


def chat_view(body: Body) -> Body | None:
    """The equivalent chat request, or None when ``body`` does not translate."""
    from engine.contract.errors import APIError
    from engine.contract.responses_request import to_chat_body

    try:
        return to_chat_body(orjson.loads(orjson.dumps(body)))
    except (APIError, TypeError, ValueError):
        return None


def _flat_tool_name(tool: Any) -> str | None:
    name = tool.get("name") if isinstance(tool, dict) else None
    return name if isinstance(name, str) else None


def _order_flat_tools(body: Body) -> bool:
    return order_by_name(body, _flat_tool_name)


def _sort_format_keys(body: Body) -> bool:
    text = body.get("text")
    if not isinstance(text, dict) or not isinstance(text.get("format"), dict):
        return False
    value, changed = sorted_json(text["format"])
    if changed:
        body["text"] = {**text, "format": value}
    return changed


def _compact_call(item: Any) -> Body | None:
    if not isinstance(item, dict) or item.get("type") != "function_call":
        return None
    canonical = compact_arguments(item.get("arguments"))
    return None if canonical is None else {**item, "arguments": canonical}


def _canonical_call_arguments(body: Body) -> bool:
    return map_items(body, "input", _compact_call)


STEPS = (
    ("tools", "tools.keys_sorted", sort_tool_keys),
    ("tool_order", "tools.ordered_by_name", _order_flat_tools),
    ("response_format", "response_format.keys_sorted", _sort_format_keys),
    ("tool_call_arguments", "tool_calls.arguments_canonical", _canonical_call_arguments),
)


def canonicalize_responses(body: Body, switches: CanonicalizeSwitches) -> tuple[Body, list[str]]:
    """A canonical copy of a Responses ``body`` and the steps applied (see the module docstring)."""
    result = dict(body)
    applied = [name for switch, name, step in STEPS if getattr(switches, switch) and step(result)]
    return result, applied


def canonical_chat_view(body: Body, switches: CanonicalizeSwitches) -> Body | None:
    """The chat view of ``body`` (a canonical Responses body) in the chat canonical form, or None."""
    view = chat_view(body)
    return None if view is None else canonicalize(view, switches)[0]
