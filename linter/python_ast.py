"""Small AST helpers for the source rules (names, calls, literals); the value flow is :mod:`linter.prompt_flow`."""

from __future__ import annotations

import ast

VOLATILE_CALLS = frozenset(
    {
        "datetime.now", "datetime.utcnow", "datetime.today", "date.today",
        "time.time", "time.time_ns", "time.ctime", "time.localtime", "time.gmtime", "time.strftime",
        "uuid.uuid1", "uuid.uuid4", "uuid1", "uuid4", "ulid.new", "ulid",
        "secrets.token_hex", "secrets.token_urlsafe", "secrets.token_bytes",
        "random.random", "random.randint", "random.choice", "os.urandom",
        "pendulum.now", "arrow.now", "arrow.utcnow", "timezone.now",
    }
)


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
    """A call whose result differs per call: the current time, a random value, a fresh id."""
    if not isinstance(node, ast.Call):
        return False
    parts = call_name(node).split(".")
    return ".".join(parts[-2:]) in VOLATILE_CALLS or parts[-1] in {"uuid4", "uuid1"}


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


def string_value(node: ast.AST | None) -> str | None:
    return node.value if isinstance(node, ast.Constant) and isinstance(node.value, str) else None


def dict_get(node: ast.Dict, key: str) -> ast.expr | None:
    for k, v in zip(node.keys, node.values, strict=True):
        if string_value(k) == key:
            return v
    return None
