"""PS301 volatile-call-in-instructions: ``datetime.now()``, ``time.time()`` or ``uuid4()`` flows into a system prompt.

Why it matters
    Code that formats the current time, a random id or a nonce into the system
    prompt produces a different prompt head on every call, so no request ever
    reuses another's cache (PS101 is the same problem seen in the request log).

Anti-pattern
    now = datetime.now().isoformat()
    messages = [{"role": "system", "content": f"You are a helper. Time: {now}"}]

Better
    messages = [{"role": "system", "content": SYSTEM_PROMPT},
                {"role": "user", "content": f"(Time: {now})\\n{question}"}]

Detected: a volatile call (datetime/date now/utcnow/today, time.time, uuid1/4,
secrets tokens, random) or a name assigned from one, inside the ``content`` of a
``{"role": "system"|"developer", ...}`` dict, in a value assigned to a name that
contains system/instruction/preamble, or passed as ``system=``/``instructions=``.
Suppress a line with ``# prefixgate: noqa: PS301``.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator

from linter import python_ast as pa
from linter.rule import Hit, Options, Rule


def _sinks(scope: pa.Scope) -> Iterator[ast.expr]:
    for node in pa.scope_nodes(scope):
        if isinstance(node, ast.Dict):
            role = pa.string_value(pa.dict_get(node, "role"))
            content = pa.dict_get(node, "content")
            if role in ("system", "developer") and content is not None:
                yield content
        value = pa.assigned_value(node)
        if value is not None and any(pa.SYSTEM_NAME.search(n.split(".")[-1]) for n in pa.assigned_names(node)):
            yield value
        if isinstance(node, ast.Call):
            for keyword in node.keywords:
                if keyword.arg in ("system", "instructions", "system_prompt"):
                    yield keyword.value


def check(tree: ast.Module, options: Options) -> Iterator[Hit]:
    seen: set[tuple[int, int]] = set()
    for scope in pa.scopes(tree):
        tainted = pa.taint(scope, pa.is_volatile_call)
        for sink in _sinks(scope):
            source = pa.find_source(sink, pa.is_volatile_call, tainted)
            if not isinstance(source, ast.expr):
                continue
            where = (source.lineno, source.col_offset)
            if where in seen:
                continue
            seen.add(where)
            what = pa.origin(source, tainted)
            via = "" if isinstance(source, ast.Call) else f" (via {pa.dotted_name(source)!r})"
            yield Hit(
                f"{what}{via} flows into a system prompt: every call gets a different prompt prefix",
                line=source.lineno,
                column=source.col_offset + 1,
            )


RULE = Rule(
    code="PS301",
    name="volatile-call-in-instructions",
    severity="error",
    scope="source",
    summary="datetime.now(), time.time(), uuid4() ... flowing into a system prompt",
    doc=__doc__ or "",
    check_source=check,
)
