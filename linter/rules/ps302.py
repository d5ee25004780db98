"""PS302 json-dumps-unsorted: ``json.dumps`` without ``sort_keys=True`` builds tools or prompt text.

Why it matters
    ``json.dumps`` writes keys in dict insertion order. Dicts built by different
    code paths, merged in another order or loaded from another source serialize
    the same data differently, so prompts that should be identical differ at the
    first reordered key and lose the cache from there on.

Anti-pattern
    content = "Schema: " + json.dumps(schema)
    {"role": "tool", "content": json.dumps(result)}

Better
    json.dumps(value, sort_keys=True, separators=(",", ":"))

Flagged when the call's result goes into an f-string, a string concatenation
(other than with whitespace alone, e.g. a JSONL newline) or ``.format``, a ``content``/``arguments``/``description`` value, a keyword of
those names or ``tools``, a variable whose name mentions prompt, tool, system,
message, content, instruction, schema, context or argument, or the return value
of a function whose name does. Suppress with ``# prefixgate: noqa: PS302``.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator

from linter import python_ast as pa
from linter.rule import Hit, Options, Rule

_KEYS = {"content", "arguments", "description", "tools", "system", "instructions", "prompt"}


def _sorted(call: ast.Call) -> bool:
    for keyword in call.keywords:
        if keyword.arg == "sort_keys":
            return not (isinstance(keyword.value, ast.Constant) and not keyword.value.value)
        if keyword.arg is None:  # **kwargs: cannot tell
            return True
    return False


def _whitespace(node: ast.AST) -> bool:
    return isinstance(node, ast.Constant) and isinstance(node.value, str) and not node.value.strip()


def _builds_prompt(node: ast.AST, parents: dict[ast.AST, ast.AST]) -> bool:
    """Whether the dumps result becomes prompt text (see the module docstring).

    Serializing a record (``json.dumps(x) + "\n"``, ``f"{json.dumps(x)}\n"``) or
    bytes (``.encode()``) is not prompt building by itself; the walk goes on to
    where that value ends up.
    """
    child: ast.AST = node
    parent = parents.get(child)
    while parent is not None:
        if isinstance(parent, ast.Attribute) and parent.attr == "encode":
            return False
        if isinstance(parent, ast.JoinedStr):
            formatted = [v for v in parent.values if isinstance(v, ast.FormattedValue)]
            if len(formatted) > 1 or not all(_whitespace(v) for v in parent.values if v not in formatted):
                return True
        if isinstance(parent, ast.BinOp) and isinstance(parent.op, ast.Add):
            other = parent.right if child is parent.left else parent.left
            if isinstance(other, ast.Constant) and isinstance(other.value, bytes):
                return False
            if not _whitespace(other):
                return True
        if isinstance(parent, ast.Call) and isinstance(parent.func, ast.Attribute) and parent.func.attr == "format":
            return True
        if isinstance(parent, ast.keyword) and parent.arg in _KEYS:
            return True
        if isinstance(parent, ast.Dict) and child in parent.values:
            key = parent.keys[parent.values.index(child)]
            return pa.string_value(key) in _KEYS
        if isinstance(parent, ast.stmt):
            names = pa.assigned_names(parent)
            if any(pa.PROMPT_NAME.search(n.split(".")[-1]) for n in names):
                return True
            if isinstance(parent, ast.Return):
                function = parents.get(parent)
                while function is not None and not isinstance(function, ast.FunctionDef | ast.AsyncFunctionDef):
                    function = parents.get(function)
                return function is not None and bool(pa.PROMPT_NAME.search(function.name))
            return False
        child, parent = parent, parents.get(parent)
    return False


def check(tree: ast.Module, options: Options) -> Iterator[Hit]:
    parents = pa.parents(tree)
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Call)
            and pa.call_name(node) in ("json.dumps", "dumps")
            and not _sorted(node)
            and _builds_prompt(node, parents)
        ):
            yield Hit(
                "json.dumps without sort_keys=True builds prompt text: key order can vary between requests",
                line=node.lineno,
                column=node.col_offset + 1,
            )


RULE = Rule(
    code="PS302",
    name="json-dumps-unsorted",
    severity="warning",
    scope="source",
    summary="json.dumps without sort_keys=True building tools or prompt text",
    doc=__doc__ or "",
    check_source=check,
)
