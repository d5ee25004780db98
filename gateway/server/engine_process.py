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
SIGKILL after a grace period).

Supervision, both ways: the child runs in its own session (a terminal's Ctrl-C
reaches only ``serve``, which stops it) and gets SIGKILL from the kernel when
``serve`` dies, ``kill -9`` included (``parent_death.py``), so no engine keeps its
port after ``serve``: SIGKILL, not SIGTERM, because it also ends an engine that is
stopped (SIGSTOP) or wedged, and an engine whose only client is gone has nothing
to finish. :meth:`supervise` restarts a child that exits for any reason
(status 0 too) while ``serve`` runs, on the same port with the same key, after a
back-off of 1, 2, 4 ... up to 30 s; a child that ran healthy for ``STABLE_S``
resets the back-off. After ``MAX_RESTARTS`` failed restarts in a row it gives up
and calls ``on_give_up``, which makes ``serve`` exit non-zero: ``serve`` never
keeps answering 503s in front of nothing.
"""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence

import httpx

from engine.contract.api_key import API_KEY_ENV
from gateway.server.parent_death import preexec

log = logging.getLogger("prefixgate.serve")

MAX_RESTARTS = 5
STABLE_S = 60.0
MAX_BACKOFF_S = 30.0


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
        self.restarts = 0
        self._lock = threading.Lock()  # start() and stop() never interleave
        self._stopped = threading.Event()

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self) -> None:
        """Start the child (nothing after :meth:`stop`). Call it from a thread that lives as long
        as the child should: the parent-death signal fires when the starting thread exits."""
        with self._lock:
            if self.stopping:
                return
            # The child shares our stdout/stderr so its loading progress is visible.
            self.process = subprocess.Popen(
                self.command, env={**os.environ, API_KEY_ENV: self.api_key},
                start_new_session=True, preexec_fn=preexec(signal.SIGKILL),
            )

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

    def supervise(self, on_give_up: Callable[[str], None], healthy_timeout_s: float,
                  backoff_s: float = 1.0) -> threading.Thread:
        """Restart the (started) child whenever it exits before :meth:`stop`, from a thread that
        lives until then (so restarted children keep their parent-death signal);
        ``on_give_up(reason)`` after ``MAX_RESTARTS`` failed restarts in a row."""
        assert self.process is not None, "start() first"
        thread = threading.Thread(target=self._supervise, args=(on_give_up, healthy_timeout_s, backoff_s),
                                  name=f"prefixgate-engine-{self.port}", daemon=True)
        thread.start()
        return thread

    def _supervise(self, on_give_up: Callable[[str], None], healthy_timeout_s: float, backoff_s: float) -> None:
        failures = 0
        up_since = time.monotonic()  # when the current child was last known healthy
        while True:
            process = self.process
            assert process is not None
            status = process.wait()
            if self.stopping:
                return
            if time.monotonic() - up_since >= STABLE_S:
                failures = 0
            failures += 1
            if failures > MAX_RESTARTS:
                on_give_up(f"the engine on port {self.port} exited with status {status} "
                           f"{MAX_RESTARTS + 1} times in a row")
                return
            delay = min(MAX_BACKOFF_S, backoff_s * 2 ** (failures - 1))
            log.error("the engine on port %d exited with status %s while serving; restarting it in %.1f s "
                      "(attempt %d of %d)", self.port, status, delay, failures, MAX_RESTARTS)
            if self._stopped.wait(delay):
                return
            self.restarts += 1
            self.start()
            try:
                self.wait_healthy(healthy_timeout_s)
            except EngineStartError as exc:
                if self.stopping:
                    return
                log.error("the restarted engine on port %d failed: %s", self.port, exc)
                if self.process is not None and self.process.poll() is None:
                    self.process.kill()
                continue
            log.warning("the engine on port %d is healthy again (restart %d)", self.port, self.restarts)
            up_since = time.monotonic()

    def stop(self, grace_s: float = 30.0) -> int | None:
        with self._lock:
            self.stopping = True
            self._stopped.set()
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
