"""PS201 volatile-value-at-divergence: two requests that should share a prefix part at a volatile value.

Why it matters
    Requests of one application (same tools and instructions) or later turns of
    one conversation should repeat the earlier prompt token for token. When the
    first differing character lies inside a timestamp, id or nonce, that value is
    the reason the cache misses, and every block from there on is recomputed.
    This is measured across the log, so it confirms PS101 with real traffic and
    also catches values PS101 cannot see (a date written into the history).

Anti-pattern
    request 1 system: "Assistant for ACME. Today is 2026-11-20."
    request 2 system: "Assistant for ACME. Today is 2026-11-21."

Better
    Keep the shared part constant and send the value after it (at the end of the
    newest user message), or round it so it changes rarely (the date, not the second).

Reported at the first differing character of the later request; ``tokens_lost``
counts the full 16-token blocks of the earlier prompt that were not reused.
Fix used by the estimate: volatile values moved after the stable prefix (as PS101).
"""

from __future__ import annotations

from linter.rule import Rule
from linter.rules.ps101 import move_volatile

RULE = Rule(
    code="PS201",
    name="volatile-value-at-divergence",
    severity="error",
    scope="corpus",
    summary="Requests that should share a prefix first differ inside a volatile value",
    doc=__doc__ or "",
    fix=move_volatile,
)
