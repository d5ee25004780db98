r"""PS301 volatile-call-in-instructions: ``datetime.now()``, ``time.time()``, ``uuid4()`` or a random value reaches the static prefix.

Why it matters
    Code that writes the current time, a random number, an id or a nonce into
    the system prompt or the tools produces a different prompt head on every
    call, so no request ever reuses another's cache (PS101 is the same problem
    seen in a request log).

Anti-pattern
    from datetime import date

    from pydantic_ai import Agent

    agent = Agent("openai:gpt-4o")

    @agent.system_prompt
    def add_date() -> str:
        return f"You are a helper. Today is {date.today()}."

Better
    from datetime import date

    SYSTEM_PROMPT = "You are a helper."

    def messages_for(question: str) -> list[dict]:
        return [{"role": "system", "content": SYSTEM_PROMPT},
                {"role": "user", "content": f"(Today is {date.today()})\n{question}"}]

Default rule. Detected: a volatile call (datetime/date ``now``/``utcnow``/``today``,
``time.time``, ``uuid1``/``uuid4``, ``secrets`` tokens, ``random``) whose value
reaches the instructions or the tools of a chat request, followed through
assignments, f-strings, ``.format``, concatenation and function returns in the
module, including functions registered or passed as system prompts
(:mod:`linter.prompt_flow`). Reported once, at the call. A volatile value in the
newest user message is fine and not reported. Suppress a line with
``# prefixgate: noqa: PS301``.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator

from linter.prompt_flow import reaches
from linter.rule import Hit, Options, Rule


def check(tree: ast.Module, options: Options) -> Iterator[Hit]:
    for reach in reaches(tree, "PS301", options.source_path):
        yield Hit(f"{reach.cause.what} reaches the {reach.sink_text} of a chat request: its prefix changes on every call", line=reach.cause.line, column=reach.cause.column)


RULE = Rule(
    code="PS301",
    name="volatile-call-in-instructions",
    severity="error",
    scope="source",
    summary="A volatile call (now, time, uuid4, random) whose value reaches the system prompt or tools",
    doc=__doc__ or "",
    check_source=check,
)
