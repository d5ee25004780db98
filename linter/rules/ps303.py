"""PS303 tools-from-set: a set (or a directory listing) is iterated into the tools or the system prompt.

Why it matters
    The iteration order of a set of strings changes from one process to the
    next (string hashing is randomized per process, ``PYTHONHASHSEED``), and a
    directory listing comes in file-system order. Tools, tool descriptions or
    instructions built by iterating one come out in a different order in every
    worker and after every restart, so the prompt's head differs and nothing
    is reused.

Anti-pattern
    TOOL_SPECS = {"search": {"type": "function"}, "calendar": {"type": "function"}}
    UNITS = {"celsius", "fahrenheit"}
    enabled = {"search", "calendar"}
    tools = [TOOL_SPECS[name] for name in enabled]
    system_prompt = f"Allowed units: {', '.join(UNITS)}"

Better
    TOOL_SPECS = {"search": {"type": "function"}, "calendar": {"type": "function"}}
    UNITS = {"celsius", "fahrenheit"}
    enabled = {"search", "calendar"}
    tools = [TOOL_SPECS[name] for name in sorted(enabled)]
    system_prompt = f"Allowed units: {', '.join(sorted(UNITS))}"

Default rule. Detected: a set literal, set comprehension, ``set()``/``frozenset()``,
set operations, a set-annotated name, ``os.listdir``/``glob``/``Path.iterdir``
iterated (comprehension, ``list()``, ``join``, a loop that appends, an f-string)
where the result reaches the tools, ``response_format`` or the instructions.
``sorted(...)`` is the fix; order-free uses (``len``, ``in``, ``max``) are fine.
Reported once, at the iteration.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator

from linter.prompt_flow import reaches
from linter.rule import Hit, Options, Rule


def check(tree: ast.Module, options: Options) -> Iterator[Hit]:
    for reach in reaches(tree, "PS303", options.source_path):
        yield Hit(f"{reach.cause.what} is iterated in arbitrary order into the {reach.sink_text}: the order changes between processes; use sorted(...)", line=reach.cause.line, column=reach.cause.column)


RULE = Rule(
    code="PS303",
    name="tools-from-set",
    severity="error",
    scope="source",
    summary="A set or directory listing iterated into the tools or the system prompt",
    doc=__doc__ or "",
    check_source=check,
)
