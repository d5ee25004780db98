"""Prefix warnings: the linter's per-request rules plus a comparison with the
previous turn of the same conversation.

A *conversation* is identified, per tenant, as the linter defines it
(:func:`linter.api.conversation_keys`, one definition for both): the
``x-prefixgate-conversation`` header, ``metadata.conversation_id`` or
``prompt_cache_key``, else an earlier request whose messages this one extends.
Never the first user message alone. Requests without a user message and without
an id are checked on their own only.

Memory is bounded: at most ``max_tenants`` tenants x ``max_conversations``
conversations are remembered (least recently used evicted first), and bodies
larger than ``max_body_bytes`` are not remembered.

The linter is advisory: if a rule raises on odd input, the request goes on
without that rule's warnings (logged), it is never failed because of it.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from linter.api import (
    CONVERSATION_HEADER,
    ConversationKeys,
    check_request,
    compare_requests,
    conversation_keys,
)

log = logging.getLogger(__name__)

__all__ = ["CONVERSATION_HEADER", "PrefixWarner", "PrefixWarning"]


@dataclass(frozen=True)
class PrefixWarning:
    code: str
    severity: str
    message: str
    location: str
    tokens_lost: int | None = None

    def to_dict(self) -> dict[str, Any]:
        return {
            "code": self.code,
            "severity": self.severity,
            "message": self.message,
            "location": self.location,
            "tokens_lost": self.tokens_lost,
        }


def _convert(findings: list[Any]) -> list[PrefixWarning]:
    return [
        PrefixWarning(f.code, f.severity, f.message, f.location, f.tokens_lost) for f in findings
    ]


class PrefixWarner:
    def __init__(
        self, *, max_tenants: int = 1024, max_conversations: int = 64, max_body_bytes: int = 512 * 1024
    ) -> None:
        self.max_tenants = max_tenants
        self.max_conversations = max_conversations
        self.max_body_bytes = max_body_bytes
        self._history: OrderedDict[str, OrderedDict[str, Mapping[str, Any]]] = OrderedDict()

    def check(
        self,
        tenant: str,
        original: Mapping[str, Any],
        canonical: Mapping[str, Any],
        *,
        body_size: int,
        conversation_header: str | None = None,
    ) -> list[PrefixWarning]:
        """Findings for one request; remembers ``canonical`` as the conversation's latest turn.

        Per-request rules see the body as the client sent it (so input the gateway
        had to canonicalize is reported); the cross-turn comparison sees canonical
        bodies (what the upstream cache sees).
        """
        warnings: list[PrefixWarning] = []
        try:
            warnings.extend(_convert(check_request(original)))
        except Exception:
            log.exception("linter check_request failed; continuing without its warnings")
        keys = conversation_keys(canonical, conversation_header)
        if keys is None:
            return warnings
        previous = self._remember(tenant, keys, canonical, body_size)
        # An exact repeat (a retry) extends its predecessor trivially: nothing to compare.
        if previous is not None and previous != canonical:
            try:
                found = compare_requests(previous, canonical, same_conversation=True, edits=not keys.shared)
                warnings.extend(_convert(found))
            except Exception:
                log.exception("linter compare_requests failed; continuing without its warnings")
        return warnings

    def _remember(
        self, tenant: str, keys: ConversationKeys, body: Mapping[str, Any], body_size: int
    ) -> Mapping[str, Any] | None:
        conversations = self._history.get(tenant)
        if conversations is None:
            conversations = self._history[tenant] = OrderedDict()
            if len(self._history) > self.max_tenants:
                self._history.popitem(last=False)
        else:
            self._history.move_to_end(tenant)
        previous = None
        for key in keys.lookup:
            previous = conversations.pop(key, None)
            if previous is not None:
                break
        if body_size <= self.max_body_bytes:
            conversations[keys.remember] = body
            if len(conversations) > self.max_conversations:
                conversations.popitem(last=False)
        return previous
