"""PS101 volatile-value-in-prefix: a value that changes per request sits in the instructions.

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

Default rule, certain by construction: checked in system/developer messages,
where such a value is written per request. A value introduced as an example
("e.g. 2024-01-01T00:00:00Z", "format: ...") or as a fixed date ("knowledge
cutoff", "effective", "version", "since") is left alone, and so are values in
tool schemas and ``response_format``, which are usually constant examples: when
they do change between requests, PS201 reports where.

Location: the message index, the JSON path, and the character range of the
value (``messages[0].content[28:48]``). Values you accept can be allowlisted
(``allowlist`` in ``[tool.prefixgate.lint]``, regexes matched against the value).
Fix used by the hit-rate estimate: the values are cut out of the instructions
and appended as a final user message.
"""

from __future__ import annotations

import re
from collections.abc import Iterator

from linter import chat_request
from linter.rule import Body, Hit, Options, Rule
from linter.span_mover import move_spans_to_end
from linter.volatile import VolatileSpan, find_volatile

_NOT_PER_REQUEST = re.compile(
    r"(?i:\be\.g\.|\bfor example|\bsuch as|\bformat|\bcutoff|\bcut-off|\beffective|\bversion"
    r"|\bsince|\breleased|\bexample|\bsample)[^.\n]{0,20}$"
)


def per_request(text: str, span: VolatileSpan) -> bool:
    """False for a value introduced as an example or a fixed date (see the module docstring)."""
    return _NOT_PER_REQUEST.search(text[max(0, span.start - 40) : span.start]) is None


def instruction_texts(body: Body) -> Iterator[tuple[str, str]]:
    for i, message in chat_request.messages(body):
        if chat_request.role(message) in chat_request.STATIC_ROLES:
            yield from chat_request.content_texts(message, f"messages[{i}]")


def check(body: Body, options: Options) -> Iterator[Hit]:
    for location, text in instruction_texts(body):
        for span in find_volatile(text, options.allowlist):
            if not per_request(text, span):
                continue
            yield Hit(
                message=f"{span.kind} {span.value!r} in the shared prefix makes every request's prefix unique",
                location=f"{location}[{span.start}:{span.end}]",
                needle=span.value,
            )


def fix(body: Body) -> Body:
    """The values this rule reports, moved into a final user message."""
    return move_spans_to_end(body, lambda text: [(s.start, s.end) for s in find_volatile(text) if per_request(text, s)])


def move_volatile(body: Body) -> Body:
    """Every volatile value of the static parts moved into a final user message (PS201's fix)."""
    return move_spans_to_end(body, lambda text: [(s.start, s.end) for s in find_volatile(text)])


RULE = Rule(
    code="PS101",
    name="volatile-value-in-prefix",
    severity="error",
    scope="request",
    summary="A timestamp, id or nonce written into the system/developer instructions",
    doc=__doc__ or "",
    check_request=check,
    fix=fix,
)
