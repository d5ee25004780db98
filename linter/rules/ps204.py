"""PS204 history-rewritten: a conversation's history was edited or truncated instead of appended to.

Why it matters
    A later turn reuses the cache of the earlier turn only if it repeats the
    earlier prompt exactly and adds to its end. Dropping old messages from the
    middle (a sliding window that keeps the system prompt), summarizing old
    turns in place, or rewriting an earlier message shifts every following
    token, so the whole tail is recomputed on every turn.

Anti-pattern
    messages = [system] + history[-8:]          # a sliding window, every turn

Better
    Append only. When the context must shrink, compact rarely and in one step
    (replace a large block of old turns with a summary once), so the following
    turns share the new prefix again.

No automatic fix: ``tokens_lost`` shows what each rewrite costs.
"""

from __future__ import annotations

from linter.rule import Rule

RULE = Rule(
    code="PS204",
    name="history-rewritten",
    severity="warning",
    scope="corpus",
    summary="Conversation history edited or truncated rather than appended",
    doc=__doc__ or "",
)
