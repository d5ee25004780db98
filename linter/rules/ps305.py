"""PS305 history-sliced: the conversation history is sliced or edited away from its end.

Why it matters
    A later turn reuses the earlier turn's cache only if it repeats the earlier
    prompt and appends to it. ``messages[-10:]`` keeps a sliding window: every
    turn drops the oldest message, so everything after the system prompt moves
    and is recomputed on every turn. Deleting or inserting in the middle
    (``del history[1]``, ``history.pop(0)``, ``history.insert(1, ...)``) does the
    same.

Anti-pattern
    messages = [system] + history[-10:]

Better
    Append only; when the context is full, compact once (replace many old turns
    with a summary in one step) and then keep appending, so most turns hit the cache.

Detected on names ending in messages, msgs, history, turns, transcript,
conversation or chat (``chat_history``, ``self.messages``): a slice with a start other than 0, ``del x[...]``, ``x.pop(i)`` with
an index other than -1, ``x.insert(i, ...)`` and ``x.remove(...)``.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator

from linter import python_ast as pa
from linter.rule import Hit, Options, Rule

_HISTORY_ENDINGS = ("messages", "msgs", "history", "turns", "transcript", "conversation", "chat")


def _history(node: ast.expr) -> str | None:
    """The dotted name if it names a message list (``messages``, ``chat_history``, ...), else None."""
    name = pa.dotted_name(node)
    last = name.split(".")[-1].lower()
    return name if last.endswith(_HISTORY_ENDINGS) and "system" not in last else None


def _from_middle(s: ast.Slice) -> bool:
    lower = s.lower
    return lower is not None and not (isinstance(lower, ast.Constant) and lower.value in (0, None))


def _is_minus_one(node: ast.expr) -> bool:
    return isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub) and isinstance(node.operand, ast.Constant) and node.operand.value == 1


def check(tree: ast.Module, options: Options) -> Iterator[Hit]:
    for node in ast.walk(tree):
        if isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Slice) and isinstance(node.ctx, ast.Load):
            name = _history(node.value)
            if name is not None and _from_middle(node.slice):
                yield Hit(f"{name} sliced from the middle: earlier turns drop out and every turn's prefix moves", line=node.lineno, column=node.col_offset + 1)
        elif isinstance(node, ast.Delete):
            for target in node.targets:
                if isinstance(target, ast.Subscript) and (name := _history(target.value)) is not None:
                    yield Hit(f"del on {name} edits the history instead of appending", line=target.lineno, column=target.col_offset + 1)
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            name = _history(node.func.value)
            method = node.func.attr
            if name is None:
                continue
            index = node.args[0] if node.args else None
            if isinstance(index, ast.Constant) and not isinstance(index.value, int):
                continue  # dict.pop("key"): not a list of messages
            if (method == "pop" and index is not None and not _is_minus_one(index)) or method in ("insert", "remove"):
                yield Hit(f"{name}.{method}(...) edits the history instead of appending", line=node.lineno, column=node.col_offset + 1)


RULE = Rule(
    code="PS305",
    name="history-sliced",
    severity="warning",
    scope="source",
    summary="History sliced from the middle or edited in place",
    doc=__doc__ or "",
    check_source=check,
)
