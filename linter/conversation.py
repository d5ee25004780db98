"""Conversation identity: which earlier request a chat request continues (one definition for the gateway and the linter).

A request belongs to the conversation named by an **explicit id**, in this order:
the ``x-prefixgate-conversation`` header (gateway only), ``metadata.conversation_id``,
then ``prompt_cache_key``. Applications often share one ``prompt_cache_key``
across many conversations (it routes requests to a cache, per user or per
application), so a conversation named only by it is ``shared``: a comparison
reports a truncated history or changed tools and instructions, but not a
message that merely differs (it may be another conversation under the key).

Without an id (most applications log none), a request continues an earlier one
found in one of two ways, tried in this order:

1. **Extension**: the earlier request's whole message list (as data, key order
   ignored) is a prefix of this one's, covering at least the first non-system
   message, with the same ``model``, ``user``, ``tools``, ``tool_choice`` and
   ``response_format``. A retry (the same request again) continues its original.
2. **A model output repeated**: this request repeats, verbatim as data, the
   earlier request's latest *model output* (an assistant message: its text and
   its tool calls, each named by its id, function name and arguments compared
   as parsed JSON so a re-serialized argument string is the same call) and
   every message the earlier request had after it, with the same ``model`` and
   ``user``. A model's output identifies a conversation far better than its first
   message: what comes *before* it may have been edited (a first user message
   rewritten, tool-call arguments re-serialized with another key order), which is
   exactly what the comparison should then report, and the tools may have changed.
   Requiring the messages *after* the output to be repeated too keeps unrelated
   conversations apart even when a model answered them alike (at temperature 0
   two chats opening with the same system prompt and "hi" get the same reply,
   and then differ).

Never the first user message alone: two unrelated chats that both open with
"hi" and then differ are two conversations, and so are two "hi" requests sent
with different tools or response formats.

:func:`conversation_keys` turns a body into :class:`ConversationKeys`: the keys
under which an earlier turn may have been remembered (most specific first) and
the keys to remember this request under (its extension key, and its latest
model output with what follows it). Keys are SHA-256 chains over the
canonical JSON of the messages, one message digest each: finding the
predecessor costs one digest per message, a few dozen 32-byte hashes for the
latest :data:`OUTPUTS_LOOKED_UP` outputs, and one dictionary lookup per key.
When several earlier requests are found (an older turn this one extends, and
a later turn whose output it repeats), the **most recent** is the previous turn:
:func:`take_previous` and :class:`Turn` are the one implementation of that
choice, for the gateway's history and the linter's log pass alike. A request
that repeats another conversation's reply *and* everything after it, sent after
that conversation's own turn, is ambiguous by content alone; an explicit id
settles it. The caller scopes the lookup (per tenant in the gateway, per log in
the linter).
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, MutableMapping
from dataclasses import dataclass
from typing import Any

import orjson

CONVERSATION_HEADER = "x-prefixgate-conversation"
"""The request header that names a conversation explicitly (the gateway reads it)."""

_STATIC_ROLES = frozenset({"system", "developer"})
_MAX_ID_CHARS = 256
_SCOPE_FIELDS = ("model", "user", "tools", "tool_choice", "response_format")
_OUTPUT_SCOPE_FIELDS = ("model", "user")
OUTPUTS_LOOKED_UP = 4
"""How many of a request's latest model outputs are looked up (its predecessor's
latest output is normally its second latest)."""


@dataclass(frozen=True)
class ConversationKeys:
    """Where to look for the previous turn (``lookup``, most specific first) and where to remember this one.

    ``explicit`` is True when an id named the conversation; then ``lookup`` is
    ``(remember,)``. ``shared`` is True when that id is a ``prompt_cache_key``,
    which may name many conversations (see the module docstring). ``also``: further
    keys to remember this request under (its latest model output and what follows
    it), looked up by later requests that repeat that output but do not extend
    this one. ``lookup[0] == remember`` always (a retry finds its original first).
    """

    lookup: tuple[str, ...]
    remember: str
    explicit: bool
    shared: bool = False
    also: tuple[str, ...] = ()


@dataclass(frozen=True, eq=False)
class Turn:
    """A remembered request: ``value`` (whatever the caller keeps), the keys it is stored
    under, and a sequence number (larger is more recent)."""

    value: Any
    names: tuple[str, ...]
    seq: int


def remember_turn(store: MutableMapping[str, Turn], keys: ConversationKeys, value: Any, seq: int) -> Turn:
    """Store ``value`` under every key of ``keys`` (``remember`` and ``also``); changes ``store``."""
    turn = Turn(value, (keys.remember, *keys.also), seq)
    for name in turn.names:
        store[name] = turn
    return turn


def take_previous(store: MutableMapping[str, Turn], keys: ConversationKeys, *, remove: bool = True) -> Turn | None:
    """The most recent turn stored under any of ``keys.lookup``, or None.

    With ``remove`` it leaves ``store`` under all its keys (it is the latest turn of
    no other request any more); changes ``store`` then, else only reads it.
    """
    latest: Turn | None = None
    for key in keys.lookup:
        turn = store.get(key)
        if turn is not None and (latest is None or turn.seq > latest.seq):
            latest = turn
    if latest is not None and remove:
        for name in latest.names:
            if store.get(name) is latest:
                del store[name]
    return latest


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


def _output_identity(message: Any) -> bytes | None:
    """The model output an assistant message holds (text, and calls by id, name and
    parsed arguments), as canonical JSON; None for other messages and empty turns."""
    if not isinstance(message, Mapping) or message.get("role") != "assistant":
        return None
    content = message.get("content")
    if isinstance(content, list):
        content = "\n".join(str(p.get("text")) for p in content if isinstance(p, Mapping) and "text" in p)
    text = content if isinstance(content, str) else ""
    calls: list[Any] = []
    raw_calls = message.get("tool_calls")
    for call in raw_calls if isinstance(raw_calls, list) else []:
        function = call.get("function") if isinstance(call, Mapping) else None
        if not isinstance(function, Mapping):
            continue
        arguments = function.get("arguments")
        if isinstance(arguments, str):
            try:
                arguments = ["json", orjson.loads(arguments)]
            except orjson.JSONDecodeError:
                arguments = ["raw", arguments]
        calls.append([call.get("id"), function.get("name"), arguments])
    if not text.strip() and not calls:
        return None
    return orjson.dumps({"calls": calls, "text": text}, option=orjson.OPT_SORT_KEYS)


def _covered(entry: tuple[int, str]) -> int:
    return entry[0]


def _output_keys(scope: bytes, identities: list[tuple[int, bytes]],
                 digests: dict[int, bytes]) -> tuple[list[tuple[int, str]], str | None]:
    """``(messages covered, key)`` to look up by the latest outputs, and the key to also
    remember the request under (its latest output and everything after it)."""
    lookup: list[tuple[int, str]] = []
    remember = None
    for rank, (index, identity) in enumerate(reversed(identities)):
        chain = hashlib.sha256(scope + b"\x00" + identity)
        lookup.append((index + 1, "out:" + chain.hexdigest()))
        position = index + 1
        while position in digests:  # the messages after the output, one key per length
            chain.update(digests[position])
            position += 1
            lookup.append((position, "out:" + chain.hexdigest()))
        if rank == 0:
            remember = lookup[-1][1]
    return lookup, remember


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
        scope = orjson.dumps([body.get(k) for k in _OUTPUT_SCOPE_FIELDS], option=orjson.OPT_SORT_KEYS)
        keys: list[tuple[int, str]] = []
        encoded: list[bytes] = []
        for count, message in enumerate(messages, start=1):
            encoded.append(orjson.dumps(message, option=orjson.OPT_SORT_KEYS))
            chain.update(b"\x00" + encoded[-1])
            if count >= anchor:
                keys.append((count, "ext:" + chain.copy().hexdigest()))
        identities: list[tuple[int, bytes]] = []  # the latest outputs only, oldest first
        for index in range(len(messages) - 1, -1, -1):
            if len(identities) == OUTPUTS_LOOKED_UP:
                break
            identity = _output_identity(messages[index])
            if identity is not None:
                identities.insert(0, (index, identity))
        first = identities[0][0] if identities else len(messages)
        digests = {i: hashlib.sha256(encoded[i]).digest() for i in range(first + 1, len(messages))}
    except (TypeError, orjson.JSONEncodeError):
        return None
    by_output, by_latest = _output_keys(scope, identities, digests)
    also = () if by_latest is None else (by_latest,)
    # The longest earlier request this one continues first (a retry finds its original
    # first); at equal length an extension before a repeated output.
    ranked = sorted(keys + by_output, key=_covered, reverse=True) if by_output else reversed(keys)  # stable
    return ConversationKeys(tuple(key for _, key in ranked), keys[-1][1], False, also=also)
