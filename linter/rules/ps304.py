"""PS304 tools-per-user: a tool definition is built from user-specific data.

Why it matters
    Tools head the prompt. A tool description or schema that mentions the
    current user (their name, account, plan, enum of their own records) makes
    the tool block, and so the whole prompt, unique per user: users stop sharing
    the cache of the tools and instructions.

Anti-pattern
    {"type": "function", "function": {"name": "list_orders",
     "description": f"List orders of {user.name}", ...}}

Better
    One tool definition for everyone ("List the current customer's orders"),
    with the user identified in the conversation or by the tool's backend.

Default rule. Detected: a name that mentions user, customer, account, tenant,
member, email or profile (``user.name``, ``account_id``, ``tenant.projects``)
read inside a tool definition (in an f-string, a concatenation, an ``enum``, a
filter of the tool list) (a dict with ``"type": "function"`` or ``parameters``,
a ``tools=`` argument or ``tools`` variable, a tool constructor's
``description=``). What a tool *returns* is a tool result in the history, not
its definition, and is not reported.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator

from linter.prompt_flow import reaches
from linter.rule import Hit, Options, Rule


def check(tree: ast.Module, options: Options) -> Iterator[Hit]:
    for reach in reaches(tree, "PS304"):
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
