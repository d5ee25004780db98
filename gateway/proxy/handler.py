"""The proxy: one inference request from the client's bytes to the upstream and back.

Flow (``Proxy.handle``): authenticate -> read the bounded body -> validate ->
take the client's ``cache_salt`` out -> for Responses, take ``store`` and
``previous_response_id`` out and load the previous turn (``response_turn.py``)
-> canonicalize (chat, Responses: the new items only) -> for Responses, put the
previous turn's stored items and output before the new input -> derive the
server-side salt and encode the upstream body (parsing, canonicalizing and
encoding grow with the body: past ``LOOP_MAX_BODY_BYTES`` they run on a thread,
not on the event loop) -> prefix warnings (chat, within the warner's budget): the
conversation-history exchange is started, then the upstream call, and the linter
runs once the request is on the wire, so both overlap the upstream's work (for
``reject_on`` tenants the whole check runs before anything is sent) -> await the
upstream unless the client leaves -> relay, adding warnings (a completed Responses
answer is stored first) -> exactly one stats row, whatever happened. Every failure is a
:class:`GatewayError` rendered at the end of ``handle``; unexpected exceptions
become a 500 and are logged.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable
from typing import Any

import anyio
import orjson
from starlette.requests import Request
from starlette.responses import Response

from engine.contract.body_reader import BodyLease, BodyReader
from gateway.config.config_file import Tenant
from gateway.errors import GatewayError, PrefixWarningRejected, error_response
from gateway.policy.authenticator import Authenticator
from gateway.policy.canonicalizer import canonicalize
from gateway.policy.prefix_warner import CONVERSATION_HEADER, PrefixWarner, PrefixWarning
from gateway.proxy.relay_stream import RelayResponse, RelayStream
from gateway.proxy.request_body import ClientGone, parse_body, read_body
from gateway.proxy.sse_relay import SseRelay
from gateway.request_record import RequestRecord
from gateway.responses.body import canonical_chat_view, canonicalize_responses, chat_view
from gateway.responses.turn import ResponseTurn, ResponseTurns
from gateway.routing.replicas import ReplicaSet
from gateway.stats.metrics import GatewayMetrics
from gateway.stats.writer import StatsWriter
from gateway.upstream.kinds import openai_usage, scoped_body

log = logging.getLogger(__name__)

PATHS = {"chat.completions": "/v1/chat/completions", "completions": "/v1/completions",
         "responses": "/v1/responses"}
WARNINGS_HEADER = "x-prefixgate-warnings"
LOOP_MAX_BODY_BYTES = 64 * 1024  # larger bodies are parsed, canonicalized and encoded on a thread

# (the body as sent without its cache_salt, canonical, upstream, strip usage, encoded upstream body)
_Prepared = tuple[dict[str, Any], dict[str, Any], dict[str, Any], bool, bytes]


class Proxy:
    def __init__(
        self,
        *,
        replicas: ReplicaSet,
        authenticator: Authenticator,
        warner: PrefixWarner,
        writer: StatsWriter,
        metrics: GatewayMetrics,
        secret: bytes,
        bodies: BodyReader,
        turns: ResponseTurns,
    ) -> None:
        self.replicas = replicas
        self.authenticator = authenticator
        self.warner = warner
        self.writer = writer
        self.metrics = metrics
        self.secret = secret
        self.bodies = bodies
        self.turns = turns

    async def handle(self, request: Request, endpoint: str) -> Response:
        record = RequestRecord(endpoint=endpoint, upstream=self.replicas.primary.base_url)
        lease = self.bodies.lease()
        streaming = False
        try:
            response = await self._handle(request, record, lease)
            streaming = isinstance(response, RelayResponse)  # its stack releases the lease at the end
            return response
        except GatewayError as error:
            _forget_frames(error)
            return self._fail(record, error)
        except Exception as error:
            log.exception("unexpected error in the gateway")
            _forget_frames(error)
            return self._fail(record, GatewayError("internal gateway error", code="internal_error"))
        finally:
            if not streaming:
                lease.release()

    def _fail(self, record: RequestRecord, error: GatewayError) -> Response:
        record.finish(error.status, error.code)
        self._record(record)
        headers = {WARNINGS_HEADER: ",".join(sorted(set(record.warning_codes)))} if record.warning_codes else None
        return error_response(error, headers)

    def _record(self, record: RequestRecord) -> None:
        ReplicaSet.finish(record)
        self.writer.submit(record)
        self.metrics.observe(record)

    def _prepare(self, body: dict[str, Any], tenant: Tenant, record: RequestRecord,
                 turn: ResponseTurn | None) -> _Prepared:
        """Canonicalize and scope one parsed body, and encode what goes upstream. The first
        two items are what the prefix check sees: the body as sent (without its
        ``cache_salt``) and the canonical body, as chat requests (a Responses body's
        :func:`chat_view`, with the previous turn's items before the new input; the
        canonical one in the chat canonical form)."""
        client_salt = body.pop("cache_salt", None)
        original = body
        if record.endpoint == "chat.completions":
            body, record.canonicalization = canonicalize(body, tenant.canonicalize)
        elif turn is not None:  # stateful Responses: the previous turn's items before the new input
            body, record.canonicalization = canonicalize_responses(body, tenant.canonicalize)
            original, body = turn.joined(original), turn.expand(body)
        upstream_body, strip_usage = self._upstream_body(body, tenant, client_salt, record)
        content = turn.content(upstream_body) if turn is not None else orjson.dumps(upstream_body)
        if record.endpoint == "responses" and tenant.warnings:  # warned about as the chat request it stands for
            original, body = chat_view(original) or {}, canonical_chat_view(body, tenant.canonicalize) or {}
        return original, body, upstream_body, strip_usage, content

    async def _handle(self, request: Request, record: RequestRecord, lease: BodyLease) -> Response:
        tenant = self.authenticator.tenant_for(request.headers.get("authorization"))
        record.tenant = lease.tenant = tenant.name
        raw = await read_body(request, self.bodies, lease)
        # Work that grows with the body stays off the event loop past a small size (in a
        # thread the loop still gets the GIL back every switch interval between Python steps).
        on_thread = len(raw) > LOOP_MAX_BODY_BYTES
        body = (await anyio.to_thread.run_sync(parse_body, raw, record.endpoint) if on_thread
                else parse_body(raw, record.endpoint))
        record.model, record.stream = body["model"], bool(body.get("stream"))  # in the row even if refused below
        turn = await self.turns.begin(tenant.name, body) if record.endpoint == "responses" else None
        prepared = (await anyio.to_thread.run_sync(self._prepare, body, tenant, record, turn) if on_thread
                    else self._prepare(body, tenant, record, turn))
        original, body, upstream_body, strip_usage, content = prepared

        async def check(lint_after: asyncio.Future[None] | None = None) -> list[PrefixWarning]:
            if record.endpoint == "completions" or not tenant.warnings:
                return []
            as_sent, canonical = original, body
            as_sent_raw: bytes | None = raw
            if record.endpoint == "responses":  # the chat views (_prepare)
                as_sent_raw = None
                if not canonical.get("messages"):
                    return []
            return await self.warner.check_within_budget(
                tenant.name, as_sent, canonical, body_size=len(raw),
                conversation_header=request.headers.get(CONVERSATION_HEADER), raw=as_sent_raw,
                lint_after=lint_after,
            )

        warnings: list[PrefixWarning] | None = None
        if tenant.reject_on:  # the verdict is needed before anything goes upstream
            warnings = await check()
            self._enforce(tenant, record, warnings)
        sent: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        # Advisory warnings are computed while the upstream works on the request: the
        # history exchange starts first (its round trip overlaps the upstream call), the
        # linter once the request is on the wire (or the call ended).
        checking = asyncio.ensure_future(check(sent)) if warnings is None else None
        stack = contextlib.AsyncExitStack()
        try:
            route = await self.replicas.route(record, upstream_body)  # replica + predicted hit
        except BaseException:
            if checking is not None:
                checking.cancel()
            raise
        path = PATHS[record.endpoint]

        def on_sent(*_: Any) -> None:
            if not sent.done():
                sent.set_result(None)

        work = asyncio.ensure_future(
            stack.enter_async_context(route.stream(path, content, on_sent))
            if record.stream
            else route.post(path, content, on_sent)
        )
        work.add_done_callback(on_sent)
        try:
            if checking is not None:
                warnings = await checking
            assert warnings is not None
            record.warning_codes = [warning.code for warning in warnings]
            result = await _unless_disconnected(request, work)
        except BaseException:
            work.cancel()
            if checking is not None:
                checking.cancel()
            await stack.aclose()
            raise
        warning_dicts = [warning.to_dict() for warning in warnings]
        headers = self._headers(record)
        if record.stream:
            stack.callback(lease.release)  # the upstream request (and its body) lives as long as the stream
            relay = SseRelay(record, strip_usage=strip_usage, warnings=warning_dicts)
            on_response = None if turn is None else self._saver(turn)
            return RelayResponse(RelayStream(stack, result, relay, record, self._record, on_response), headers)
        patch: dict[str, Any] = {}
        if turn is not None:
            await self._saver(turn)(result[0])
            patch.update(turn.response_fields())
        usage = openai_usage(self.replicas.kind, result[0])
        if usage is not None:
            patch["usage"] = usage
        return self._complete(record, result, warning_dicts, headers, patch)

    def _saver(self, turn: ResponseTurn) -> Callable[[Any], Awaitable[object]]:
        """Stores a turn's completed response; a storage failure is a 500 (logged)."""
        async def save(response: Any) -> object:
            try:
                return await self.turns.save(turn, response)
            except Exception:
                log.exception("could not store a response")
                raise GatewayError("the gateway could not store the response", code="response_store_failed") from None
        return save

    def _upstream_body(
        self, body: dict[str, Any], tenant: Tenant, client_salt: str | None, record: RequestRecord
    ) -> tuple[dict[str, Any], bool]:
        """The body sent upstream (server-side salt or cache key; usage asked for when streaming),
        and whether the usage chunk must be stripped again for the client. A Responses
        stream always ends with its usage (in ``response.completed``)."""
        upstream_body = scoped_body(self.replicas.kind, body, self.secret, tenant.scope, client_salt)
        options = upstream_body.get("stream_options") or {}
        strip_usage = (record.stream and record.endpoint != "responses"
                       and not options.get("include_usage"))
        if strip_usage:
            upstream_body["stream_options"] = {**options, "include_usage": True}
        return upstream_body, strip_usage

    def _enforce(self, tenant: Tenant, record: RequestRecord, warnings: list[PrefixWarning]) -> None:
        record.warning_codes = [warning.code for warning in warnings]
        blocked = sorted(tenant.reject_on.intersection(record.warning_codes))
        if blocked:
            raise PrefixWarningRejected(
                f"request rejected by this tenant's reject_on policy: {', '.join(blocked)}",
                param="messages",
                extra={"prefix_warnings": [warning.to_dict() for warning in warnings]},
            )

    def _headers(self, record: RequestRecord) -> dict[str, str]:
        headers = {}
        if record.warning_codes:
            headers[WARNINGS_HEADER] = ",".join(sorted(set(record.warning_codes)))
        if record.canonicalization:
            headers["x-prefixgate-canonicalized"] = ",".join(record.canonicalization)
        return headers

    def _complete(
        self,
        record: RequestRecord,
        result: tuple[dict[str, Any], bytes],
        warnings: list[dict[str, Any]],
        headers: dict[str, str],
        patch: dict[str, Any],
    ) -> Response:
        """``patch``: top-level fields replacing the upstream's (Responses storage, mapped usage)."""
        parsed, content = result
        record.mark_first_byte()
        parsed.update(patch)
        record.take_usage(parsed.get("usage"))
        if warnings:
            parsed["prefix_warnings"] = warnings
        if warnings or patch:
            content = orjson.dumps(parsed)
        record.finish(200)
        self._record(record)
        return Response(content, status_code=200, media_type="application/json", headers=headers)


def _forget_frames(error: BaseException) -> None:
    """Drop the tracebacks of ``error`` and of the exceptions it chains to.

    A failed request's traceback holds ``_handle``'s frame, whose locals hold the body
    three times over (raw bytes, parsed dict, upstream bytes) and the ``work`` future,
    which holds the exception again: a reference cycle that only the cyclic collector
    frees, and ``settle_heap`` makes its runs rare. 40 bodies of 7.9 MiB answered 429
    upstream stayed held (1 GiB) until this was done at the one place errors are caught.
    """
    seen: set[int] = set()
    pending: list[BaseException | None] = [error]
    while pending:
        current = pending.pop()
        if current is None or id(current) in seen:
            continue
        seen.add(id(current))
        current.__traceback__ = None
        pending += [current.__cause__, current.__context__]


async def _unless_disconnected(request: Request, work: Awaitable[Any]) -> Any:
    """Await ``work``; if the client disconnects first, cancel it and raise ClientGone."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_disconnected(request.receive))
    try:
        done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
    if task not in done:
        task.cancel()
        with contextlib.suppress(BaseException):
            await task
        raise ClientGone("client disconnected before the upstream answered")
    return task.result()


async def _disconnected(receive: Callable[[], Awaitable[Any]]) -> None:
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return
