"""PS203 json-key-order-changed: equal JSON serialized with a different key order or spacing.

Why it matters
    Tools, response formats and tool-call arguments are JSON rendered into the
    prompt text. The same data written with keys in another order (a dict built
    in a different order, a client re-serializing a tool call with its own
    spacing) is different text and different tokens, so the cached prefix ends
    there although nothing really changed.

Anti-pattern
    turn 1 history: {"arguments": "{\\"city\\": \\"Paris\\", \\"unit\\": \\"C\\"}"}
    turn 2 history: {"arguments": "{\\"unit\\":\\"C\\",\\"city\\":\\"Paris\\"}"}

Better
    Send back tool calls exactly as the model produced them, and build tools
    and schemas the same way every time. Sorting keys is safe for a schema's
    keywords, but not for the members of ``properties``: their order is the
    order the model writes the fields in, so keep one fixed order (the
    gateway's canonicalization keeps it too).

Fix used by the estimate: equal tools, response_format and arguments spelled
the way the log first spelled them (one spelling per value, e.g. canonical JSON).
"""

from __future__ import annotations

from linter.first_seen import FirstJsonSpelling
from linter.rule import Rule

RULE = Rule(
    code="PS203",
    name="json-key-order-changed",
    severity="warning",
    scope="corpus",
    summary="Equal JSON (tools, response_format, arguments) re-serialized differently",
    doc=__doc__ or "",
    fix=FirstJsonSpelling(),
    fix_everywhere=True,
)
