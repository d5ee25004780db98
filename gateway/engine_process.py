"""The bundled engine as a child process of ``prefixgate serve``.

Invariants: the engine is never open. Each :class:`EngineProcess` draws a random
per-run API key (256 bits) and hands it to the child in its environment
(``PREFIXGATE_ENGINE_API_KEY``, never on the command line, which every local user
can read in ``/proc``); the engine then refuses every route but ``/health``
without it, and the gateway sends it as its upstream key. The key lives only in
the two processes' memory: a new one each run, nothing written to disk.
:meth:`EngineProcess.wait_healthy` returns only once ``GET /health`` answered 200
and the key was accepted on ``GET /v1/models``, and raises as soon as the child exits or the deadline passes
(never waits forever); :meth:`stop` always leaves no child behind (SIGTERM, then
SIGKILL after a grace period); :meth:`watch` reports a child that dies while the
gateway runs, so ``serve`` does not keep answering 503s in front of nothing.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence

import httpx

from engine.server.api_key import API_KEY_ENV


class EngineStartError(RuntimeError):
    pass


class EngineProcess:
    def __init__(self, port: int, extra_args: Sequence[str] = (), host: str = "127.0.0.1",
                 api_key: str | None = None) -> None:
        """``api_key``: the key to hand the engine (replicas of one run share one); None draws one."""
        if any(arg.split("=", 1)[0] == "--api-key" for arg in extra_args):
            raise ValueError("the engine's API key is drawn per run by 'serve': drop --api-key from --engine-arg")
        self.host = host
        self.port = port
        self.command = [sys.executable, "-m", "gateway.cli", "engine", "--host", host, "--port", str(port), *extra_args]
        self.api_key = api_key or secrets.token_urlsafe(32)
        self.process: subprocess.Popen[bytes] | None = None
        self.stopping = False

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self) -> None:
        # The child shares our stdout/stderr so its loading progress is visible.
        self.process = subprocess.Popen(self.command, env={**os.environ, API_KEY_ENV: self.api_key})

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
                        self._check_key(client)
                        return
                except httpx.HTTPError:
                    pass
                if time.monotonic() > deadline:
                    raise EngineStartError(f"the engine was not healthy after {timeout_s:.0f} s")
                # Waiting on the child doubles as the poll interval and returns early if it exits.
                with contextlib.suppress(subprocess.TimeoutExpired):
                    self.process.wait(poll_s)

    def _check_key(self, client: httpx.Client) -> None:
        status = client.get(self.url + "/v1/models", headers={"authorization": f"Bearer {self.api_key}"}).status_code
        if status != 200:
            raise EngineStartError(f"the engine at {self.url} answered {status} to this run's API key")

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
