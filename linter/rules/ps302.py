"""PS302 json-dumps-unsorted: ``json.dumps`` without ``sort_keys=True`` of a dict whose key order varies reaches the static prefix.

Why it matters
    ``json.dumps`` writes keys in dict insertion order. When that order depends
    on a set, a directory listing or anything else that changes between
    processes, the same data serializes differently, and the prompt differs at
    the first reordered key: everything after it is recomputed.

Anti-pattern
    import json

    LIMITS = {"free": 10, "pro": 100, "team": 1000}
    enabled_plans = {"free", "pro"}
    limits = {name: LIMITS[name] for name in enabled_plans}
    system = "Limits: " + json.dumps(limits)

Better
    import json

    LIMITS = {"free": 10, "pro": 100, "team": 1000}
    enabled_plans = {"free", "pro"}
    limits = {name: LIMITS[name] for name in sorted(enabled_plans)}
    system = "Limits: " + json.dumps(limits, sort_keys=True)

Default rule. Only dicts whose key order can vary are reported (built by a
comprehension over a set or a directory listing, ``dict.fromkeys(a_set)``): a
``json.dumps`` of a literal or of a dict built in a fixed order is stable, and
output that never reaches the instructions or tools (logs, HTTP bodies, files)
is not a prompt. Reported at the ``json.dumps`` call. Suppress with
``# prefixgate: noqa: PS302``.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator

from linter.prompt_flow import reaches
from linter.rule import Hit, Options, Rule


def check(tree: ast.Module, options: Options) -> Iterator[Hit]:
    for reach in reaches(tree, "PS302", options.source_path):
        yield Hit(f"json.dumps without sort_keys=True of a dict whose key order varies reaches the {reach.sink_text}: use sort_keys=True", line=reach.cause.line, column=reach.cause.column)


RULE = Rule(
    code="PS302",
    name="json-dumps-unsorted",
    severity="warning",
    scope="source",
    summary="json.dumps without sort_keys of a dict with varying key order, into the system prompt or tools",
    doc=__doc__ or "",
    check_source=check,
)
