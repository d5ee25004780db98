"""Servers the benchmarks measure over HTTP: prefixgate's engine and llama.cpp's server.

:func:`engine_server` starts ``prefixgate engine`` (this checkout's .venv);
:func:`llama_server` starts llama.cpp's server on the same bundled GGUF through
``../shared/anchors/llama-server.sh`` (which builds it once). Both are context
managers that wait for ``GET /health`` (bounded) and stop the process group on exit.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
LLAMA_SCRIPT = ROOT.parent / "shared" / "anchors" / "llama-server.sh"
READY_TIMEOUT_S = 600.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_healthy(url: str, process: subprocess.Popen[bytes], timeout: float = READY_TIMEOUT_S) -> None:
    """Poll ``url/health`` until it answers 200; ``RuntimeError`` if ``process`` exits or time runs out."""
    deadline = time.monotonic() + timeout
    with httpx.Client(timeout=5) as client:  # one client: each new one costs ~20 ms of CPU (its TLS context)
        while True:
            if process.poll() is not None:
                raise RuntimeError(f"{url}: {process.args!r} exited with {process.returncode} during start-up")
            with contextlib.suppress(httpx.HTTPError):
                if client.get(url + "/health").status_code == 200:
                    return
            if time.monotonic() > deadline:
                raise RuntimeError(f"{url} not healthy after {timeout:.0f} s")
            time.sleep(0.2)


@contextlib.contextmanager
def _running(argv: list[str], port: int, log: Path) -> Iterator[str]:
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "wb") as out:
        proc = subprocess.Popen(argv, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    try:
        try:
            wait_healthy(base, proc)
        except RuntimeError as exc:
            raise RuntimeError(f"{exc}; see {log}") from None
        yield base
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def engine_server(*flags: str, log: Path) -> contextlib.AbstractContextManager[str]:
    """``prefixgate engine`` with ``flags`` on a free loopback port; yields its base URL."""
    port = free_port()
    argv = [sys.executable, "-m", "gateway.cli", "engine", "--port", str(port), "--log-level", "warning", *flags]
    return _running(argv, port, log)


def llama_server(*flags: str, log: Path) -> contextlib.AbstractContextManager[str]:
    """llama.cpp's server on the bundled GGUF (2 threads) with ``flags``; yields its base URL."""
    if not LLAMA_SCRIPT.is_file():
        raise RuntimeError(f"{LLAMA_SCRIPT} not found")
    port = free_port()
    return _running(["bash", str(LLAMA_SCRIPT), str(port), *flags], port, log)
