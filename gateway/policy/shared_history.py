"""Conversation history shared by the gateway's worker processes.

With ``--workers N`` the kernel spreads client connections over the workers, so
two turns of one conversation may reach different workers. The supervisor
process holds the one history (a :class:`~gateway.policy.prefix_warner.PrefixWarner`'s
bounded LRU, bodies kept as canonical JSON bytes) and serves it on a Unix socket
in a directory only the owner can enter. Each worker's event loop keeps one
connection (:class:`HistoryClient`) and swaps "this turn" for "the previous turn"
in one round trip that never blocks the loop: the request is written, the loop
goes on (the same request's upstream call is already under way), and the reply
resolves the oldest waiting exchange. Requests are pipelined on that connection;
the server answers one connection's requests in order, so replies need no ids. An
exchange whose request stopped waiting (budget spent, client gone) still has its
reply read, and dropped.

Consistency across workers: a request's reply is awaited before its response
starts, so the next turn of a conversation (sent by the client after that
response) finds it, whichever worker it reaches.

Wire format: frames of a 4-byte big-endian length and a payload. A request is
two frames, ``[tenant, lookup, remember, explicit, body_size, also]`` as JSON and the
body's JSON (empty when larger than ``max_body_bytes``: not remembered); the reply
is one frame, the previous body's JSON or empty. If the supervisor cannot be
reached the worker logs it and checks the request on its own (warnings are
advisory; the request never fails because of it); a supervisor that stops
answering costs a request its check's budget, no more.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import os
import socket
import socketserver
import struct
import threading
from collections.abc import Mapping
from typing import Any, BinaryIO, cast

import orjson

from gateway.config import runtime_dir
from linter.api import ConversationKeys

log = logging.getLogger(__name__)

_LENGTH = struct.Struct(">I")
_BUFFER = 1 << 16


def _send(sock: socket.socket, *frames: bytes) -> None:
    sock.sendall(b"".join(_LENGTH.pack(len(frame)) + frame for frame in frames))


def _reader(sock: socket.socket) -> BinaryIO:
    """Buffered reads: a frame's length and payload (usually both frames of a request)
    come out of one ``recv``, not one each: every blocking call hands the GIL back and forth."""
    return cast(BinaryIO, sock.makefile("rb", buffering=_BUFFER))


def _recv_exact(reader: BinaryIO, size: int) -> bytes:
    data = reader.read(size)
    if len(data) != size:
        raise EOFError("history connection closed")
    return data


def _recv(reader: BinaryIO) -> bytes:
    (size,) = _LENGTH.unpack(_recv_exact(reader, _LENGTH.size))
    return _recv_exact(reader, size)


class HistoryServer:
    """Serves one bounded history (``store.remember``) to the workers; runs in the supervisor."""

    def __init__(self, store: Any) -> None:
        self.store = store
        self._lock = threading.Lock()
        self._dir = runtime_dir.create("history")  # mode 0700, removed at the next start if we die
        self.path = str(self._dir / "history.sock")
        owner = self

        class Handler(socketserver.BaseRequestHandler):
            def handle(self) -> None:
                sock: socket.socket = self.request
                reader = _reader(sock)
                while True:
                    try:
                        tenant, lookup, remember, explicit, body_size, also = orjson.loads(_recv(reader))
                        body = _recv(reader)
                        keys = ConversationKeys(tuple(lookup), remember, explicit, also=tuple(also))
                    except (EOFError, OSError, orjson.JSONDecodeError, ValueError, TypeError):
                        return
                    with owner._lock:
                        previous = owner.store.remember(tenant, keys, body, body_size)
                    _send(sock, previous or b"")

        self._server = socketserver.ThreadingUnixStreamServer(self.path, Handler)
        self._server.daemon_threads = True
        os.chmod(self.path, 0o600)
        self._thread = threading.Thread(target=self._server.serve_forever, name="prefixgate-history", daemon=True)

    def start(self) -> HistoryServer:
        self._thread.start()
        return self

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        runtime_dir.remove(self._dir)


def _decoded(reply: asyncio.Future[bytes]) -> Mapping[str, Any] | None:
    """The previous turn from a finished exchange; None if there was none or it failed (logged)."""
    exc = reply.exception()
    if exc is not None:
        log.warning("shared conversation history unreachable (%s); checking this request alone", exc)
        return None
    previous = reply.result()
    if not previous:
        return None
    loaded: Mapping[str, Any] = orjson.loads(previous)
    return loaded


class _Exchanges(asyncio.Protocol):
    """One connection to the server: requests go out in order and their replies come back
    in the same order (the server answers one connection's frames one after another), so
    each reply resolves the oldest waiting future."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.closed = False
        self._waiting: collections.deque[asyncio.Future[bytes]] = collections.deque()
        self._buffer = bytearray()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)

    def exchange(self, *frames: bytes) -> asyncio.Future[bytes]:
        assert self.transport is not None
        future: asyncio.Future[bytes] = asyncio.get_running_loop().create_future()
        self._waiting.append(future)
        self.transport.write(b"".join(_LENGTH.pack(len(frame)) + frame for frame in frames))
        return future

    def data_received(self, data: bytes) -> None:
        self._buffer += data
        while len(self._buffer) >= _LENGTH.size:
            (size,) = _LENGTH.unpack_from(self._buffer)
            if len(self._buffer) < _LENGTH.size + size:
                return
            reply = bytes(self._buffer[_LENGTH.size : _LENGTH.size + size])
            del self._buffer[: _LENGTH.size + size]
            if not self._waiting:  # a reply nobody asked for: the stream is out of step
                assert self.transport is not None
                self.transport.close()
                return
            future = self._waiting.popleft()
            if not future.done():  # its request stopped waiting (budget, client gone): dropped
                future.set_result(reply)

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        while self._waiting:
            future = self._waiting.popleft()
            if not future.done():
                future.set_exception(ConnectionError("history connection closed"))

    def close(self) -> None:
        if self.transport is not None and not self.closed:
            self.transport.close()


