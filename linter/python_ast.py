"""AST helpers shared by the Python source rules (PS3xx).

Scopes are analysed one at a time (the module body, then each function body,
nested functions excluded) with a simple forward taint: a name assigned from an
expression that contains a *source* (a volatile call, a set) is tainted, and so
is a name assigned from a tainted name. Two passes cover loops. This is a lint,
not a proof: it favours precision on the patterns that build prompts.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Callable, Collection, Iterator

VOLATILE_CALLS = frozenset(
    {
        "datetime.now", "datetime.utcnow", "datetime.today", "date.today",
        "time.time", "time.time_ns", "time.ctime", "time.localtime", "time.gmtime",
        "uuid.uuid1", "uuid.uuid4", "uuid1", "uuid4", "ulid.new", "ulid",
        "secrets.token_hex", "secrets.token_urlsafe", "secrets.token_bytes",
        "random.random", "random.randint", "random.choice", "os.urandom",
        "pendulum.now", "arrow.now", "arrow.utcnow",
    }
)
SYSTEM_NAME = re.compile(r"system|instruction|preamble", re.IGNORECASE)
PROMPT_NAME = re.compile(r"prompt|tool|system|message|content|instruction|schema|context|argument|preamble", re.IGNORECASE)
TOOLS_NAME = re.compile(r"tool|function", re.IGNORECASE)
HISTORY_NAME = re.compile(r"message|history|conversation|turn|chat|transcript", re.IGNORECASE)
USER_NAME = re.compile(r"user|customer|account|tenant|member|email|profile|client", re.IGNORECASE)

Scope = ast.Module | ast.FunctionDef | ast.AsyncFunctionDef


def dotted_name(node: ast.expr) -> str:
    """``a.b.c`` for a Name/Attribute chain (calls in the chain are skipped), else ``""``."""
    parts: list[str] = []
    while True:
        if isinstance(node, ast.Attribute):
            parts.append(node.attr)
            node = node.value
        elif isinstance(node, ast.Call):
            node = node.func
        elif isinstance(node, ast.Name):
            parts.append(node.id)
            break
        else:
            break
    return ".".join(reversed(parts))


def call_name(call: ast.Call) -> str:
    return dotted_name(call.func)


def is_volatile_call(node: ast.AST) -> bool:
    if not isinstance(node, ast.Call):
        return False
    name = call_name(node)
    parts = name.split(".")
    return ".".join(parts[-2:]) in VOLATILE_CALLS or parts[-1] in {"uuid4", "uuid1"}


def scopes(tree: ast.Module) -> Iterator[Scope]:
    yield tree
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            yield node


def scope_nodes(scope: Scope) -> Iterator[ast.AST]:
    """Every node of ``scope`` in source order, not descending into nested functions or classes' methods."""
    stack: list[ast.AST] = list(reversed(scope.body))
    while stack:
        node = stack.pop()
        yield node
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda):
            continue
        stack.extend(reversed(list(ast.iter_child_nodes(node))))


def assigned_names(node: ast.AST) -> list[str]:
    """Names (or dotted attributes) a statement assigns to."""
    targets: list[ast.expr] = []
    if isinstance(node, ast.Assign):
        targets = list(node.targets)
    elif isinstance(node, ast.AnnAssign | ast.AugAssign | ast.NamedExpr):
        targets = [node.target]
    names: list[str] = []
    for target in targets:
        if isinstance(target, ast.Tuple | ast.List):
            names.extend(dotted_name(e) for e in target.elts)
        else:
            names.append(dotted_name(target))
    return [n for n in names if n]


def assigned_value(node: ast.AST) -> ast.expr | None:
    if isinstance(node, ast.Assign | ast.AugAssign | ast.NamedExpr):
        return node.value
    if isinstance(node, ast.AnnAssign):
        return node.value
    return None


def find_source(expr: ast.AST, is_source: Callable[[ast.AST], bool], tainted: Collection[str]) -> ast.AST | None:
    """The first node inside ``expr`` that is a source or a tainted name, else None."""
    for node in ast.walk(expr):
        if is_source(node):
            return node
        if isinstance(node, ast.Name | ast.Attribute) and dotted_name(node) in tainted:
            return node
    return None


def taint(scope: Scope, is_source: Callable[[ast.AST], bool]) -> dict[str, str]:
    """Names in ``scope`` holding a value derived from a source, each with its origin's text."""
    tainted: dict[str, str] = {}
    for _ in range(2):
        for node in scope_nodes(scope):
            value = assigned_value(node)
            source = find_source(value, is_source, set(tainted)) if value is not None else None
            if source is not None:
                for name in assigned_names(node):
                    tainted.setdefault(name, origin(source, tainted))
    tainted.pop("", None)
    return tainted


def origin(node: ast.AST, tainted: dict[str, str]) -> str:
    """``datetime.now()`` for a call, or the origin a tainted name was derived from."""
    if isinstance(node, ast.Call):
        return call_name(node) + "()"
    if isinstance(node, ast.expr):
        name = dotted_name(node)
        return tainted.get(name, name)
    return "?"


def string_value(node: ast.AST | None) -> str | None:
    return node.value if isinstance(node, ast.Constant) and isinstance(node.value, str) else None


def dict_get(node: ast.Dict, key: str) -> ast.expr | None:
    for k, v in zip(node.keys, node.values, strict=True):
        if string_value(k) == key:
            return v
    return None


def parents(tree: ast.AST) -> dict[ast.AST, ast.AST]:
    return {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
