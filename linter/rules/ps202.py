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

Fix used by the estimate: each request sends a tool set in the order the log
first sent that set (one order per tool set, e.g. sorted by name).
"""

from __future__ import annotations

from linter.first_seen import FirstToolOrder
from linter.rule import Rule

RULE = Rule(
    code="PS202",
    name="tools-changed",
    severity="warning",
    scope="corpus",
    summary="Tool order, tool set or a tool definition changed between related requests",
    doc=__doc__ or "",
    fix=FirstToolOrder(),
    fix_everywhere=True,
)