class HistoryClient:
    """The worker's side: ``exchange`` over one pipelined connection per event loop.

    The exchange never blocks the event loop: the request is written to the socket
    and the loop goes on with other work (the upstream call of the same request,
    other requests) until the reply arrives.
    """

    def __init__(self, path: str, max_body_bytes: int = 512 * 1024) -> None:
        self.path = path
        self.max_body_bytes = max_body_bytes  # larger bodies are not remembered: not even sent
        self._connection: _Exchanges | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._connecting: asyncio.Future[_Exchanges] | None = None

    def start(
        self, tenant: str, keys: ConversationKeys, body: Mapping[str, Any], body_size: int
    ) -> asyncio.Future[Mapping[str, Any] | None]:
        """Remember ``body`` as the conversation's latest turn; the future gives the previous
        one, or None (also when the server cannot be reached: logged, the request is checked
        alone). Once connected, the request is written before this returns."""
        frames = (orjson.dumps([tenant, keys.lookup, keys.remember, keys.explicit, body_size, keys.also]),
                  orjson.dumps(body) if body_size <= self.max_body_bytes else b"")
        loop = asyncio.get_running_loop()
        connection = self._connection
        if connection is None or connection.closed or self._loop is not loop:
            return asyncio.ensure_future(self._connect_and_exchange(frames))
        written = connection.exchange(*frames)
        previous: asyncio.Future[Mapping[str, Any] | None] = loop.create_future()

        def settle(reply: asyncio.Future[bytes]) -> None:
            if not previous.done():
                previous.set_result(None if reply.cancelled() else _decoded(reply))

        written.add_done_callback(settle)
        previous.add_done_callback(lambda _: written.cancel())  # given up: its reply is dropped
        return previous

    async def exchange(
        self, tenant: str, keys: ConversationKeys, body: Mapping[str, Any], body_size: int
    ) -> Mapping[str, Any] | None:
        """:meth:`start`, awaited."""
        return await self.start(tenant, keys, body, body_size)

    async def _connect_and_exchange(self, frames: tuple[bytes, bytes]) -> Mapping[str, Any] | None:
        reply: asyncio.Future[bytes] = asyncio.get_running_loop().create_future()
        try:
            reply = (await self._connected()).exchange(*frames)
            await reply
        except OSError as exc:
            if not reply.done():  # could not connect
                reply.set_exception(exc)
        return _decoded(reply)

    async def _connected(self) -> _Exchanges:
        loop = asyncio.get_running_loop()
        connection = self._connection
        if connection is not None and not connection.closed and self._loop is loop:
            return connection
        if self._connecting is None or self._loop is not loop:
            self._loop = loop
            self._connecting = asyncio.ensure_future(self._connect(loop))
        connecting = self._connecting
        try:
            # shielded: one caller leaving (its budget spent) does not cancel the others' connect
            return await asyncio.shield(connecting)
        finally:
            if connecting.done() and self._connecting is connecting:
                self._connecting = None

    async def _connect(self, loop: asyncio.AbstractEventLoop) -> _Exchanges:
        _, connection = await loop.create_unix_connection(_Exchanges, self.path)
        self._connection = connection
        return connection

    def close(self) -> None:
        if self._connection is not None:
            self._connection.close()
            self._connection = None
