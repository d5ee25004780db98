"""The upstream engine behind the gateway, reached over one pooled httpx client.

Inference requests (``post``, ``stream``) go straight to the client's transport
(the client's timeouts, none of its cookie jar, URL merging or logging: see
``Upstream._send``); health checks and ``GET``s use the client itself.

This module is the only place where httpx exceptions and upstream statuses become
gateway errors:

- connection refused/reset, DNS, connect timeout -> :class:`UpstreamUnavailable` (503);
- read/write/pool timeout -> :class:`UpstreamTimeout` (504);
- any other transport failure, a 5xx, or a body that is not the JSON we need ->
  :class:`UpstreamError` (502);
- a 4xx is the client's mistake as judged by the upstream: passed through with
  its status (its OpenAI-shaped body kept when it has one).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

import httpx
import orjson

from engine.contract.body_reader import TENANT_HEADER
from gateway.config.replica_spec import normalize_base_url
from gateway.errors import (
    GatewayError,
    UpstreamError,
    UpstreamTimeout,
    UpstreamUnavailable,
    UpstreamUnreachable,
)

JSON_HEADERS = {"content-type": "application/json", "accept": "application/json"}
SSE_HEADERS = {"content-type": "application/json", "accept": "text/event-stream"}
TENANT_HEADER_BYTES = TENANT_HEADER.encode()
SENT_EVENT = "http11.send_request_body.complete"


class _Trace:
    """An httpcore trace hook calling ``on_sent`` once the request body is on the wire."""

    def __init__(self, on_sent: Callable[[], None]) -> None:
        self.on_sent = on_sent

    async def __call__(self, event: str, info: dict[str, Any]) -> None:
        if event == SENT_EVENT:
            self.on_sent()


def _transport_of(client: httpx.AsyncClient, url: httpx.URL) -> httpx.AsyncBaseTransport:
    """The transport ``client`` sends ``url``'s requests through (its mounts honoured).
    httpx has no public accessor; this private one is stable across its 0.x releases."""
    return client._transport_for_url(url)


class UpstreamClientError(GatewayError):
    """A 4xx from the upstream, relayed with its status and error body."""

    type = "invalid_request_error"

    def __init__(self, status: int, body: dict[str, Any]) -> None:
        error = body.get("error") if isinstance(body.get("error"), dict) else {}
        assert isinstance(error, dict)
        super().__init__(
            str(error.get("message") or f"upstream rejected the request ({status})"),
            param=error.get("param") if isinstance(error.get("param"), str) else None,
            code=str(error["code"]) if error.get("code") is not None else None,
        )
        self.status = status
        if isinstance(error.get("type"), str):
            self.type = str(error["type"])


def translate(exc: httpx.HTTPError) -> GatewayError:
    if isinstance(exc, httpx.ConnectTimeout | httpx.ConnectError):
        return UpstreamUnreachable(f"upstream unavailable: {type(exc).__name__}: {exc}")
    if isinstance(exc, httpx.TimeoutException):
        return UpstreamTimeout(f"upstream timed out: {type(exc).__name__}")
    return UpstreamError(f"upstream failed: {type(exc).__name__}: {exc}")


def error_for_status(status: int, content: bytes) -> GatewayError:
    """The gateway error for a non-2xx upstream answer."""
    try:
        body = orjson.loads(content)
    except orjson.JSONDecodeError:
        body = None
    if 400 <= status < 500 and status != 408:
        if not isinstance(body, dict) or not isinstance(body.get("error"), dict):
            body = {"error": {"message": content[:500].decode("utf-8", "replace")}}
        return UpstreamClientError(status, body)
    detail = ""
    if isinstance(body, dict) and isinstance(body.get("error"), dict):
        detail = f": {body['error'].get('message')}"
    if status in (408, 504):
        return UpstreamTimeout(f"upstream timed out (HTTP {status}){detail}")
    if status == 503:
        return UpstreamUnavailable(f"upstream unavailable (HTTP 503){detail}")
    return UpstreamError(f"upstream returned HTTP {status}{detail}")


def parse_json_object(content: bytes) -> dict[str, Any]:
    try:
        body = orjson.loads(content)
    except orjson.JSONDecodeError as exc:
        raise UpstreamError(f"upstream sent invalid JSON: {exc}") from None
    if not isinstance(body, dict):
        raise UpstreamError("upstream sent JSON that is not an object")
    return body


class Upstream:
    """One upstream of kind ``vllm`` or ``openai`` (:mod:`gateway.upstream.kinds`).

    ``api_key``, when given, goes out as ``Authorization: Bearer`` on every request.
    Health: ``GET /health`` for vllm; OpenAI has no such route, so ``GET /v1/models``.
    """

    def __init__(
        self, base_url: str, client: httpx.AsyncClient, *, kind: str = "vllm", api_key: str | None = None
    ) -> None:
        self.base_url = normalize_base_url(base_url)
        self.client = client
        self.kind = kind
        self.auth = {"authorization": f"Bearer {api_key}"} if api_key else {}
        self.health_path = "/v1/models" if kind == "openai" else "/health"
        self._json_headers = [(k.encode(), v.encode()) for k, v in {**JSON_HEADERS, **self.auth}.items()]
        self._sse_headers = [(k.encode(), v.encode()) for k, v in {**SSE_HEADERS, **self.auth}.items()]
        self._urls: dict[str, httpx.URL] = {}
        self._transport = _transport_of(client, httpx.URL(self.base_url))

    async def _send(
        self, path: str, content: bytes, headers: list[tuple[bytes, bytes]], on_sent: Callable[[], None] | None,
        tenant: str | None,
    ) -> httpx.Response:
        """POST ``content`` through the client's transport; the response, its body not read yet.

        A ``vllm``-kind upstream (the engine, vLLM) is told the tenant in
        ``x-prefixgate-tenant``: the engine shares prefill fairly between tenants and
        budgets their bodies by it (the isolation is the salt's, not this header's).
        Other kinds never see it.

        The inference hot path skips ``AsyncClient.send``: its URL merging, header
        re-encoding, cookie jar and logging cost more CPU than the whole exchange on the
        pooled connection, and the gateway wants none of them (no upstream cookie may
        travel from one tenant's request to the next). The client's timeouts still apply.
        """
        url = self._urls.get(path)
        if url is None:
            url = self._urls[path] = httpx.URL(self.base_url + path)
        extensions: dict[str, Any] = {"timeout": self.client.timeout.as_dict()}
        if on_sent is not None:
            extensions["trace"] = _Trace(on_sent)
        if tenant is not None and self.kind == "vllm":
            headers = [*headers, (TENANT_HEADER_BYTES, tenant.encode())]
        request = httpx.Request("POST", url, headers=headers, content=content, extensions=extensions)
        response = await self._transport.handle_async_request(request)
        response.request = request
        return response

    async def post(
        self, path: str, content: bytes, on_sent: Callable[[], None] | None = None, tenant: str | None = None
    ) -> tuple[dict[str, Any], bytes]:
        """POST JSON; the parsed 2xx body and its raw bytes, or a gateway error.

        ``on_sent`` is called when the request has been written (HTTP/1.1 transports).
        """
        try:
            response = await self._send(path, content, self._json_headers, on_sent, tenant)
            try:
                body = await response.aread()
            finally:
                await response.aclose()
        except httpx.HTTPError as exc:
            raise translate(exc) from None
        if response.status_code >= 300:
            raise error_for_status(response.status_code, body)
        return parse_json_object(body), body

    async def get(self, path: str) -> dict[str, Any]:
        """GET a JSON object (e.g. ``/v1/models``), or a gateway error."""
        response = await self._get(path, None)
        return parse_json_object(response.content)

    async def call(self, method: str, path: str, *, params: dict[str, str] | None = None,
                   content: bytes | None = None, tenant: str | None = None) -> dict[str, Any]:
        """Any method with optional query and JSON body (the prompt schema routes); the
        parsed 2xx JSON object, or a gateway error (an upstream 4xx relayed as it came)."""
        headers = {**self.auth, **(JSON_HEADERS if content is not None else {})}
        if tenant is not None and self.kind == "vllm":
            headers[TENANT_HEADER_BYTES.decode()] = tenant
        try:
            response = await self.client.request(method, self.base_url + path, params=params, content=content,
                                                 headers=headers)
        except httpx.HTTPError as exc:
            raise translate(exc) from None
        if response.status_code >= 300:
            raise error_for_status(response.status_code, response.content)
        return parse_json_object(response.content)

    async def check_health(self, timeout: float = 5.0) -> None:
        """Return if the upstream's ``/health`` answers 2xx; raise a gateway error otherwise."""
        await self._get(self.health_path, timeout)

    async def _get(self, path: str, timeout: float | None) -> httpx.Response:
        try:
            if timeout is None:
                response = await self.client.get(self.base_url + path, headers=self.auth)
            else:
                response = await self.client.get(self.base_url + path, headers=self.auth, timeout=timeout)
        except httpx.HTTPError as exc:
            raise translate(exc) from None
        if response.status_code >= 300:
            raise error_for_status(response.status_code, response.content)
        return response

    @asynccontextmanager
    async def stream(
        self, path: str, content: bytes, on_sent: Callable[[], None] | None = None, tenant: str | None = None
    ) -> AsyncIterator[AsyncIterator[bytes]]:
        """POST and yield the upstream body as an iterator of byte chunks.

        Errors before the first byte raise gateway errors; errors while iterating
        also raise gateway errors (the caller turns them into an SSE error event).
        Leaving the context closes the upstream response (cancelling it).
        """
        try:
            response = await self._send(path, content, self._sse_headers, on_sent, tenant)
        except httpx.HTTPError as exc:
            raise translate(exc) from None
        try:
            if response.status_code >= 300:
                try:
                    content_bytes = await response.aread()
                except httpx.HTTPError as exc:
                    raise translate(exc) from None
                raise error_for_status(response.status_code, content_bytes)
            yield _translated(response.aiter_bytes())
        finally:
            await response.aclose()


async def _translated(chunks: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
    try:
        async for chunk in chunks:
            yield chunk
    except httpx.HTTPError as exc:
        raise translate(exc) from None
