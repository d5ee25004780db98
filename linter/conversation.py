"""Conversation identity: which earlier request a chat request continues (one definition for the gateway and the linter).

A request belongs to the conversation named by an **explicit id**, in this order:
the ``x-prefixgate-conversation`` header (gateway only), ``metadata.conversation_id``,
then ``prompt_cache_key``. Applications often share one ``prompt_cache_key``
across many conversations (it routes requests to a cache, per user or per
application), so a conversation named only by it is ``shared``: a comparison
reports a truncated history or changed tools and instructions, but not a
message that merely differs (it may be another conversation under the key). Without one, it continues an **earlier request whose
messages it extends**: the earlier request's whole message list (as data, key
order ignored) is a prefix of this one's, covering at least the first
non-system message, with the same ``model``, ``user``, ``tools``,
``tool_choice`` and ``response_format``. The caller scopes the lookup (per
tenant in the gateway, per log in the linter).

Never the first user message alone: two unrelated chats that both open with
"hi" and then differ are two conversations, and so are two "hi" requests sent
with different tools or response formats. A retry (the same request again)
continues its original. So an implicit conversation never shows a rewritten
history or changed tools: only an explicit id can tell those apart from a new
conversation.

:func:`conversation_keys` turns a body into :class:`ConversationKeys`: the keys
under which an earlier turn may have been remembered (most specific first) and
the key to remember this request under. Implicit keys are a SHA-256 chain over
the canonical JSON of the messages, one key per prefix, so finding the
predecessor costs one hash per message and one dictionary lookup per key.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import orjson

CONVERSATION_HEADER = "x-prefixgate-conversation"
"""The request header that names a conversation explicitly (the gateway reads it)."""

_STATIC_ROLES = frozenset({"system", "developer"})
_MAX_ID_CHARS = 256
_SCOPE_FIELDS = ("model", "user", "tools", "tool_choice", "response_format")


@dataclass(frozen=True)
class ConversationKeys:
    """Where to look for the previous turn (``lookup``, most specific first) and where to remember this one.

    ``explicit`` is True when an id named the conversation; then ``lookup`` is
    ``(remember,)``. ``shared`` is True when that id is a ``prompt_cache_key``,
    which may name many conversations (see the module docstring).
    """

    lookup: tuple[str, ...]
    remember: str
    explicit: bool
    shared: bool = False


def explicit_id(body: Mapping[str, Any], header: str | None = None) -> tuple[str, bool] | None:
    """The conversation id the client named and whether it is a shared ``prompt_cache_key``; else None.

    Order: the header, ``metadata.conversation_id``, ``prompt_cache_key``.
    """
    if isinstance(header, str) and header:
        return header[:_MAX_ID_CHARS], False
    metadata = body.get("metadata")
    if isinstance(metadata, Mapping):
        value = metadata.get("conversation_id")
        if isinstance(value, str) and value:
            return value[:_MAX_ID_CHARS], False
    value = body.get("prompt_cache_key")
    if isinstance(value, str) and value:
        return value[:_MAX_ID_CHARS], True
    return None


def _anchor(messages: list[Any]) -> int | None:
    """Number of messages up to and including the first non-system one, or None."""
    for i, message in enumerate(messages):
        role = message.get("role") if isinstance(message, Mapping) else None
        if isinstance(role, str) and role not in _STATIC_ROLES:
            return i + 1
    return None


def conversation_keys(body: Mapping[str, Any], header: str | None = None) -> ConversationKeys | None:
    """The keys of ``body``'s conversation (see the module docstring); None when it cannot have one.

    Never raises: a body whose messages are not JSON-serializable has no implicit key.
    """
    named = explicit_id(body, header)
    if named is not None:
        key = "id:" + named[0]
        return ConversationKeys((key,), key, True, named[1])
    messages = body.get("messages")
    if not isinstance(messages, list):
        return None
    anchor = _anchor(messages)
    if anchor is None:
        return None
    chain = hashlib.sha256()
    try:
        chain.update(orjson.dumps([body.get(k) for k in _SCOPE_FIELDS], option=orjson.OPT_SORT_KEYS))
        keys: list[str] = []
        for count, message in enumerate(messages, start=1):
            chain.update(b"\x00" + orjson.dumps(message, option=orjson.OPT_SORT_KEYS))
            if count >= anchor:
                keys.append("ext:" + chain.copy().hexdigest())
    except (TypeError, orjson.JSONEncodeError):
        return None
    keys.reverse()
    return ConversationKeys(tuple(keys), keys[0], False)
