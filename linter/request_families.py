"""Grouping a corpus into families and conversations, and comparing each request with its predecessor.

A **family** is the requests that should share the static prefix: the same model
and the same leading system/developer instructions once volatile values are
masked (so requests that differ only by a timestamp still group together). A
**conversation** is the requests of a family with the same first non-system
message and ``user`` field, or, when the body names one, the same
``metadata.conversation_id`` (which survives a history truncated at its start).

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
from typing import Any

import orjson

from linter import chat_request
from linter.divergence import DEFAULT_BLOCK_SIZE, Divergence, compare, first_turn
from linter.render import Rendered, render
from linter.tokenizer import Tokenizer
from linter.volatile import mask_volatile_cached


def family_key(body: Mapping[str, Any], allowlist: Sequence[str] = ()) -> Hashable:
    instructions: list[str] = []
    for _, message in chat_request.messages(body):
        if chat_request.role(message) not in chat_request.STATIC_ROLES:
            break
        instructions.append(mask_volatile_cached(chat_request.content_text(message), tuple(allowlist)))
    return (str(body.get("model")), tuple(instructions))


def conversation_key(body: Mapping[str, Any], family: Hashable) -> Hashable | None:
    metadata = body.get("metadata")
    conversation_id = metadata.get("conversation_id") if isinstance(metadata, (dict, Mapping)) else None
    if isinstance(conversation_id, str) and conversation_id:
        return (family, "id", conversation_id)
    turn = first_turn(body)
    if turn is None:
        return None
    try:
        turn_text = orjson.dumps(turn, option=orjson.OPT_SORT_KEYS)
    except (TypeError, orjson.JSONEncodeError):
        return None
    return (family, "turn", turn_text, str(body.get("user")))


class RequestFamilies:
    """Feeds requests in corpus order; see the module docstring."""

    def __init__(self, tokenizer: Tokenizer | None = None, *, allowlist: Sequence[str] = (), block_size: int = DEFAULT_BLOCK_SIZE) -> None:
        self._tokenizer = tokenizer
        self._allowlist = tuple(allowlist)
        self._block_size = block_size
        self._first: dict[Hashable, tuple[Mapping[str, Any], Rendered]] = {}
        self._last: dict[Hashable, tuple[Mapping[str, Any], Rendered]] = {}

    def add(self, body: Mapping[str, Any], rendered: Rendered | None = None) -> Divergence | None:
        """The divergence of ``body`` from its predecessor, or None (also for the first of a group)."""
        family = family_key(body, self._allowlist)
        conversation = conversation_key(body, family)
        if rendered is None:
            rendered = render(body)
        previous = self._last.get(conversation) if conversation is not None else None
        if previous is None:
            previous = self._first.get(family)
        result = None
        if previous is not None:
            result = compare(
                previous[0], body, tokenizer=self._tokenizer, block_size=self._block_size, rendered=(previous[1], rendered)
            )
        self._first.setdefault(family, (body, rendered))
        if conversation is not None:
            self._last[conversation] = (body, rendered)
        return result
