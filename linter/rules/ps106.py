"""PS106 whitespace-drift: stray whitespace in the static parts of the prompt.

Why it matters
    Whitespace is tokens. Instructions assembled from templates and files pick
    up carriage returns, trailing spaces and leading or trailing blank lines
    that come and go with the editor, the OS or the code path that built them.
    Two prompts that look identical then differ at the first stray space and
    share nothing after it.

Anti-pattern
    SYSTEM = open("prompt.txt").read()        # "You are ...  \\r\\n\\r\\n" on Windows checkouts

Better
    Normalize once when loading: line endings to "\\n", no trailing spaces,
    stripped ends (SYSTEM = "\\n".join(l.rstrip() for l in text.splitlines()).strip()).

Opt-in hygiene rule (``--extend-select PS106``): whitespace that is the same in
every request breaks nothing. In the default rules, instructions or tools that
differ between requests only in whitespace are reported where they differ
(PS206, PS202), with the whitespace named as the cause.
Checked in system/developer contents and tool descriptions: carriage returns,
trailing whitespace before a newline, leading or trailing whitespace.
Fix used by the estimate: that normalization.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping
from functools import lru_cache
from typing import Any

from linter import chat_request
from linter.rule import Body, Hit, Options, Rule

_TRAILING = re.compile(r"[ \t]+(?=\n)")


@lru_cache(maxsize=4096)
def _problem(text: str) -> tuple[int, str] | None:
    """(offset, description) of the first whitespace problem in ``text``."""
    found: list[tuple[int, str]] = []
    cr = text.find("\r")
    if cr >= 0:
        found.append((cr, "carriage return"))
    trailing = _TRAILING.search(text)
    if trailing is not None:
        found.append((trailing.start(), "trailing whitespace before a newline"))
    if text[:1].isspace():
        found.append((0, "leading whitespace"))
    if text[-1:].isspace():
        found.append((len(text.rstrip()), "trailing whitespace"))
    return min(found) if found else None


def normalize(text: str) -> str:
    return "\n".join(line.rstrip() for line in text.replace("\r\n", "\n").replace("\r", "\n").split("\n")).strip()


def _texts(body: Body) -> Iterator[tuple[str, str]]:
    for i, message in chat_request.messages(body):
        if chat_request.role(message) in chat_request.STATIC_ROLES:
            yield from chat_request.content_texts(message, f"messages[{i}]")
    for i, tool in chat_request.tools(body):
        function = tool.get("function")
        if isinstance(function, (dict, Mapping)) and isinstance(function.get("description"), str):
            yield f"tools[{i}].function.description", function["description"]


def check(body: Body, options: Options) -> Iterator[Hit]:
    for location, text in _texts(body):
        problem = _problem(text)
        if problem is not None:
            offset, what = problem
            yield Hit(f"{what} at character {offset} of a static part", f"{location}[{offset}]")


def _normalize_content(content: Any) -> Any:
    if isinstance(content, str):
        return normalize(content)
    if isinstance(content, list):
        return [{**p, "text": normalize(p["text"])} if isinstance(p, (dict, Mapping)) and isinstance(p.get("text"), str) else p for p in content]
    return content


def fix(body: Body) -> Body:
    if not any(_problem(text) for _, text in _texts(body)):
        return body
    fixed: dict[str, Any] = dict(body)
    fixed["messages"] = [
        {**m, "content": _normalize_content(m.get("content"))}
        if isinstance(m, (dict, Mapping)) and chat_request.role(m) in chat_request.STATIC_ROLES
        else m
        for m in body.get("messages") or []
    ]
    tools = body.get("tools")
    if isinstance(tools, list):
        fixed["tools"] = [_fix_tool(t) for t in tools]
    return fixed


def _fix_tool(tool: Any) -> Any:
    function = tool.get("function") if isinstance(tool, (dict, Mapping)) else None
    if not isinstance(function, (dict, Mapping)) or not isinstance(function.get("description"), str):
        return tool
    return {**tool, "function": {**function, "description": normalize(function["description"])}}


RULE = Rule(
    code="PS106",
    name="whitespace-drift",
    severity="info",
    scope="request",
    summary="Carriage returns, trailing or leading whitespace in instructions or tool descriptions",
    doc=__doc__ or "",
    check_request=check,
    fix=fix,
    default=False,
)
