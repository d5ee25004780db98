"""The streaming half of the proxy: one upstream SSE stream relayed to one client.

Invariant: :meth:`RelayStream.close` runs exactly once per stream whatever happens
(normal end, upstream failure, client disconnect, or the response being cancelled
before its body was ever iterated): it closes the upstream response (which
cancels the upstream request) and hands the request's row to ``on_finish``.
Backpressure is natural: the next upstream chunk is read only after the previous
events were sent to the client.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import anyio
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from gateway.errors import GatewayError, UpstreamError
from gateway.proxy.sse_relay import SseRelay
from gateway.request_record import RequestRecord

CLIENT_CLOSED = 499


class RelayStream:
    def __init__(
        self,
        stack: contextlib.AsyncExitStack,
        chunks: AsyncIterator[bytes],
        relay: SseRelay,
        record: RequestRecord,
        on_finish: Callable[[RequestRecord], None],
        on_response: Callable[[dict[str, Any]], Awaitable[object]] | None = None,
    ) -> None:
        """``on_response``: awaited with a Responses stream's final response object
        before the events carrying it go to the client (``response_turn`` stores it)."""
        self.stack = stack
        self.chunks = chunks
        self.relay = relay
        self.record = record
        self.on_finish = on_finish
        self.on_response = on_response
        self._status: int = CLIENT_CLOSED
        self._code: str | None = "client_disconnected"
        self._closed = False

    async def events(self) -> AsyncIterator[bytes]:
        try:
            async for chunk in self.chunks:
                events = self.relay.feed(chunk)
                await self._settle()
                if events:  # the events of one upstream read go out in one write
                    yield b"".join(events)
                self.relay.raise_failure()  # a malformed upstream event ends the stream
            tail = self.relay.finish()
            await self._settle()
            if tail:
                yield b"".join(tail)
            self.relay.raise_failure()
            if not self.relay.saw_done:
                end = "its final response event" if self.relay.responses else "'data: [DONE]'"
                raise UpstreamError(f"upstream stream ended before {end}")
            ended_by = self.relay.ended_by  # a Responses error event, relayed as sent
            self._status, self._code = ((200, None) if ended_by is None
                                        else (ended_by.status, ended_by.code))
        except GatewayError as error:
            # Headers are already sent: report the failure as the stream's final event(s).
            self._status, self._code = error.status, error.code
            yield b"".join(self.relay.error_events(error))
        finally:
            await self.close()

    async def _settle(self) -> None:
        response, self.relay.final_response = self.relay.final_response, None
        if response is not None and self.on_response is not None and self.relay.failure is None:
            await self.on_response(response)

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        with anyio.CancelScope(shield=True):
            await self.stack.aclose()
        self.record.finish(self._status, self._code)
        self.on_finish(self.record)


class RelayResponse(StreamingResponse):
    """A StreamingResponse that always closes its :class:`RelayStream`."""

    def __init__(self, stream: RelayStream, headers: dict[str, str]) -> None:
        super().__init__(
            stream.events(),
            media_type="text/event-stream",
            headers={**headers, "cache-control": "no-cache", "x-accel-buffering": "no"},
        )
        self.stream = stream

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.stream.close()
