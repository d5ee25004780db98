"""Grouping a corpus into families and conversations, and comparing each request with its predecessor.

A **family** is the requests that should share the static prefix: the same model
and the same leading system/developer instructions once volatile values are
masked, and user data (emails, phone numbers, labelled user fields) too, and
whitespace collapsed (so requests that differ only by a timestamp, a user's
email or stray whitespace still group together, and the difference is reported
as PS201 or PS206 where it costs). A
**conversation** is defined once, in :mod:`linter.conversation` (the gateway uses
the same definition): an explicit id (``metadata.conversation_id``,
``prompt_cache_key``), or else a later request whose messages extend an earlier
one's. Never the first user message alone.

:meth:`RequestFamilies.add` compares a request with the latest earlier request
of its conversation (the whole history should be repeated), or else with the
first request of its family, the prefix the family established (only the static
prefix should be repeated), using :func:`linter.divergence.compare`. Comparing
with the first rather than the latest family member reports each request that
departs from the established prefix once, instead of also blaming the request
after it for returning to it. Memory is one rendered request per family and
per conversation.
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping, Sequence
from functools import lru_cache
from typing import Any

from linter import chat_request
from linter.conversation import Turn, conversation_keys, remember_turn, take_previous
from linter.divergence import DEFAULT_BLOCK_SIZE, Divergence, compare
from linter.render import Rendered, render
from linter.rules.ps102 import mask_user_data
from linter.tokenizer import Tokenizer
from linter.volatile import mask_volatile_cached


@lru_cache(maxsize=4096)
def _family_text(text: str, allowlist: tuple[str, ...]) -> str:
    """Instructions with volatile values and user data masked and whitespace collapsed."""
    return " ".join(mask_user_data(mask_volatile_cached(text, allowlist)).split())


def family_key(body: Mapping[str, Any], allowlist: Sequence[str] = ()) -> Hashable:
    instructions: list[str] = []
    for _, message in chat_request.messages(body):
        if chat_request.role(message) not in chat_request.STATIC_ROLES:
            break
        instructions.append(_family_text(chat_request.content_text(message), tuple(allowlist)))
    return (str(body.get("model")), tuple(instructions))


class RequestFamilies:
    """Feeds requests in corpus order; see the module docstring."""

    def __init__(self, tokenizer: Tokenizer | None = None, *, allowlist: Sequence[str] = (), block_size: int = DEFAULT_BLOCK_SIZE) -> None:
        self._tokenizer = tokenizer
        self._allowlist = tuple(allowlist)
        self._block_size = block_size
        self._first: dict[Hashable, tuple[Mapping[str, Any], Rendered]] = {}
        self._last: dict[str, Turn] = {}  # value: (body, rendered)
        self._seq = 0

    def add(self, body: Mapping[str, Any], rendered: Rendered | None = None) -> Divergence | None:
        """The divergence of ``body`` from its predecessor, or None (also for the first of a group)."""
        family = family_key(body, self._allowlist)
        keys = conversation_keys(body)
        if rendered is None:
            rendered = render(body)
        previous = None
        if keys is not None:
            turn = take_previous(self._last, keys, remove=not keys.explicit)
            previous = None if turn is None else turn.value
        same_conversation = previous is not None
        if previous is None:
            previous = self._first.get(family)
        result = None
        if previous is not None:
            result = compare(
                previous[0],
                body,
                tokenizer=self._tokenizer,
                block_size=self._block_size,
                rendered=(previous[1], rendered),
                same_conversation=same_conversation,
                edits=not (same_conversation and keys is not None and keys.shared),
            )
        self._first.setdefault(family, (body, rendered))
        if keys is not None:
            self._seq += 1
            remember_turn(self._last, keys, (body, rendered), self._seq)
        return result
