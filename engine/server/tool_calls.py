"""ToolChoice and the tool-call convention: how tools are requested, written and parsed.

The bundled SmolLM2 chat template has no tool support, so tools reach the prompt
through :mod:`engine.contract.chat`'s system-message convention, and the model is
told to answer a call as one line per call (the Hermes convention that vLLM's
``hermes`` tool parser reads)::

    <tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>

Invariants:

* :func:`parse_tool_choice` is the only place ``tool_choice`` and
  ``parallel_tool_calls`` are validated; a named function must be one of ``tools``;
* :func:`extract_tool_calls` returns calls only for names among the request's
  tools whose ``arguments`` are a JSON object; anything else stays content, so no
  text is ever lost;
* with ``parallel_tool_calls: false`` at most one call is returned (the first);
* a call cut off by ``max_tokens`` is dropped whole: no part of the tags or of the
  call's JSON reaches content (streamed or not);
* ``tool_choice: "none"`` keeps the tools in the prompt (as OpenAI does) but
  never parses calls.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from engine.contract.errors import invalid_param
from engine.contract.tool_call_format import CALL_CLOSE, CALL_OPEN
from engine.server.response_builder import new_call_id

_CALL_RE = re.compile(re.escape(CALL_OPEN) + r"(.*?)" + re.escape(CALL_CLOSE), re.DOTALL)


@dataclass(frozen=True)
class ToolChoice:
    """``mode`` is "none", "auto", "required" or "named" (then ``name`` is set)."""

    mode: str
    name: str | None = None
    parallel: bool = True

    @property
    def parses(self) -> bool:
        return self.mode != "none"

    @property
    def forced(self) -> bool:
        return self.mode in ("required", "named")


def tool_names(tools: list[dict[str, Any]] | None) -> list[str]:
    """The function names of ``tools`` (validated entries only)."""
    names = []
    for tool in tools or []:
        fn = tool.get("function")
        if isinstance(fn, dict) and isinstance(fn.get("name"), str):
            names.append(fn["name"])
    return names


def check_tools(tools: list[dict[str, Any]] | None) -> None:
    """Raise APIError unless every tool is ``{"type": "function", "function": {"name", ...}}``."""
    for i, tool in enumerate(tools or []):
        fn = tool.get("function")
        if tool.get("type") != "function" or not isinstance(fn, dict):
            raise invalid_param(f"tools[{i}] must be {{'type': 'function', 'function': {{...}}}}; "
                                f"only function tools are supported, got type {tool.get('type')!r}.",
                                f"tools[{i}].type")
        if not isinstance(fn.get("name"), str) or not fn["name"]:
            raise invalid_param(f"tools[{i}].function.name must be a non-empty string.",
                                f"tools[{i}].function.name")
        params = fn.get("parameters")
        if params is not None and not isinstance(params, dict):
            raise invalid_param(f"tools[{i}].function.parameters must be a JSON schema object.",
                                f"tools[{i}].function.parameters")


def parse_tool_choice(value: object, tools: list[dict[str, Any]] | None,
                      parallel_tool_calls: object) -> ToolChoice:
    """Validate ``tool_choice`` against ``tools``; the default is "auto" with tools, else "none"."""
    if parallel_tool_calls is not None and not isinstance(parallel_tool_calls, bool):
        raise invalid_param("'parallel_tool_calls' must be a boolean.", "parallel_tool_calls",
                            "invalid_type")
    parallel = parallel_tool_calls is not False
    names = tool_names(tools)
    if value is None:
        return ToolChoice("auto" if names else "none", parallel=parallel)
    if value in ("none", "auto", "required"):
        if value == "required" and not names:
            raise invalid_param("tool_choice 'required' needs at least one tool in 'tools'.",
                                "tool_choice")
        return ToolChoice(str(value), parallel=parallel)
    fn = value.get("function") if isinstance(value, dict) else None
    name = fn.get("name") if isinstance(fn, dict) else None
    if not isinstance(value, dict) or value.get("type") != "function" or not isinstance(name, str):
        raise invalid_param("'tool_choice' must be 'none', 'auto', 'required' or "
                            "{'type': 'function', 'function': {'name': ...}}.", "tool_choice")
    if name not in names:
        raise invalid_param(f"tool_choice names function {name!r}, which is not in 'tools' "
                            f"({names}).", "tool_choice")
    return ToolChoice("named", name=name, parallel=parallel)


def extract_tool_calls(text: str, choice: ToolChoice, tools: list[dict[str, Any]] | None,
                       truncated: bool = False) -> tuple[str, list[dict[str, Any]]]:
    """``(content, tool_calls)`` of a finished output; content is the text outside the calls.

    A call left open at the end (no closing tag) is dropped with everything after its
    opening tag when the output was ``truncated`` (cut by max_tokens: OpenAI returns no
    partial call and no markup), and otherwise read as a call if it parses (the model
    stopped without the closing tag, as vLLM's hermes parser accepts)."""
    if not choice.parses:
        return text, []
    names = set(tool_names(tools))
    calls: list[dict[str, Any]] = []
    kept: list[str] = []
    pos = 0
    for match in _CALL_RE.finditer(text):
        call = _parse_call(match.group(1), names)
        if call is None:
            continue
        kept.append(text[pos:match.start()])
        pos = match.end()
        calls.append(call)
    rest, last = _open_call(text[pos:], names, truncated)
    if last is not None:
        calls.append(last)
    if not calls:  # then pos == 0: rest is the whole text
        return rest, []
    kept.append(rest)
    if not choice.parallel:
        calls = calls[:1]
    return "".join(kept).strip(), calls


def _open_call(tail: str, names: set[str],
               truncated: bool) -> tuple[str, dict[str, Any] | None]:
    """``tail`` (the text after the last complete call) without a call left open at its
    end, and that call when it parses; see :func:`extract_tool_calls`."""
    start = tail.rfind(CALL_OPEN)
    if start < 0 or CALL_CLOSE in tail[start:]:
        if truncated:  # a tag cut in the middle: "<tool_c"
            return tail[: len(tail) - _partial_suffix(tail, CALL_OPEN)], None
        return tail, None
    if truncated:
        return tail[:start], None
    call = _parse_call(tail[start + len(CALL_OPEN):], names)
    return (tail, None) if call is None else (tail[:start], call)


def _parse_call(body: str, names: set[str]) -> dict[str, Any] | None:
    try:
        obj = json.loads(body)
    except ValueError:
        return None
    if not isinstance(obj, dict) or obj.get("name") not in names:
        return None
    args = obj.get("arguments", {})
    if isinstance(args, str):  # some models write the arguments as a JSON string
        try:
            args = json.loads(args)
        except ValueError:
            return None
    if not isinstance(args, dict):
        return None
    return {"id": new_call_id(), "type": "function",
            "function": {"name": obj["name"], "arguments": json.dumps(args, ensure_ascii=False)}}


class ToolCallStream:
    """Splits streamed text into content deltas and complete tool calls.

    Text that might begin a call (a prefix of ``<tool_call>``) is held back until it
    is decided; a call is emitted whole once its closing tag arrives; a call that
    does not parse is released as content. ``finish`` flushes what is held, so a
    stream ends with the content and calls :func:`extract_tool_calls` finds.
    """

    def __init__(self, choice: ToolChoice, tools: list[dict[str, Any]] | None) -> None:
        self.choice = choice
        self.names = set(tool_names(tools))
        self._buffer = ""
        self.num_calls = 0

    def feed(self, text: str) -> tuple[str, list[dict[str, Any]]]:
        """``(content, calls)`` that can be sent now."""
        if not self.choice.parses:
            return text, []
        self._buffer += text
        content: list[str] = []
        calls: list[dict[str, Any]] = []
        while True:
            start = self._buffer.find(CALL_OPEN)
            if start < 0:
                keep = _partial_suffix(self._buffer, CALL_OPEN)
                content.append(self._buffer[: len(self._buffer) - keep])
                self._buffer = self._buffer[len(self._buffer) - keep:]
                break
            end = self._buffer.find(CALL_CLOSE, start)
            if end < 0:
                content.append(self._buffer[:start])
                self._buffer = self._buffer[start:]
                break
            call = _parse_call(self._buffer[start + len(CALL_OPEN):end], self.names)
            stop = end + len(CALL_CLOSE)
            if call is None:
                content.append(self._buffer[:stop])
            else:
                content.append(self._buffer[:start])
                if self.choice.parallel or self.num_calls == 0:
                    calls.append(call)
                    self.num_calls += 1
            self._buffer = self._buffer[stop:]
        text_out = "".join(content)
        if self.num_calls and not text_out.strip():
            text_out = ""
        return text_out, calls

    def finish(self, truncated: bool = False) -> tuple[str, list[dict[str, Any]]]:
        """What is still held back: content, or a call left open at the end (see
        :func:`extract_tool_calls`; a ``truncated`` output drops it)."""
        rest, self._buffer = self._buffer, ""
        text, call = _open_call(rest, self.names, truncated) if self.choice.parses else (rest, None)
        calls = []
        if call is not None and (self.choice.parallel or self.num_calls == 0):
            calls.append(call)
            self.num_calls += 1
        return ("" if self.num_calls and not text.strip() else text), calls


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of ``tag``."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:k]):
            return k
    return 0
