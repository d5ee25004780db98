"""HTTP/1.1 keep-alive connections to the upstream: an httpx transport with O(1) checkout.

Why not httpcore's pool: every time a request starts or ends it walks every
pooled connection (polling each socket to see whether it expired) and every
queued request, so the work per request grows with the number of connections.
Profiled with py-spy at 128 concurrent clients, that walk was the largest share of
the gateway's CPU, and throughput fell to a sixth of its single-client figure.

Here each origin (scheme, host, port) keeps its idle connections in an
insertion-ordered dict used as a stack: checkout takes the most recently used
one; a connection the peer closes removes itself (``connection_lost``), without
polling, and one whose close the event loop has not processed yet is caught at
checkout by a zero-timeout ``select`` on its socket (an idle HTTP/1.1
connection has nothing to read: readable means closed or broken), so a request
is never written into a connection the upstream already dropped (a killed
replica: the request is then refused on connect and retried elsewhere); an idle one older than ``keepalive_expiry`` is closed at checkout rather
than reused (uvicorn servers drop idle connections after 5 s). A semaphore bounds
the connections per origin (``max_connections``); waiting for one honours the
pool timeout. Responses are parsed by httptools (C, the parser uvicorn uses).

Contract (what httpx and ``upstream/client.py`` rely on):

- failures raise httpx's exceptions: ``ConnectError``/``ConnectTimeout`` before
  anything was sent, ``PoolTimeout``, ``ReadTimeout`` while waiting for bytes
  (the read timeout applies to each wait), ``ReadError`` when the peer closes
  before the response is complete, ``RemoteProtocolError`` for a malformed one;
- the ``trace`` extension is called with ``http11.send_request_body.complete``
  once the request has been handed to the socket;
- a connection returns to the pool only after its response was read to the end
  and both sides allow keep-alive; closing a response early or cancelling the
  request closes its connection (which is how the upstream learns to stop).

Not supported (not needed by the gateway): proxies, HTTP/2, ``Expect: 100-continue``,
keeping a connection after a ``HEAD``.
"""

from __future__ import annotations

import asyncio
import select
import ssl
import time
from collections import deque
from collections.abc import AsyncIterator
from typing import cast

import httptools
import httpx

DEFAULT_PORTS = {"http": 80, "https": 443}
HIGH_WATER = 256 * 1024  # bytes of unread response body before reading pauses
SENT_EVENT = "http11.send_request_body.complete"
_FRAMING = (b"content-length", b"transfer-encoding", b"connection")


