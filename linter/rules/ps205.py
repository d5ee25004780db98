"""PS205 tool-choice-or-format-changed: ``tool_choice`` or ``response_format`` changed between related requests.

Why it matters
    Engines and providers put the tool choice and the response format (its JSON
    schema) ahead of the conversation, so changing either between turns
    invalidates the cached conversation behind it.

Anti-pattern
    turn 1: tool_choice="auto"; turn 2: tool_choice={"type": "function", "function": {"name": "search"}}

Better
    Keep ``tool_choice`` and ``response_format`` fixed for a conversation; steer a
    single turn with an instruction in the user message instead.

No automatic fix: ``tokens_lost`` shows what each change costs.
"""

from __future__ import annotations

from linter.rule import Rule

RULE = Rule(
    code="PS205",
    name="tool-choice-or-format-changed",
    severity="warning",
    scope="corpus",
    summary="tool_choice or response_format changed between related requests",
    doc=__doc__ or "",
)
