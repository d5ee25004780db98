"""PS105 tool-results-out-of-order: tool results do not follow the order of the ``tool_calls``.

Why it matters
    When the model calls several tools at once, the results are often appended
    in completion order (whichever finished first). The next turn, or a retry,
    may append them in another order, so identical conversations render to
    different prompts and the cache breaks at the first tool result.

Anti-pattern
    for result in asyncio.as_completed(calls): messages.append(tool_message(result))

Better
    Gather the results and append them in the order of ``tool_calls``:
    results = await asyncio.gather(*calls); messages.extend(map(tool_message, results))

Opt-in hygiene rule (``--extend-select PS105``): results in completion order
break nothing as long as later turns repeat them as sent. In the default rules,
a history whose tool results were reordered between turns is reported where it
changed (PS204).
Fix used by the estimate: tool results reordered to the ``tool_calls`` order.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

from linter import chat_request
from linter.rule import Body, Hit, Options, Rule


def _groups(raw: list[Any]) -> Iterator[tuple[int, list[str], int, int]]:
    """(assistant index, call ids, first result index, end index) per parallel tool call."""
    i = 0
    while i < len(raw):
        message = raw[i]
        ids = [c.get("id") for c in chat_request.tool_calls(message)] if isinstance(message, (dict, Mapping)) else []
        j = i + 1
        while j < len(raw) and isinstance(raw[j], (dict, Mapping)) and raw[j].get("role") == "tool":
            j += 1
        if len(ids) > 1 and all(isinstance(x, str) for x in ids):
            yield i, [str(x) for x in ids], i + 1, j
        i = j if j > i + 1 else i + 1


def check(body: Body, options: Options) -> Iterator[Hit]:
    raw = body.get("messages")
    if not isinstance(raw, list):
        return
    for i, ids, start, end in _groups(raw):
        got = [raw[k].get("tool_call_id") for k in range(start, end)]
        expected = [x for x in ids if x in got]
        actual = [x for x in got if x in ids]
        if actual != expected:
            k = next(n for n, (a, b) in enumerate(zip(actual, expected, strict=True)) if a != b)
            yield Hit(
                f"tool results {actual} do not follow the tool_calls order {expected} of messages[{i}]",
                f"messages[{start + got.index(actual[k])}].tool_call_id",
                needle=str(actual[k]),
            )


def fix(body: Body) -> Body:
    raw = body.get("messages")
    if not isinstance(raw, list):
        return body
    fixed = list(raw)
    for _, ids, start, end in _groups(raw):
        rank = {x: n for n, x in enumerate(ids)}
        fixed[start:end] = sorted(raw[start:end], key=lambda m: rank.get(str(m.get("tool_call_id")), len(ids)))
    if fixed == raw:
        return body
    return {**body, "messages": fixed}


RULE = Rule(
    code="PS105",
    name="tool-results-out-of-order",
    severity="warning",
    scope="request",
    summary="Tool results appended in another order than the tool_calls",
    doc=__doc__ or "",
    check_request=check,
    fix=fix,
    default=False,
)
