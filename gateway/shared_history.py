"""Conversation history shared by the gateway's worker processes.

With ``--workers N`` the kernel spreads client connections over the workers, so
two turns of one conversation may reach different workers. The supervisor
process holds the one history (a :class:`~gateway.prefix_warner.PrefixWarner`'s
bounded LRU, bodies kept as canonical JSON bytes) and serves it on a Unix socket
in a directory only the owner can enter. Each worker's check threads keep one
connection each (:class:`HistoryClient`) and swap "this turn" for "the previous
turn" in one round trip, off the event loop.

Wire format: frames of a 4-byte big-endian length and a payload. A request is
two frames, ``[tenant, key, body_size]`` as JSON and the body's JSON; the reply
is one frame, the previous body's JSON or empty. If the supervisor cannot be
reached the worker logs it and checks the request on its own (warnings are
advisory; the request never fails because of it).
"""

from __future__ import annotations

import logging
import os
import socket
import socketserver
import struct
import tempfile
import threading
from collections.abc import Mapping
from pathlib import Path
from typing import Any, BinaryIO, cast

import orjson

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
        self._dir = tempfile.mkdtemp(prefix="prefixgate-history-")  # mode 0700
        self.path = str(Path(self._dir) / "history.sock")
        owner = self

        class Handler(socketserver.BaseRequestHandler):
            def handle(self) -> None:
                sock: socket.socket = self.request
                reader = _reader(sock)
                while True:
                    try:
                        tenant, lookup, remember, explicit, body_size = orjson.loads(_recv(reader))
                        body = _recv(reader)
                        keys = ConversationKeys(tuple(lookup), remember, explicit)
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
        Path(self.path).unlink(missing_ok=True)
        Path(self._dir).rmdir()


class HistoryClient:
    """``remember`` over the supervisor's socket; one connection per calling thread."""

    def __init__(self, path: str, max_body_bytes: int = 512 * 1024) -> None:
        self.path = path
        self.max_body_bytes = max_body_bytes  # larger bodies are not remembered: not even sent
        self._local = threading.local()

    def remember(
        self, tenant: str, keys: ConversationKeys, body: Mapping[str, Any], body_size: int
    ) -> Mapping[str, Any] | None:
        try:
            sock, reader = self._socket()
            payload = orjson.dumps(body) if body_size <= self.max_body_bytes else b""
            _send(sock, orjson.dumps([tenant, keys.lookup, keys.remember, keys.explicit, body_size]), payload)
            previous = _recv(reader)
        except (OSError, EOFError, TypeError) as exc:
            log.warning("shared conversation history unreachable (%s); checking this request alone", exc)
            self._drop()
            return None
        if not previous:
            return None
        loaded: Mapping[str, Any] = orjson.loads(previous)
        return loaded

    def _socket(self) -> tuple[socket.socket, BinaryIO]:
        sock: socket.socket | None = getattr(self._local, "sock", None)
        if sock is None:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.settimeout(10.0)
            sock.connect(self.path)
            self._local.sock, self._local.reader = sock, _reader(sock)
        return sock, self._local.reader

    def _drop(self) -> None:
        sock = getattr(self._local, "sock", None)
        self._local.sock = None
        if sock is not None:
            self._local.reader.close()
            sock.close()
