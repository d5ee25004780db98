"""PS103 instructions-not-first: a system or developer message after the conversation started.

Why it matters
    Many chat templates and providers hoist or merge every system/developer
    message into the head of the prompt. A system message added in the middle
    of a conversation then rewrites the beginning of the prompt and the whole
    cached conversation is lost; in templates that keep it in place it still
    signals instructions that change per turn.

Anti-pattern
    [{"role": "system", "content": "You are a travel agent."}, {"role": "user", "content": "Hi!"},
     {"role": "assistant", "content": "Hello! Where to?"},
     {"role": "system", "content": "Now answer in French."}, {"role": "user", "content": "Paris."}]

Better
    Keep all instructions in the leading system message; give per-turn guidance
    inside the user message ("(Answer in French.) ...").

Opt-in hygiene rule (``--extend-select PS103``): whether a late system message
moves depends on the chat template; when it does change what an earlier turn
sent, the default rules report the rewritten history (PS204, PS206).
No automatic fix (reordering would change the meaning).
"""

from __future__ import annotations

from collections.abc import Iterator

from linter import chat_request
from linter.rule import Body, Hit, Options, Rule


def check(body: Body, options: Options) -> Iterator[Hit]:
    started = False
    for i, message in chat_request.messages(body):
        role = chat_request.role(message)
        if role in chat_request.STATIC_ROLES:
            if started:
                yield Hit(
                    message=f"{role} message at index {i} comes after the conversation started",
                    location=f"messages[{i}].role",
                    needle=f'"role":"{role}"',
                )
        else:
            started = True


RULE = Rule(
    code="PS103",
    name="instructions-not-first",
    severity="warning",
    scope="request",
    summary="A system or developer message that is not at the start",
    doc=__doc__ or "",
    check_request=check,
    default=False,
)
