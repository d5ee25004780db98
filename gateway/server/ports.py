"""Checking that a listen address is free before anything is started.

``prefixgate gateway`` and ``prefixgate serve`` call :func:`ensure_free` for every
port they will listen on, so a port in use is one clear line and exit 2 instead
of an engine that starts, is reported healthy (another process answered) and
dies, or uvicorn's own message and exit 3. The probe binds the way uvicorn does
(``SO_REUSEADDR``), so a port held only by connections in TIME_WAIT counts as free.
"""

from __future__ import annotations

import errno
import socket


def ensure_free(host: str, port: int, what: str) -> None:
    """Return if ``host:port`` can be bound now; ``ValueError`` naming ``what`` otherwise."""
    if not 0 < port < 65536:
        raise ValueError(f"{what} port must be between 1 and 65535, got {port}")
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        raise ValueError(f"cannot listen on {host!r}: {exc.strerror}") from None
    family, kind, proto, _, address = infos[0]
    with socket.socket(family, kind, proto) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(address)
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                raise ValueError(
                    f"{what} port {port} on {host} is already in use (stop the other process or pick another port)"
                ) from None
            raise ValueError(f"cannot listen on {host}:{port} for the {what}: {exc.strerror}") from None
