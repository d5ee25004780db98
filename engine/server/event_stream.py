"""EventStreamResponse: a server-sent-events response that notices a client going away.

Starlette's ``StreamingResponse`` only watches for a disconnect on some ASGI spec
versions; this response always does. It sends the body chunks from an async
iterator while a second task waits for ``http.disconnect``; whichever ends first
cancels the other. ``on_close`` runs exactly once in every case (normal end,
disconnect, error, server shutdown), which is where the server cancels the
engine request so its KV blocks are freed.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Callable

import anyio
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

logger = logging.getLogger(__name__)

SSE_HEADERS = {"cache-control": "no-cache", "x-accel-buffering": "no"}


class EventStreamResponse(Response):
    media_type = "text/event-stream"

    def __init__(self, events: AsyncIterator[bytes], on_close: Callable[[], None]) -> None:
        super().__init__(content=None, status_code=200, headers=SSE_HEADERS)
        # The length is unknown: drop the content-length: 0 that Response adds for no content.
        self.raw_headers = [(k, v) for k, v in self.raw_headers if k != b"content-length"]
        self.events = events
        self.on_close = on_close
        self.client_disconnected = False

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            async with anyio.create_task_group() as group:

                async def send_events() -> None:
                    try:
                        await self._send_events(send)
                    except OSError:  # the socket went away while sending: a disconnect
                        self.client_disconnected = True
                    group.cancel_scope.cancel()

                group.start_soon(send_events)
                await self._wait_disconnect(receive)
                group.cancel_scope.cancel()
        finally:
            self.on_close()

    async def _send_events(self, send: Send) -> None:
        await send({"type": "http.response.start", "status": self.status_code,
                    "headers": self.raw_headers})
        try:
            async for chunk in self.events:
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
        finally:
            aclose = getattr(self.events, "aclose", None)
            if aclose is not None:
                with anyio.CancelScope(shield=True):
                    await aclose()
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    async def _wait_disconnect(self, receive: Receive) -> None:
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                self.client_disconnected = True
                logger.debug("client disconnected from an event stream")
                return
