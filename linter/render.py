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

An image part (chat ``image_url``, Responses ``input_image``) renders as one segment
of kind ``"image"``: ``<image NAME>`` (the image's identity, see
:mod:`linter.image_parts`) followed by `` img`` repeated so that the text counts about
the image's estimated tokens. The same image always renders alike; another image
differs right after ``<image ``, where an engine's cache stops matching too.
"""

from __future__ import annotations

import bisect
import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import orjson

from linter import chat_request
from linter.image_parts import ImagePart, image_part

START, END = "<|im_start|>", "<|im_end|>\n"


@dataclass(frozen=True, slots=True)
class Segment:
    """``text[start:end]`` renders the body part at JSON path ``location``."""

    start: int
    end: int
    location: str
    kind: str  # "tools" | "tool_choice" | "response_format" | "message" | "tool_call" | "image" | "markup"


@dataclass(frozen=True, slots=True)
class Rendered:
    text: str
    parts: tuple[str, ...]  # the segments' texts, in order ("".join(parts) == text)
    ends: tuple[int, ...]  # each segment's end offset
    locations: tuple[str, ...]
    kinds: tuple[str, ...]
    static_end: int
    history_end: int
    anchor_parts: int  # parts up to the end of the first non-static message (identifies a conversation)
    static_parts: int  # parts up to static_end

    def segment(self, index: int) -> Segment:
        start = self.ends[index - 1] if index else 0
        return Segment(start, self.ends[index], self.locations[index], self.kinds[index])

    def segment_at(self, offset: int) -> Segment | None:
        """The segment holding character ``offset`` (None past the end)."""
        index = bisect.bisect_right(self.ends, offset)
        return self.segment(index) if index < len(self.ends) else None

    def parts_before(self, offset: int) -> int | None:
        """How many whole parts make up ``text[:offset]``, or None when ``offset`` is inside one."""
        count = bisect.bisect_right(self.ends, offset)
        return count if count == 0 or self.ends[count - 1] == offset else None


def dumps(value: Any) -> str:
    """Compact JSON in the given key order (orjson, with a json fallback for odd values)."""
    try:
        return orjson.dumps(value).decode("utf-8")
    except (TypeError, orjson.JSONEncodeError):
        return json.dumps(value, ensure_ascii=False, separators=(",", ":"), default=str)


class _Writer:
    def __init__(self) -> None:
        self.parts: list[str] = []
        self.ends: list[int] = []
        self.locations: list[str] = []
        self.kinds: list[str] = []
        self.pos = 0

    def add(self, text: str, location: str, kind: str) -> None:
        if not text:
            return
        self.pos += len(text)
        self.parts.append(text)
        self.ends.append(self.pos)
        self.locations.append(location)
        self.kinds.append(kind)


def _render_content(writer: _Writer, message: Mapping[str, Any], prefix: str) -> None:
    content = message.get("content")
    if isinstance(content, str):
        writer.add(content, f"{prefix}.content", "message")
    elif isinstance(content, list):
        for j, part in enumerate(content):
            if not isinstance(part, (dict, Mapping)):
                continue
            if j:
                writer.add("\n", f"{prefix}.content[{j}]", "markup")
            image = image_part(part)
            if isinstance(part.get("text"), str):
                writer.add(part["text"], f"{prefix}.content[{j}].text", "message")
            elif image is not None:
                writer.add(image_text(image), f"{prefix}.content[{j}]", "image")
            else:
                writer.add(f"<{part.get('type', 'part')}>", f"{prefix}.content[{j}]", "message")


IMAGE_HEAD = "<image "
_FILLER = " img"
_HEAD_TOKENS = 10  # "<image " + 16 hex characters + ">": 5 to 15 pieces of the approximate tokenizer


def image_text(image: ImagePart) -> str:
    """The rendered text of an image part (see the module docstring)."""
    return f"{IMAGE_HEAD}{image.short}>" + _FILLER * max(0, image.tokens - _HEAD_TOKENS)


def image_name(text: str) -> str:
    """The short name inside an image segment's text (:func:`image_text`)."""
    return text[len(IMAGE_HEAD) :].split(">", 1)[0] if text.startswith(IMAGE_HEAD) else ""


def _render_tool_calls(writer: _Writer, message: Mapping[str, Any], prefix: str) -> None:
    for j, call in enumerate(chat_request.tool_calls(message)):
        function = call.get("function")
        if not isinstance(function, (dict, Mapping)):
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
            # Key order as given, on purpose: the linter must see what a template sees.
            w.add(f"{START}{key}\n{dumps(body[key])}{END}", key, key)  # prefixgate: noqa: PS302
    static_end = w.pos
    static_parts = len(w.parts)
    anchor_parts: int | None = None
    leading = True
    raw = body.get("messages")
    for i, message in enumerate(raw if isinstance(raw, list) else []):
        if not isinstance(message, (dict, Mapping)):
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
            static_parts = len(w.parts)
        elif anchor_parts is None:
            anchor_parts = len(w.parts)
    history_end = w.pos
    w.add(f"{START}assistant\n", "generation prompt", "markup")
    parts = tuple(w.parts)
    anchor = len(parts) if anchor_parts is None else anchor_parts
    return Rendered(
        "".join(parts), parts, tuple(w.ends), tuple(w.locations), tuple(w.kinds), static_end, history_end, anchor, static_parts
    )
