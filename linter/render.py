"""Rendering a chat-completions body to prompt text, deterministically.

The linter reasons about the prompt an engine would see, so it serializes a body
the way ChatML-style chat templates do: the tools, ``tool_choice`` and
``response_format`` first (a change there invalidates everything after it), then
each message as ``<|im_start|>ROLE\\n...<|im_end|>\\n``, then the generation
prompt. JSON values (tools, tool calls) are written compactly **in the key order
they were given**, so key-order drift shows up as different text, exactly as it
does in a real template.

Invariants: the same body always renders to the same text; every character of
the text belongs to exactly one :class:`Segment`, in order; every boundary
between two segments has a ``<`` or a newline on one side (content parts are
separated by newlines), which :class:`~linter.tokenizer.ApproxTokenizer` relies on; ``static_end`` is the
end of the leading system/developer messages (the part a whole family of requests
shares) and ``history_end`` the end of the last message (the part the next turn of
the conversation should repeat).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import orjson

from linter import chat_request

START, END = "<|im_start|>", "<|im_end|>\n"


@dataclass(frozen=True, slots=True)
class Segment:
    """``text[start:end]`` renders the body part at JSON path ``location``."""

    start: int
    end: int
    location: str
    kind: str  # "tools" | "tool_choice" | "response_format" | "message" | "tool_call" | "markup"


@dataclass(frozen=True, slots=True)
class Rendered:
    text: str
    parts: tuple[str, ...]  # the segments' texts, in order ("".join(parts) == text)
    segments: tuple[Segment, ...]
    static_end: int
    history_end: int

    def segment_at(self, offset: int) -> Segment | None:
        """The segment holding character ``offset`` (None past the end)."""
        for segment in self.segments:
            if segment.start <= offset < segment.end:
                return segment
        return None


def dumps(value: Any) -> str:
    """Compact JSON in the given key order (orjson, with a json fallback for odd values)."""
    try:
        return orjson.dumps(value).decode("utf-8")
    except (TypeError, orjson.JSONEncodeError):
        return json.dumps(value, ensure_ascii=False, separators=(",", ":"), default=str)


class _Writer:
    def __init__(self) -> None:
        self.parts: list[str] = []
        self.segments: list[Segment] = []
        self.pos = 0

    def add(self, text: str, location: str, kind: str) -> None:
        if not text:
            return
        self.parts.append(text)
        self.segments.append(Segment(self.pos, self.pos + len(text), location, kind))
        self.pos += len(text)


def _render_content(writer: _Writer, message: Mapping[str, Any], prefix: str) -> None:
    content = message.get("content")
    if isinstance(content, str):
        writer.add(content, f"{prefix}.content", "message")
    elif isinstance(content, list):
        for j, part in enumerate(content):
            if not isinstance(part, Mapping):
                continue
            if j:
                writer.add("\n", f"{prefix}.content[{j}]", "markup")
            if isinstance(part.get("text"), str):
                writer.add(part["text"], f"{prefix}.content[{j}].text", "message")
            else:
                writer.add(f"<{part.get('type', 'part')}>", f"{prefix}.content[{j}]", "message")


def _render_tool_calls(writer: _Writer, message: Mapping[str, Any], prefix: str) -> None:
    for j, call in enumerate(chat_request.tool_calls(message)):
        function = call.get("function")
        if not isinstance(function, Mapping):
            continue
        arguments = function.get("arguments")
        name = dumps(function.get("name"))
        args = arguments if isinstance(arguments, str) else dumps(arguments)
        writer.add(f"\n<tool_call>{{\"name\":{name},\"arguments\":{args}}}</tool_call>", f"{prefix}.tool_calls[{j}]", "tool_call")


def render(body: Mapping[str, Any]) -> Rendered:
    """The prompt text of ``body`` with its segments (see the module docstring)."""
    w = _Writer()
    tools = body.get("tools")
    if isinstance(tools, list) and tools:
        w.add(f"{START}tools\n", "tools", "markup")
        for i, tool in enumerate(tools):
            w.add(dumps(tool) + "\n", f"tools[{i}]", "tools")
        w.add(END, "tools", "markup")
    for key in ("tool_choice", "response_format"):
        if body.get(key) is not None:
            w.add(f"{START}{key}\n{dumps(body[key])}{END}", key, key)
    static_end = w.pos
    leading = True
    raw = body.get("messages")
    for i, message in enumerate(raw if isinstance(raw, list) else []):
        if not isinstance(message, Mapping):
            continue
        prefix = f"messages[{i}]"
        role = chat_request.role(message)
        w.add(f"{START}{role}\n", f"{prefix}.role", "markup")
        _render_content(w, message, prefix)
        _render_tool_calls(w, message, prefix)
        w.add(END, prefix, "markup")
        leading = leading and role in chat_request.STATIC_ROLES
        if leading:
            static_end = w.pos
    history_end = w.pos
    w.add(f"{START}assistant\n", "generation prompt", "markup")
    return Rendered("".join(w.parts), tuple(w.parts), tuple(w.segments), static_end, history_end)
