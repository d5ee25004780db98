"""Moving spans out of the shared prefix: the fix that PS101, PS102 and PS201 simulate.

:func:`move_spans_to_end` returns a copy of a body in which the spans a finder
reports in the static parts (system/developer contents, tools, response_format)
are cut out and appended, in order, as one final user message. The original body
is returned unchanged (the same object) when the finder reports nothing, so
callers can tell cheaply that a fix does not apply.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from linter import chat_request
from linter.rule import Body

SpanFinder = Callable[[str], list[tuple[int, int]]]


def _cut(text: str, spans: list[tuple[int, int]], moved: list[str]) -> str:
    parts: list[str] = []
    pos = 0
    for start, end in spans:
        if start < pos:
            continue
        parts.append(text[pos:start])
        moved.append(text[start:end])
        pos = end
    parts.append(text[pos:])
    return "".join(parts)


def _transform(value: Any, finder: SpanFinder, moved: list[str]) -> Any:
    if isinstance(value, str):
        spans = finder(value)
        return _cut(value, spans, moved) if spans else value
    if isinstance(value, (dict, Mapping)):
        return {k: _transform(v, finder, moved) for k, v in value.items()}
    if isinstance(value, list):
        return [_transform(v, finder, moved) for v in value]
    return value


def move_spans_to_end(body: Body, finder: SpanFinder) -> Body:
    """``body`` with the found spans of its static parts moved into a trailing user message."""
    if not any(finder(text) for _, text in chat_request.static_texts(body)):
        return body
    moved: list[str] = []
    fixed: dict[str, Any] = dict(body)
    raw_messages = body.get("messages")
    if isinstance(raw_messages, list):
        new_messages: list[Any] = []
        for message in raw_messages:
            if isinstance(message, (dict, Mapping)) and chat_request.role(message) in chat_request.STATIC_ROLES:
                message = {**message, "content": _transform(message.get("content"), finder, moved)}
            new_messages.append(message)
        fixed["messages"] = new_messages
    for key in ("tools", "response_format"):
        if key in body:
            fixed[key] = _transform(body[key], finder, moved)  # builds new containers
    if moved:
        fixed.setdefault("messages", [])
        fixed["messages"] = [*fixed["messages"], {"role": "user", "content": "Context: " + " | ".join(moved)}]
    return fixed
