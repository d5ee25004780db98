"""PS304 tools-per-user: tool definitions are built from user-specific data.

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

Detected: an f-string, ``.format`` or string concatenation referencing a name
that mentions user, customer, account, tenant, member, email, profile or client,
inside a dict that looks like a tool (it has ``parameters`` or ``function``, or
``"type": "function"``) or inside a value assigned to a tools/functions variable.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator

from linter import python_ast as pa
from linter.rule import Hit, Options, Rule


def _is_tool_dict(node: ast.AST) -> bool:
    if not isinstance(node, ast.Dict):
        return False
    keys = {pa.string_value(k) for k in node.keys if k is not None}
    return "parameters" in keys or "function" in keys or pa.string_value(pa.dict_get(node, "type")) == "function"


def _user_reference(node: ast.AST) -> ast.expr | None:
    """A user-ish name used inside string building within ``node``, or None."""
    for inner in ast.walk(node):
        built: list[ast.AST] = []
        if isinstance(inner, ast.JoinedStr):
            built = [v.value for v in inner.values if isinstance(v, ast.FormattedValue)]
        elif isinstance(inner, ast.Call) and isinstance(inner.func, ast.Attribute) and inner.func.attr == "format":
            built = [*inner.args, *(k.value for k in inner.keywords)]
        elif isinstance(inner, ast.BinOp) and isinstance(inner.op, ast.Add | ast.Mod):
            built = [inner.left, inner.right]
        for part in built:
            for leaf in ast.walk(part):
                if isinstance(leaf, ast.Name | ast.Attribute) and pa.USER_NAME.search(pa.dotted_name(leaf)):
                    return leaf
    return None


def check(tree: ast.Module, options: Options) -> Iterator[Hit]:
    roots: list[ast.AST] = []
    for node in ast.walk(tree):
        if _is_tool_dict(node):
            roots.append(node)
        value = pa.assigned_value(node)
        if value is not None and any(pa.TOOLS_NAME.search(n.split(".")[-1]) for n in pa.assigned_names(node)):
            roots.append(value)
    seen: set[tuple[int, int]] = set()
    for root in roots:
        ref = _user_reference(root)
        if ref is None or (ref.lineno, ref.col_offset) in seen:
            continue
        seen.add((ref.lineno, ref.col_offset))
        yield Hit(
            f"tool definition built from {pa.dotted_name(ref)!r}: the tool block differs per user",
            line=ref.lineno,
            column=ref.col_offset + 1,
        )


RULE = Rule(
    code="PS304",
    name="tools-per-user",
    severity="warning",
    scope="source",
    summary="Tool definitions built from user-specific data",
    doc=__doc__ or "",
    check_source=check,
)
