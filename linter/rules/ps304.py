"""PS304 tools-per-user: a tool definition is built from user-specific data.

Why it matters
    Tools head the prompt. A tool description or schema that mentions the
    current user (their name, account, plan, enum of their own records) makes
    the tool block, and so the whole prompt, unique per user: users stop sharing
    the cache of the tools and instructions.

Anti-pattern
    def tools_for(user) -> list[dict]:
        return [{"type": "function", "function": {
            "name": "list_orders", "description": f"List orders of {user.name}",
            "parameters": {"type": "object", "properties": {}}}}]

Better
    # One tool definition for everyone; the user is known to the conversation
    # or to the tool's backend.
    TOOLS = [{"type": "function", "function": {
        "name": "list_orders", "description": "List the current customer's orders",
        "parameters": {"type": "object", "properties": {}}}}]

Default rule. Detected: user-specific data read inside a tool definition (in an
f-string, a concatenation, ``.format``, an ``enum``, a filter of the tool list),
directly or through assignments: a name whose root is ``user``, ``customer``,
``account``, ``tenant``, ``member`` or ``email`` (``user.name``,
``account_id``, ``self.customer.plan``, ``current_user``; not constants, not
``tool.user_location``, not tool functions named ``get_user``). Tool
definitions are dicts with ``"type": "function"`` or ``parameters``, ``tools=``
arguments and ``tools`` variables, and a tool constructor's ``description=``.
What a tool *returns* is a tool result in the history, not its definition, and
a tool factory given user data (``make_tool(directory=customers)``) still
defines one tool for everyone: neither is reported.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator

from linter.prompt_flow import reaches
from linter.rule import Hit, Options, Rule


def check(tree: ast.Module, options: Options) -> Iterator[Hit]:
    for reach in reaches(tree, "PS304", options.source_path):
        yield Hit(f"{reach.cause.what} is written into a tool definition: the tool block differs per user", line=reach.cause.line, column=reach.cause.column)


RULE = Rule(
    code="PS304",
    name="tools-per-user",
    severity="warning",
    scope="source",
    summary="Tool definitions built from user-specific data",
    doc=__doc__ or "",
    check_source=check,
)
