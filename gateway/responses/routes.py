"""The Responses state routes: ``GET`` / ``DELETE /v1/responses/{id}`` and
``GET /v1/responses/{id}/input_items``.

Every route authenticates the caller's tenant first and only sees that tenant's
responses: another tenant's id, an expired, deleted or unknown one are the same
404 ``response_not_found``. ``input_items`` lists every input item the upstream
got for that response (the earlier turns' items and outputs included, as OpenAI
lists them), newest first unless ``order=asc``, ``limit`` 1-100 (default 20),
paged with ``after`` (an item id). Items sent without an ``id`` are listed with
a stable one, ``<response id>_in<index>``, and a message's string content as one
text part, as OpenAI lists them (the stored bytes are not changed). Bad query values are a 400 naming the
parameter. Blocking store calls run in a thread.
"""

from __future__ import annotations

from typing import Any

import anyio
import orjson
from starlette.requests import Request
from starlette.responses import Response

from gateway.errors import InvalidRequest, NotFound
from gateway.policy.authenticator import Authenticator
from gateway.responses.store import ResponseStore, StoredResponse

MAX_LIMIT = 100


class ResponsesRoutes:
    def __init__(self, store: ResponseStore, authenticator: Authenticator) -> None:
        self.store = store
        self.authenticator = authenticator

    async def _stored(self, request: Request) -> StoredResponse:
        tenant = self.authenticator.tenant_for(request.headers.get("authorization"))
        response_id = request.path_params["response_id"]
        stored = await anyio.to_thread.run_sync(self.store.get, tenant.name, response_id)
        if stored is None:
            raise NotFound(f"Response with id '{response_id:.128}' not found.", param="response_id",
                           code="response_not_found")
        return stored

    async def retrieve(self, request: Request) -> Response:
        stored = await self._stored(request)
        return Response(stored.response, media_type="application/json")

    async def delete(self, request: Request) -> Response:
        stored = await self._stored(request)
        if not await anyio.to_thread.run_sync(self.store.delete, stored.tenant, stored.id):
            raise NotFound(f"Response with id '{stored.id}' not found.", param="response_id",
                           code="response_not_found")
        return _json({"id": stored.id, "object": "response", "deleted": True})

    async def input_items(self, request: Request) -> Response:
        limit, order, after = _page_params(request.query_params)
        stored = await self._stored(request)
        items: list[Any] = orjson.loads(stored.input_items)
        listed = [_with_id(item, f"{stored.id}_in{index}") for index, item in enumerate(items)]
        if order == "desc":
            listed.reverse()
        if after is not None:
            ids = [item.get("id") for item in listed]
            if after not in ids:
                raise InvalidRequest(f"no input item with id '{after:.128}' in this response", param="after")
            listed = listed[ids.index(after) + 1:]
        page = listed[:limit]
        return _json({"object": "list", "data": page,
                      "first_id": page[0]["id"] if page else None,
                      "last_id": page[-1]["id"] if page else None,
                      "has_more": len(listed) > limit})


def _page_params(query: Any) -> tuple[int, str, str | None]:
    raw_limit = query.get("limit", "20")
    if not raw_limit.isdigit() or not 1 <= int(raw_limit) <= MAX_LIMIT:
        raise InvalidRequest(f"'limit' must be a whole number from 1 to {MAX_LIMIT}, got {raw_limit[:32]!r}",
                             param="limit")
    order = query.get("order", "desc")
    if order not in ("asc", "desc"):
        raise InvalidRequest(f"'order' must be 'asc' or 'desc', got {order[:32]!r}", param="order")
    return int(raw_limit), order, query.get("after")


def _with_id(item: Any, fallback: str) -> dict[str, Any]:
    """An item as OpenAI lists it: an ``id``, and a message's string content as one
    ``input_text`` (``output_text`` for the assistant) part."""
    if not isinstance(item, dict):
        return {"id": fallback, "value": item}
    item_id = item.get("id")
    result = item if isinstance(item_id, str) and item_id else {"id": fallback, **item}
    if "type" not in result and "role" in result:
        result = {**result, "type": "message"}
    if result.get("type") == "message" and isinstance(result.get("content"), str):
        kind = "output_text" if result.get("role") == "assistant" else "input_text"
        result = {**result, "content": [{"type": kind, "text": result["content"]}]}
    return result


def _json(payload: Any) -> Response:
    return Response(orjson.dumps(payload), media_type="application/json")
