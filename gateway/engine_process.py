"""The bundled engine as a child process of ``prefixgate serve``.

Invariants: :meth:`EngineProcess.wait_healthy` returns only once ``GET /health``
answered 200, and raises as soon as the child exits or the deadline passes
(never waits forever); :meth:`stop` always leaves no child behind (SIGTERM, then
SIGKILL after a grace period); :meth:`watch` reports a child that dies while the
gateway runs, so ``serve`` does not keep answering 503s in front of nothing.
"""

from __future__ import annotations

import contextlib
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence

import httpx


class EngineStartError(RuntimeError):
    pass


class EngineProcess:
    def __init__(self, port: int, extra_args: Sequence[str] = (), host: str = "127.0.0.1") -> None:
        self.host = host
        self.port = port
        self.command = [sys.executable, "-m", "gateway.cli", "engine", "--host", host, "--port", str(port), *extra_args]
        self.process: subprocess.Popen[bytes] | None = None
        self.stopping = False

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self) -> None:
        # The child shares our stdout/stderr so its loading progress is visible.
        self.process = subprocess.Popen(self.command)

    def wait_healthy(self, timeout_s: float, poll_s: float = 0.25) -> None:
        assert self.process is not None, "start() first"
        deadline = time.monotonic() + timeout_s
        with httpx.Client(timeout=2.0) as client:
            while True:
                code = self.process.poll()
                if code is not None:
                    raise EngineStartError(f"the engine exited with status {code} before it was healthy")
                try:
                    if client.get(self.url + "/health").status_code == 200:
                        return
                except httpx.HTTPError:
                    pass
                if time.monotonic() > deadline:
                    raise EngineStartError(f"the engine was not healthy after {timeout_s:.0f} s")
                # Waiting on the child doubles as the poll interval and returns early if it exits.
                with contextlib.suppress(subprocess.TimeoutExpired):
                    self.process.wait(poll_s)

    def watch(self, on_exit: Callable[[int], None]) -> None:
        """Call ``on_exit(status)`` from a daemon thread if the child exits before :meth:`stop`."""
        process = self.process
        assert process is not None, "start() first"

        def wait() -> None:
            status = process.wait()
            if not self.stopping:
                on_exit(status)

        threading.Thread(target=wait, name="prefixgate-engine-watch", daemon=True).start()

    def stop(self, grace_s: float = 30.0) -> int | None:
        self.stopping = True
        process = self.process
        if process is None:
            return None
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(grace_s)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        return process.returncode
