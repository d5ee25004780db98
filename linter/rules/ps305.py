"""PS305 history-sliced: the history sent as ``messages`` is a sliding window or is edited in place.

Why it matters
    A later turn reuses the earlier turn's cache only if it repeats the earlier
    prompt and appends to it. ``history[-10:]`` keeps a sliding window: every
    turn drops the oldest message, so everything after the system prompt moves
    and is recomputed on every turn. Deleting or inserting in the middle
    (``del history[1]``, ``history.pop(0)``, ``history.insert(1, ...)``) does the
    same.

Anti-pattern
    def get_messages(self, limit: int) -> list[dict]:
        return self.items[-limit:]

Better
    Append only; when the context is full, compact once (replace many old turns
    with a summary in one step) and then keep appending, so most turns hit the cache.

Default rule. Detected: a slice whose start is negative or computed
(``[-10:]``, ``[-limit:]``, ``[len(x) - n:]``; a fixed start such as ``[1:]`` is
stable) whose result reaches a request's history: a ``messages=`` argument, a
``messages``/``history`` variable or attribute, the return of a function named
for messages or history or of a session/memory class's method; and ``del``,
``pop(i)``, ``insert`` and ``remove`` on a history list that is sent or stored.
Slices in tests, analysis and display code that never reach a request are not
reported.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator

from linter.prompt_flow import reaches
from linter.rule import Hit, Options, Rule


def check(tree: ast.Module, options: Options) -> Iterator[Hit]:
    for reach in reaches(tree, "PS305"):
        yield Hit(f"{reach.cause.what}: the messages sent drop or edit earlier turns, so every turn's prefix moves", line=reach.cause.line, column=reach.cause.column)


RULE = Rule(
    code="PS305",
    name="history-sliced",
    severity="warning",
    scope="source",
    summary="History sent as a sliding window or edited in place",
    doc=__doc__ or "",
    check_source=check,
)
