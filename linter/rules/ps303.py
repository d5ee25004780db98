"""PS303 tools-from-set: the tool list is built by iterating a set.

Why it matters
    The iteration order of a set of strings changes from one process to the next
    (string hashing is randomized per process). Tools built from a set come out
    in a different order in every worker and after every restart, so the tool
    block at the very start of the prompt differs and nothing is reused.

Anti-pattern
    enabled = {"search", "calendar"} | extra
    tools = [TOOL_SPECS[name] for name in enabled]

Better
    tools = [TOOL_SPECS[name] for name in sorted(enabled)]

Detected: a list/generator comprehension, ``list(...)`` or ``for`` loop over a
set literal, set comprehension, ``set()``/``frozenset()`` (or a name holding
one, or a parameter or variable annotated as a set) whose result is a tools/functions variable or ``tools=`` argument, or whose
loop appends to one.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator

from linter import python_ast as pa
from linter.rule import Hit, Options, Rule


def is_set(node: ast.AST) -> bool:
    if isinstance(node, ast.Set | ast.SetComp):
        return True
    if isinstance(node, ast.Call) and pa.call_name(node) in ("set", "frozenset"):
        return True
    return isinstance(node, ast.BinOp) and isinstance(node.op, ast.BitOr | ast.BitAnd | ast.Sub) and (is_set(node.left) or is_set(node.right))


def _set_iter(expr: ast.AST, sets: set[str]) -> ast.expr | None:
    """The set being iterated inside ``expr`` (unsorted), or None."""
    for node in ast.walk(expr):
        iters: list[ast.expr] = []
        if isinstance(node, ast.ListComp | ast.GeneratorExp | ast.DictComp):
            iters = [g.iter for g in node.generators]
        elif isinstance(node, ast.Call) and pa.call_name(node) in ("list", "tuple") and node.args:
            iters = [node.args[0]]
        for it in iters:
            if is_set(it) or (isinstance(it, ast.Name) and it.id in sets):
                return it
    return None


def check(tree: ast.Module, options: Options) -> Iterator[Hit]:
    message = "tools built by iterating a set: their order changes between processes"
    for scope in pa.scopes(tree):
        sets = set(_set_names(scope))
        for node in pa.scope_nodes(scope):
            value = pa.assigned_value(node)
            if value is not None and any(pa.TOOLS_NAME.search(n.split(".")[-1]) for n in pa.assigned_names(node)):
                found = _set_iter(value, sets)
                if found is not None:
                    yield Hit(message, line=found.lineno, column=found.col_offset + 1)
            if isinstance(node, ast.keyword) and node.arg in ("tools", "functions"):
                found = _set_iter(node.value, sets)
                if found is not None:
                    yield Hit(message, line=found.lineno, column=found.col_offset + 1)
            if isinstance(node, ast.For) and (is_set(node.iter) or (isinstance(node.iter, ast.Name) and node.iter.id in sets)) and _appends_tools(node):
                yield Hit(message, line=node.iter.lineno, column=node.iter.col_offset + 1)


def _is_set_annotation(node: ast.expr | None) -> bool:
    if node is None:
        return False
    base = node.value if isinstance(node, ast.Subscript) else node
    return pa.dotted_name(base).split(".")[-1] in ("set", "frozenset", "Set", "FrozenSet", "AbstractSet", "MutableSet")


def _set_names(scope: pa.Scope) -> Iterator[str]:
    if isinstance(scope, ast.FunctionDef | ast.AsyncFunctionDef):
        arguments = [*scope.args.posonlyargs, *scope.args.args, *scope.args.kwonlyargs]
        yield from (a.arg for a in arguments if _is_set_annotation(a.annotation))
    for node in pa.scope_nodes(scope):
        if isinstance(node, ast.AnnAssign) and _is_set_annotation(node.annotation):
            yield from pa.assigned_names(node)
        value = pa.assigned_value(node)
        if value is not None and is_set(value):
            yield from pa.assigned_names(node)


def _appends_tools(loop: ast.For) -> bool:
    for node in ast.walk(loop):
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr in ("append", "extend")
            and pa.TOOLS_NAME.search(pa.dotted_name(node.func.value).split(".")[-1])
        ):
            return True
    return False


RULE = Rule(
    code="PS303",
    name="tools-from-set",
    severity="error",
    scope="source",
    summary="Tools built by iterating a set",
    doc=__doc__ or "",
    check_source=check,
)
