"""PS101 volatile-value-in-prefix: a value that changes per request sits in the shared prefix.

Why it matters
    Engines reuse the KV cache of an exact token prefix, block by block. The
    system/developer instructions, the tool definitions and the response format
    come first in the prompt and are the same for every request of an
    application, so they are the part worth caching. A timestamp, date, epoch
    time, UUID, ULID, hex nonce, JWT or request/session/trace id in that part
    makes every prefix unique: everything after the value is recomputed on
    every request.

Anti-pattern
    {"role": "system", "content": "You are a helpful agent. Now: 2026-11-21T10:04:05Z. Session: 6f1c..."}

Better
    Keep the instructions byte-identical across requests and put the volatile
    values after them, in the latest user message:
    {"role": "system", "content": "You are a helpful agent."},
    {"role": "user", "content": "Current time: 2026-11-21T10:04:05Z\\n\\nWhat is on my calendar?"}

Location: the message index or tool, the JSON path, and the character range of
the value (``messages[0].content[28:48]``). Values you accept can be allowlisted
(``allowlist`` in ``[tool.prefixgate.lint]``, regexes matched against the value).
Fix used by the hit-rate estimate: the values are cut out of the shared prefix
and appended as a final user message.
"""

from __future__ import annotations

from collections.abc import Iterator

from linter import chat_request
from linter.rule import Body, Hit, Options, Rule
from linter.span_mover import move_spans_to_end
from linter.volatile import find_volatile


def check(body: Body, options: Options) -> Iterator[Hit]:
    for location, text in chat_request.static_texts(body):
        for span in find_volatile(text, options.allowlist):
            yield Hit(
                message=f"{span.kind} {span.value!r} in the shared prefix makes every request's prefix unique",
                location=f"{location}[{span.start}:{span.end}]",
                needle=span.value,
            )


def fix(body: Body) -> Body:
    return move_spans_to_end(body, lambda text: [(s.start, s.end) for s in find_volatile(text)])


RULE = Rule(
    code="PS101",
    name="volatile-value-in-prefix",
    severity="error",
    scope="request",
    summary="A timestamp, id or nonce in the system prompt, tools or response format",
    doc=__doc__ or "",
    check_request=check,
    fix=fix,
)
