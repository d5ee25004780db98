"""PS305 history-sliced: the history sent as ``messages`` is a sliding window or is edited in place.

Why it matters
    A later turn reuses the earlier turn's cache only if it repeats the earlier
    prompt and appends to it. ``history[-10:]`` keeps a sliding window: every
    turn drops the oldest message, so everything after the system prompt moves
    and is recomputed on every turn. Deleting or inserting in the middle
    (``del history[1]``, ``history.pop(1)``) does the same.

Anti-pattern
    class ChatSession:
        def __init__(self) -> None:
            self.items: list[dict] = []

        def get_messages(self, limit: int) -> list[dict]:
            return self.items[-limit:]

Better
    # Append only; when the context is full, compact once (replace many old turns
    # with a summary in one step) and then keep appending, so most turns hit the cache.
    class ChatSession:
        def __init__(self) -> None:
            self.items: list[dict] = []

        def get_messages(self) -> list[dict]:
            return self.items

Default rule. Detected: a slice that keeps the last N turns (``[-10:]``,
``[-limit:]``, ``[len(x) - n:]``; not ``[-1:]``, the last message, and not a
start computed otherwise, such as the index where a run's new messages begin)
of a list named for messages, history, turns, items or a session, whose result
reaches a request's history: a ``messages=`` (or ``input=``) argument, a
``messages``/``history`` variable or attribute, the return of a function named
for messages or history or of a session/memory class's ``get_items``-style
method; and ``del``, ``pop(i)`` and ``remove`` on the object's own history
(``self.messages``) or on a list that is then sent. Building a request
(``insert(0, system)``), compacting once, and slices in tests, analysis and
display code are not reported.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator

from linter.prompt_flow import reaches
from linter.rule import Hit, Options, Rule


def check(tree: ast.Module, options: Options) -> Iterator[Hit]:
    for reach in reaches(tree, "PS305", options.source_path):
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
