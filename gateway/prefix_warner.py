"""Prefix warnings: the linter's per-request rules plus a comparison with the
previous turn of the same conversation.

A *conversation* is identified, per tenant, by the ``x-prefixgate-conversation``
request header when the client sends one, otherwise by the SHA-256 of the
canonical JSON of the request's first ``user`` message (every later turn of a chat
repeats its opening user message). Requests without a user message and without
the header are checked on their own only.

Memory is bounded: at most ``max_tenants`` tenants x ``max_conversations``
conversations are remembered (least recently used evicted first), and bodies
larger than ``max_body_bytes`` are not remembered.

The linter is advisory: if a rule raises on odd input, the request goes on
without that rule's warnings (logged), it is never failed because of it.
"""

from __future__ import annotations

import hashlib
import logging
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import orjson

from linter.api import check_request, compare_requests

log = logging.getLogger(__name__)

CONVERSATION_HEADER = "x-prefixgate-conversation"


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


def conversation_key(body: Mapping[str, Any], header: str | None) -> str | None:
    if header:
        return "header:" + header[:256]
    messages = body.get("messages")
    if not isinstance(messages, list):
        return None
    for message in messages:
        if isinstance(message, dict) and message.get("role") == "user":
            try:
                raw = orjson.dumps(message.get("content"), option=orjson.OPT_SORT_KEYS)
            except TypeError:
                return None
            return "user:" + hashlib.sha256(raw).hexdigest()
    return None


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
        key = conversation_key(canonical, conversation_header)
        if key is None:
            return warnings
        previous = self._remember(tenant, key, canonical, body_size)
        # An exact repeat (a retry) extends its predecessor trivially: nothing to compare.
        if previous is not None and previous != canonical:
            try:
                warnings.extend(_convert(compare_requests(previous, canonical)))
            except Exception:
                log.exception("linter compare_requests failed; continuing without its warnings")
        return warnings

    def _remember(
        self, tenant: str, key: str, body: Mapping[str, Any], body_size: int
    ) -> Mapping[str, Any] | None:
        conversations = self._history.get(tenant)
        if conversations is None:
            conversations = self._history[tenant] = OrderedDict()
            if len(self._history) > self.max_tenants:
                self._history.popitem(last=False)
        else:
            self._history.move_to_end(tenant)
        previous = conversations.pop(key, None)
        if body_size <= self.max_body_bytes:
            conversations[key] = body
            if len(conversations) > self.max_conversations:
                conversations.popitem(last=False)
        return previous
