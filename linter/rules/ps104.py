"""PS104 non-canonical-json: tool schemas, response_format or tool-call arguments are not canonical JSON.

Why it matters
    JSON is rendered into the prompt as text. When its keys come in whatever
    order the code happened to build them, two requests with equal tools or
    equal arguments can serialize differently (a dict merged in another order,
    another library, another process), and the prefix breaks at the first
    reordered key. Canonical JSON (order-free keys sorted, fixed separators) has
    one spelling per value, so equal data is always equal text. The members of
    ``properties`` are not order-free: constrained decoding writes an object's
    fields in the schema's order, so their order is part of what the request
    means and is never asked to be sorted.

Anti-pattern
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "unit": {"type": "string"}}}
    "arguments": "{\\"city\\": \\"Paris\\",  \\"unit\\": \\"C\\"}"

Better
    Build schemas with their keywords sorted (or let the gateway canonicalize them),
    fields in the order you want them written, and emit arguments with
    json.dumps(args) or json.dumps(args, separators=(",", ":")).

Opt-in hygiene rule (``--extend-select PS104``): keys in a consistent but
unsorted order break nothing. In the default rules, equal JSON serialized
differently between requests is reported where it happens (PS203).
Checked: ``tools[i].function.parameters`` and ``response_format`` (keys sorted
at every level except the members of ``properties`` and the values of ``const``,
``enum``, ``default``, ``examples``: :func:`linter.canonical_json.sort_schema_keys`)
and every tool call's ``arguments`` string (one of json.dumps's two standard
spacings, member order as written). The envelope keys of a tool
(``type``, ``function``, ``name``) are left alone: SDKs write them in a fixed order.
Fix used by the estimate: parameter schemas, response_format and arguments in
canonical form.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping
from typing import Any

import orjson

from linter import chat_request
from linter.canonical_json import canonicalize_body, first_schema_unsorted, parse_json
from linter.rule import Body, Hit, Options, Rule


def _standard_spellings(value: Any) -> set[str]:
    return {
        json.dumps(value, separators=separators, ensure_ascii=ascii_only)
        for separators in ((",", ":"), (", ", ": "))
        for ascii_only in (True, False)
    }


def _tool_hits(body: Body) -> Iterator[Hit]:
    for i, tool in chat_request.tools(body):
        function = tool.get("function")
        if isinstance(function, (dict, Mapping)) and "parameters" in function:
            path = first_schema_unsorted(function["parameters"], f"tools[{i}].function.parameters")
            if path is not None:
                yield Hit(f"keys of {path} are not sorted", path, needle=chat_request.tool_name(tool) or None)


_TOOL_HITS: dict[bytes, tuple[Hit, ...]] = {}


def _memo_tool_hits(body: Body) -> tuple[Hit, ...]:
    """Tool hits, memoized by the tools' serialization (a tool list repeats in every request)."""
    try:
        key = orjson.dumps(body.get("tools"))
    except (TypeError, orjson.JSONEncodeError):
        return tuple(_tool_hits(body))
    hits = _TOOL_HITS.get(key)
    if hits is None:
        hits = tuple(_tool_hits(body))
        if len(_TOOL_HITS) >= 2_000:
            _TOOL_HITS.clear()
        _TOOL_HITS[key] = hits
    return hits


def check(body: Body, options: Options) -> Iterator[Hit]:
    yield from _memo_tool_hits(body)
    if "response_format" in body:
        path = first_schema_unsorted(body["response_format"], "response_format")
        if path is not None:
            yield Hit(f"keys of {path} are not sorted", path, needle='"response_format"')
    for i, message in chat_request.messages(body):
        for j, call in enumerate(chat_request.tool_calls(message)):
            function = call.get("function")
            args = function.get("arguments") if isinstance(function, (dict, Mapping)) else None
            if not isinstance(args, str):
                continue
            ok, value = parse_json(args)
            if ok and args not in _standard_spellings(value):
                yield Hit(
                    "tool-call arguments are not canonical JSON (standard spacing)",
                    f"messages[{i}].tool_calls[{j}].function.arguments",
                    needle='"arguments"',
                )


def fix(body: Body) -> Body:
    return canonicalize_body(body, whole_tools=False)


RULE = Rule(
    code="PS104",
    name="non-canonical-json",
    severity="warning",
    scope="request",
    summary="Tool schemas or response_format with unsorted order-free keys, or oddly spaced tool-call arguments",
    doc=__doc__ or "",
    check_request=check,
    fix=fix,
    default=False,
)