class _Connection(asyncio.Protocol):
    """One socket; serves one request at a time (the pool guarantees it)."""

    def __init__(self, origin: _Origin) -> None:
        self.origin = origin
        self.transport: asyncio.Transport | None = None
        self.lost = False
        self.idle_since = 0.0
        self._parser = httptools.HttpResponseParser(self)
        self._waiter: asyncio.Future[None] | None = None
        self._paused = False
        self._begin(active=False)

    def _begin(self, *, active: bool) -> None:
        self.active = active
        self.status = 0
        self.headers: list[tuple[bytes, bytes]] = []
        self.head_done = False
        self.complete = False
        self.keep_alive = False
        self.framed = False  # content-length or chunked: the end is known without EOF
        self.chunks: deque[bytes] = deque()
        self.buffered = 0
        self.error: Exception | None = None

    # ---------------------------------------------------------------- asyncio.Protocol
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # Not an isinstance check: uvloop's TCP transport is not an asyncio.Transport subclass.
        self.transport = cast(asyncio.Transport, transport)

    def data_received(self, data: bytes) -> None:
        if not self.active or self.complete:
            self.error = httpx.RemoteProtocolError("upstream sent bytes outside a response")
            self.close()
            return
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self.error = httpx.RemoteProtocolError(f"malformed upstream response: {exc}")
            self.close()
        self._wake()

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost = True
        if self.active and not self.complete and self.error is None:
            if self.head_done and not self.framed:
                self.complete = True  # a body delimited by the end of the connection
            else:
                self.error = httpx.ReadError("upstream closed the connection before the response was complete")
        self.origin.forget(self)
        self._wake()

    # ---------------------------------------------------------------- httptools callbacks
    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers.append((name, value))
        lowered = name.lower()
        if lowered == b"content-length" or (lowered == b"transfer-encoding" and b"chunked" in value.lower()):
            self.framed = True

    def on_headers_complete(self) -> None:
        self.status = self._parser.get_status_code()
        self.head_done = True

    def on_body(self, body: bytes) -> None:
        self.chunks.append(body)
        self.buffered += len(body)
        if self.buffered > HIGH_WATER and not self._paused and self.transport is not None:
            self._paused = True
            self.transport.pause_reading()

    def on_message_complete(self) -> None:
        self.complete = True
        self.keep_alive = self._parser.should_keep_alive()

    # ---------------------------------------------------------------- used by the pool
    def send(self, method: bytes, target: bytes, headers: list[tuple[bytes, bytes]], body: bytes) -> None:
        assert self.transport is not None
        self._begin(active=True)
        if self.lost or self.transport.is_closing():
            self.error = httpx.ReadError("upstream closed the connection before the response was complete")
            return
        lines = [method, b" ", target, b" HTTP/1.1\r\n"]
        for name, value in headers:
            if name.lower() not in _FRAMING:
                lines += [name, b": ", value, b"\r\n"]
        if body or method not in (b"GET", b"HEAD"):
            lines += [b"Content-Length: ", str(len(body)).encode(), b"\r\n"]
        lines.append(b"\r\n")
        self.transport.writelines([b"".join(lines), body] if body else [b"".join(lines)])

    async def read_head(self, timeout: float | None, method: bytes) -> None:
        while not self.head_done:
            await self._wait(timeout)
        if method == b"HEAD":
            self.complete, self.keep_alive = True, False

    async def chunks_of_body(self, timeout: float | None) -> AsyncIterator[bytes]:
        while True:
            while self.chunks:
                chunk = self.chunks.popleft()
                self.buffered -= len(chunk)
                if self._paused and self.buffered <= HIGH_WATER // 2 and self.transport is not None:
                    self._paused = False
                    self.transport.resume_reading()
                yield chunk
            if self.complete:
                return
            await self._wait(timeout)

    def dropped(self) -> bool:
        """True when the peer closed (or wrote to) this idle connection, even before the
        event loop processed it: one non-blocking ``select`` on the socket."""
        if self.lost or self.transport is None or self.transport.is_closing():
            return True
        sock = self.transport.get_extra_info("socket")
        if sock is None:
            return False
        try:
            readable, _, _ = select.select([sock], [], [], 0)
        except (OSError, ValueError):
            return True
        return bool(readable)

    def reusable(self) -> bool:
        return self.complete and self.keep_alive and not self.lost and self.error is None and not self.chunks

    def close(self) -> None:
        if self.transport is not None and not self.transport.is_closing():
            self.transport.close()

    async def _wait(self, timeout: float | None) -> None:
        if self.error is not None:
            raise self.error
        if self.lost:  # connection_lost settled complete or error; nothing more will come
            if not self.complete:
                raise httpx.ReadError("upstream closed the connection before the response was complete")
            return
        self._waiter = asyncio.get_running_loop().create_future()
        try:
            async with asyncio.timeout(timeout):
                await self._waiter
        except TimeoutError:
            raise httpx.ReadTimeout("timed out waiting for the upstream's response") from None
        finally:
            self._waiter = None
        if self.error is not None:
            raise self.error

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)


class _Origin:
    """The connections to one (scheme, host, port)."""

    def __init__(self, scheme: str, host: str, port: int, max_connections: int | None) -> None:
        self.scheme, self.host, self.port = scheme, host, port
        self.idle: dict[_Connection, None] = {}  # insertion order = recency: popitem() is LIFO
        self.slots = asyncio.Semaphore(max_connections) if max_connections else None

    def forget(self, connection: _Connection) -> None:
        self.idle.pop(connection, None)


