"""Reading and validating client request bodies (bounded, OpenAI-shaped 4xx errors).

Reading is the engine's :class:`~engine.contract.body_reader.BodyReader` (content type,
size, read timeouts, bytes in flight per tenant and overall), its errors rendered as
:class:`GatewayError`.

Only what the gateway itself relies on is validated here (the JSON object, its
nesting depth, the ``model``/``stream``/``messages``/``prompt`` shapes,
``cache_salt``, and the types of the fields it canonicalizes); every other field
is passed through for the upstream to judge.

Parsing: :func:`engine.contract.piecewise_json.loads`, the value (or the error) of
``orjson.loads``, parsed in pieces of about 64 KiB past 256 KiB, so that a large body
parsed on a worker thread does not hold the GIL from the event loop for its whole parse.

Depth: a body nested more than :data:`engine.contract.limits.MAX_JSON_DEPTH` (128)
levels is a 400 ``json_too_deep`` naming the field, the same rule the engine
applies (walked only when the body holds more brackets than that limit). It
keeps every later step total: orjson refuses to encode more than 254 levels
(re-encoding the body, canonicalizing tools), Python's ``json`` and Jinja recurse.
"""

from __future__ import annotations

from typing import Any

import orjson
from starlette.requests import Request

from engine.contract import piecewise_json
from engine.contract.body_reader import BodyLease, BodyReader
from engine.contract.errors import APIError
from engine.contract.limits import MAX_JSON_DEPTH, cache_salt_problem, too_deep_field
from gateway.errors import GatewayError, InvalidRequest


class ClientGone(GatewayError):
    """The client disconnected before the gateway could answer."""

    status = 499
    type = "client_closed_request"
    code = "client_disconnected"


async def read_body(request: Request, reader: BodyReader, lease: BodyLease) -> bytes:
    """The body, read by the engine's bounded :class:`BodyReader` (the one implementation):
    its refusals (415, 413, 408, 429/503 past the bytes in flight) as gateway errors."""
    try:
        return await reader.read(request, lease)
    except APIError as refused:
        if refused.code == "client_disconnected":
            raise ClientGone("client disconnected while sending the body") from None
        error = GatewayError(refused.message, param=refused.param, code=refused.code)
        error.status, error.type = refused.status_code, refused.type
        raise error from None


def _expect(body: dict[str, Any], field: str, kind: type, what: str) -> None:
    value = body.get(field)
    if value is not None and not isinstance(value, kind):
        raise InvalidRequest(f"'{field}' must be {what}, got {type(value).__name__}", param=field)


def parse_body(raw: bytes, endpoint: str) -> dict[str, Any]:
    """The request body as a dict; :class:`InvalidRequest` naming the bad field otherwise."""
    try:
        body = piecewise_json.loads(raw)  # orjson.loads, in bounded pieces for a large body
    except orjson.JSONDecodeError as exc:
        raise InvalidRequest(f"request body is not valid JSON: {exc}", code="invalid_json") from None
    if not isinstance(body, dict):
        raise InvalidRequest("request body must be a JSON object")
    # Each level opens a bracket, so a body with at most MAX_JSON_DEPTH of them (those
    # inside strings counted too) cannot be too deep: two C-speed counts instead of a walk.
    deep = too_deep_field(body) if raw.count(b"{") + raw.count(b"[") > MAX_JSON_DEPTH else None
    if deep is not None:
        raise InvalidRequest(
            f"'{deep}' is nested more than {MAX_JSON_DEPTH} levels deep", param=deep, code="json_too_deep"
        )
    if not isinstance(body.get("model"), str) or not body["model"]:
        raise InvalidRequest("'model' is required and must be a non-empty string", param="model")
    _expect(body, "stream", bool, "a boolean")
    _expect(body, "stream_options", dict, "an object")
    if "cache_salt" in body and (problem := cache_salt_problem(body["cache_salt"])) is not None:
        raise InvalidRequest(problem, param="cache_salt")
    if endpoint == "chat.completions":
        _check_messages(body)
        _expect(body, "tools", list, "an array")
        _expect(body, "response_format", dict, "an object")
    elif endpoint == "responses":
        if not isinstance(body.get("input"), str | list):
            raise InvalidRequest("'input' is required: a string or an array of input items",
                                 param="input")
        _expect(body, "tools", list, "an array")
    elif "prompt" not in body:
        raise InvalidRequest("'prompt' is required", param="prompt")
    return body


def _check_messages(body: dict[str, Any]) -> None:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise InvalidRequest("'messages' must be a non-empty array", param="messages")
    for index, message in enumerate(messages):
        if not isinstance(message, dict):
            raise InvalidRequest(f"messages[{index}] must be an object", param=f"messages[{index}]")
        if not isinstance(message.get("role"), str):
            raise InvalidRequest(
                f"messages[{index}].role must be a string", param=f"messages[{index}].role"
            )
