"""One turn of a stateful Responses conversation: ``store`` and ``previous_response_id``.

The gateway keeps Responses state itself, for every upstream kind, and always
sends ``store: false`` upstream (prefixgate's engine keeps no responses; vLLM keeps
them in one process's memory; OpenAI would keep them 30 days out of the gateway's
reach). A turn (:meth:`ResponseTurns.begin`) takes ``store`` (default true, as
OpenAI) and ``previous_response_id`` out of the body; :meth:`ResponseTurn.expand`
then sends the upstream the previous turn's ``input_items`` bytes, its
``output_items`` bytes and this turn's new input items, joined as bytes
(:func:`gateway.responses.store.join_arrays`): turn N's input is exactly turn N-1's
input plus its output plus the new items, so the upstream's prefix cache holds
everything but the new items. Only the new items were canonicalized (by the
caller, before ``expand``); the stored items are never edited or re-encoded, and
output items are kept as the model wrote them (canonicalizing a generated tool
call's arguments would change the tokens the cache holds). ``instructions`` and
every other field come from this request only, as OpenAI does.

Invariants: a previous response of another tenant, expired or deleted is answered
as missing (400 ``previous_response_not_found``); a continuation past
``max_turns`` or ``max_bytes`` (input items + output items + new items) is a 400
naming ``previous_response_id``; a response is stored only when the upstream
completed it (``completed`` or ``incomplete``), before the client gets its last
byte, so a client that continues at once finds it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import anyio
import orjson

from gateway.errors import InvalidRequest
from gateway.responses.store import MAX_ID_CHARS, ResponseStore, StoredResponse, join_arrays

STORED_STATUSES = ("completed", "incomplete")


def new_items(value: object) -> bytes:
    """This turn's input as a JSON array of items (a string is one user message)."""
    return orjson.dumps([{"role": "user", "content": value}] if isinstance(value, str) else value)


@dataclass
class ResponseTurn:
    tenant: str
    store: bool
    previous: StoredResponse | None
    max_bytes: int  # bound on a continuation's input items
    items: bytes = b"[]"  # every input item sent upstream, set by expand()

    def expand(self, body: dict[str, Any]) -> dict[str, Any]:
        """The body the upstream gets (``store: false``; after a previous response, its
        items and output before the new input). Bounds checked here."""
        self.items = new_items(body["input"])
        result = {**body, "store": False}
        if self.previous is not None:
            self.items = join_arrays(self.previous.input_items, self.previous.output_items, self.items)
            limit = self.max_bytes
            if len(self.items) > limit:
                raise InvalidRequest(
                    f"the conversation would hold {len(self.items)} bytes of input items, over this "
                    f"gateway's limit of {limit}: start a new conversation", param="previous_response_id",
                    code="conversation_too_large")
            result["input"] = orjson.loads(self.items)
        return result

    def joined(self, body: dict[str, Any]) -> dict[str, Any]:
        """``body`` (as the client sent it) with the previous items before its input."""
        if self.previous is None:
            return body
        items = join_arrays(self.previous.input_items, self.previous.output_items, new_items(body["input"]))
        return {**body, "input": orjson.loads(items)}

    def content(self, upstream_body: dict[str, Any]) -> bytes:
        """The upstream request's bytes; a continuation's input is :attr:`items` verbatim."""
        if self.previous is None:
            return orjson.dumps(upstream_body)
        return orjson.dumps({**upstream_body, "input": orjson.Fragment(self.items)})

    def response_fields(self) -> dict[str, Any]:
        """The fields of the response object that describe its storage."""
        return {"store": self.store, "previous_response_id": self.previous.id if self.previous else None}

    def to_store(self, response: object) -> StoredResponse | None:
        """What to store for the upstream's ``response`` object, or None (not kept)."""
        if not self.store or not isinstance(response, dict) or response.get("status") not in STORED_STATUSES:
            return None
        response_id, output = response.get("id"), response.get("output")
        if not isinstance(response_id, str) or not 0 < len(response_id) <= MAX_ID_CHARS or not isinstance(output, list):
            return None
        created = response.get("created_at")
        return StoredResponse(
            id=response_id, tenant=self.tenant,
            created_at=float(created) if isinstance(created, int | float) else 0.0,
            turns=self.previous.turns + 1 if self.previous else 1,
            input_items=self.items, output_items=orjson.dumps(output),
            response=orjson.dumps({**response, **self.response_fields()}),
        )


class ResponseTurns:
    """Begins and saves the turns of one :class:`ResponseStore`."""

    def __init__(self, store: ResponseStore) -> None:
        self.store = store

    async def begin(self, tenant: str, body: dict[str, Any]) -> ResponseTurn:
        """Take ``store`` and ``previous_response_id`` out of ``body`` (mutated) and load the
        previous response; :class:`InvalidRequest` naming the field otherwise."""
        store = body.pop("store", True)
        if store is None:
            store = True
        if not isinstance(store, bool):
            raise InvalidRequest(f"'store' must be a boolean, got {type(store).__name__}", param="store")
        previous_id = body.pop("previous_response_id", None)
        limits = self.store.limits
        turn = ResponseTurn(tenant, store and limits.enabled, None, limits.max_bytes)
        if previous_id is None:
            return turn
        if not isinstance(previous_id, str) or not previous_id:
            raise InvalidRequest("'previous_response_id' must be a non-empty string", param="previous_response_id")
        if not limits.enabled:
            raise InvalidRequest("this gateway keeps no responses (--responses-ttl 0): send the whole "
                                 "conversation as 'input'", param="previous_response_id",
                                 code="previous_response_not_found")
        turn.previous = await anyio.to_thread.run_sync(self.store.get, tenant, previous_id)
        if turn.previous is None:
            raise InvalidRequest(f"Previous response with id '{previous_id:.{MAX_ID_CHARS}}' not found.",
                                 param="previous_response_id", code="previous_response_not_found")
        if turn.previous.turns >= limits.max_turns:
            raise InvalidRequest(
                f"the conversation has {turn.previous.turns} turns, this gateway's limit: start a new "
                "conversation", param="previous_response_id", code="conversation_too_long")
        return turn

    async def save(self, turn: ResponseTurn, response: object) -> bool:
        """Store the upstream's ``response`` for ``turn`` if it is to be kept; whether it was."""
        stored = turn.to_store(response)
        if stored is None:
            return False
        return await anyio.to_thread.run_sync(self.store.put, stored)