class ConnectionPool(httpx.AsyncBaseTransport):
    """An httpx transport: ``httpx.AsyncClient(transport=ConnectionPool(limits=...))``."""

    def __init__(self, *, limits: httpx.Limits, ssl_context: ssl.SSLContext | None = None) -> None:
        self.max_connections = limits.max_connections
        self.max_idle = limits.max_keepalive_connections
        self.keepalive_expiry = limits.keepalive_expiry if limits.keepalive_expiry is not None else float("inf")
        self._ssl_context = ssl_context
        self._origins: dict[tuple[str, str, int], _Origin] = {}
        self.opened = 0  # connections opened so far (for tests and benchmarks)

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        url = request.url
        if url.scheme not in DEFAULT_PORTS:
            raise httpx.UnsupportedProtocol(f"unsupported URL scheme {url.scheme!r}")
        key = (url.scheme, url.host, url.port or DEFAULT_PORTS[url.scheme])
        origin = self._origins.get(key)
        if origin is None:
            origin = self._origins[key] = _Origin(*key, self.max_connections)
        timeouts: dict[str, float | None] = request.extensions.get("timeout", {})
        body = await request.aread()
        method = request.method.encode()
        connection = await self._checkout(origin, timeouts)
        try:
            connection.send(method, url.raw_path, request.headers.raw, body)
            trace = request.extensions.get("trace")
            if trace is not None:
                await trace(SENT_EVENT, {"request": request})
            await connection.read_head(timeouts.get("read"), method)
        except BaseException:
            self._checkin(origin, connection)
            raise
        return httpx.Response(
            connection.status,
            headers=connection.headers,
            stream=_ResponseBody(self, origin, connection, timeouts.get("read")),
            extensions={"http_version": b"HTTP/1.1"},
        )

    async def aclose(self) -> None:
        for origin in self._origins.values():
            for connection in list(origin.idle):
                connection.close()
            origin.idle.clear()

    async def _checkout(self, origin: _Origin, timeouts: dict[str, float | None]) -> _Connection:
        if origin.slots is not None:
            if origin.slots.locked():
                try:
                    async with asyncio.timeout(timeouts.get("pool")):
                        await origin.slots.acquire()
                except TimeoutError:
                    raise httpx.PoolTimeout("timed out waiting for a connection to the upstream") from None
            else:
                await origin.slots.acquire()  # returns at once: a slot is free
        try:
            now = time.monotonic()
            while origin.idle:
                connection, _ = origin.idle.popitem()
                if now - connection.idle_since < self.keepalive_expiry and not connection.dropped():
                    return connection
                connection.close()
            return await self._connect(origin, timeouts.get("connect"))
        except BaseException:
            if origin.slots is not None:
                origin.slots.release()
            raise

    def _checkin(self, origin: _Origin, connection: _Connection) -> None:
        """Return the slot; keep the connection only if its exchange ended cleanly."""
        if origin.slots is not None:
            origin.slots.release()
        keep = connection.reusable() and (self.max_idle is None or len(origin.idle) < self.max_idle)
        connection.active = False
        if keep:
            connection.idle_since = time.monotonic()
            origin.idle[connection] = None
        else:
            connection.close()

    async def _connect(self, origin: _Origin, timeout: float | None) -> _Connection:
        loop = asyncio.get_running_loop()
        tls: ssl.SSLContext | None = None
        if origin.scheme == "https":
            tls = self._ssl_context = self._ssl_context or httpx.create_ssl_context()
        try:
            async with asyncio.timeout(timeout):
                _, connection = await loop.create_connection(
                    lambda: _Connection(origin), origin.host, origin.port,
                    ssl=tls, server_hostname=origin.host if tls else None,
                )
        except TimeoutError:
            raise httpx.ConnectTimeout(f"timed out connecting to {origin.host}:{origin.port}") from None
        except OSError as exc:
            raise httpx.ConnectError(f"cannot connect to {origin.host}:{origin.port}: {exc}") from None
        self.opened += 1
        return connection


class _ResponseBody(httpx.AsyncByteStream):
    """The body of one response; gives its connection back exactly once."""

    def __init__(self, pool: ConnectionPool, origin: _Origin, connection: _Connection, timeout: float | None) -> None:
        self._pool, self._origin, self._connection, self._timeout = pool, origin, connection, timeout
        self._returned = False

    async def __aiter__(self) -> AsyncIterator[bytes]:
        async for chunk in self._connection.chunks_of_body(self._timeout):
            yield chunk
        self._give_back()

    async def aclose(self) -> None:
        self._give_back()

    def _give_back(self) -> None:
        if not self._returned:
            self._returned = True
            self._pool._checkin(self._origin, self._connection)

