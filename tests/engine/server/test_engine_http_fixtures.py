"""Helpers (no tests): run the engine's app under uvicorn on a loopback port in a thread.

The socket is bound here (port 0, so the OS picks a free port) and handed to
uvicorn, so there is no race for the port; readiness is a bounded poll of
``GET /health``, never a sleep.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import httpx
import uvicorn

from engine.server.app import create_app

READY_TIMEOUT_S = 60.0


@dataclass
class LiveServer:
    base_url: str
    server: uvicorn.Server
    thread: threading.Thread

    @property
    def api_url(self) -> str:
        return self.base_url + "/v1"


def wait_until(condition: Callable[[], bool], timeout_s: float, what: str, interval_s: float = 0.02) -> None:
    """Poll ``condition`` until it holds; fail after ``timeout_s`` saying what was awaited."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s}s waiting for {what}")
        time.sleep(interval_s)


@contextmanager
def serve(engine, **app_kwargs) -> Iterator[LiveServer]:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    app = create_app(engine, **app_kwargs)
    config = uvicorn.Config(app, log_level="warning", access_log=False, timeout_graceful_shutdown=2)
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    live = LiveServer(f"http://127.0.0.1:{port}", server, thread)

    def healthy() -> bool:
        if not thread.is_alive():
            raise AssertionError("the server thread died before becoming healthy")
        try:
            return httpx.get(live.base_url + "/health", timeout=5).status_code == 200
        except httpx.TransportError:
            return False

    try:
        wait_until(healthy, READY_TIMEOUT_S, "GET /health to answer 200")
        yield live
    finally:
        server.should_exit = True
        thread.join(timeout=30)
        sock.close()
