"""PS202 tools-changed: the tool list differs between requests that should share it.

Why it matters
    Tools are rendered at the very start of the prompt. A different order (tools
    collected from a dict or a set, plugins registered in a varying order), a
    tool added or removed per request, or a description edited per request
    changes the first tokens, so nothing at all is reused.

Anti-pattern
    tools = [TOOLS[name] for name in enabled_tools]   # enabled_tools is a set

Better
    Send the same full tool list, sorted by name, on every request
    (tools = sorted(ALL_TOOLS, key=lambda t: t["function"]["name"])) and restrict
    use with tool_choice or instructions rather than by removing tools.

Fix used by the estimate: tools sorted by function name.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from linter import chat_request
from linter.rule import Body, Rule


def fix(body: Body) -> Body:
    tools = body.get("tools")
    if not isinstance(tools, list) or not all(isinstance(t, Mapping) for t in tools):
        return body
    ordered = sorted(tools, key=chat_request.tool_name)
    if all(a is b for a, b in zip(ordered, tools, strict=True)):
        return body
    fixed: dict[str, Any] = dict(body)
    fixed["tools"] = ordered
    return fixed


RULE = Rule(
    code="PS202",
    name="tools-changed",
    severity="warning",
    scope="corpus",
    summary="Tool order, tool set or a tool definition changed between related requests",
    doc=__doc__ or "",
    fix=fix,
    fix_everywhere=True,
)
