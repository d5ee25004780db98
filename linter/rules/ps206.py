"""PS206 instructions-changed: the system/developer instructions changed between related requests.

Why it matters
    The instructions come right after the tools and head every request. A
    conversation whose system prompt is rebuilt per turn with different wording
    (retrieved snippets, a feature flag, a counter) recomputes everything behind it.

Anti-pattern
    system = f"You are helpful. You have answered {n} questions so far."

Better
    Keep one instruction text per application version; put per-turn facts in the
    latest user message.

No automatic fix: ``tokens_lost`` shows what each change costs.
"""

from __future__ import annotations

from linter.rule import Rule

RULE = Rule(
    code="PS206",
    name="instructions-changed",
    severity="warning",
    scope="corpus",
    summary="System or developer instructions changed between related requests",
    doc=__doc__ or "",
)
