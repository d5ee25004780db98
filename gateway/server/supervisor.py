"""Several gateway worker processes on one port (``prefixgate gateway --workers N``).

Why processes: the proxy's per-request work (parsing, canonicalization, the
linter's checks) is Python and holds the GIL, so one process uses one core.

The supervisor binds the port (so a port in use fails at once) and starts N
workers with the ``spawn`` method (nothing inherited by fork). Each worker listens
on its own socket bound to that port with ``SO_REUSEPORT``, and the kernel spreads
new connections over them by a hash of the client's address and port. (One socket
shared by all workers was spread by whoever woke first: an event loop accepts
every pending connection at once, so wrk's 128 connections, opened together, went
128 / 0 or 78 / 50 and one worker did most of the work.) The supervisor's own
socket is bound but never listens, so it holds the port and gets no connection.
Without ``SO_REUSEPORT`` (not Linux/BSD) the workers share the supervisor's
listening socket as before. A worker that exits drops the connections still
waiting in its accept queue (the clients see a reset). State that must be one for
the whole gateway is designed for it:

- stats rows: each worker's ``StatsWriter`` inserts its own batches into the same
  SQLite file (WAL mode and a busy timeout serialize the short transactions:
  ``database.py``);
- metrics: ``PROMETHEUS_MULTIPROC_DIR``, a fresh directory per run, summed over all
  workers at scrape time (``metrics.py``);
- conversation history for prefix warnings: held by the supervisor and served on
  a Unix socket (``shared_history.py``).

The upstream connection pool is per worker, and ``/v1/cache/stats`` flushes only
its own worker's writer (other workers' rows are at most one flush interval late).

Signals: workers run in their own process group, so a terminal's Ctrl-C reaches
only the supervisor; SIGINT or SIGTERM to the supervisor becomes one SIGTERM to
each worker, which shuts down gracefully (draining its stats rows), and the
supervisor returns when all have exited. If the supervisor itself is killed, the
kernel sends each worker SIGTERM (``PR_SET_PDEATHSIG``) so they drain too. A worker
that dies is restarted, unless it died within its first seconds (a start-up
failure: the supervisor stops and reports it).
"""

from __future__ import annotations

import dataclasses
import logging
import multiprocessing
import os
import signal
import socket
import threading
import time
from typing import Any

from gateway.config import runtime_dir
from gateway.server.parent_death import die_with
from gateway.server.settings import GatewaySettings
from gateway.stats.metrics import MULTIPROC_ENV, MetricsListener, render_workers

log = logging.getLogger("prefixgate.gateway")

STARTUP_GRACE_S = 5.0


def default_workers() -> int:
    """The number of cores this process may run on."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


REUSE_PORT = hasattr(socket, "SO_REUSEPORT")


def bind(host: str, port: int, *, reuse_port: bool = False, listen: bool = True) -> socket.socket:
    """A socket bound to ``host:port`` (listening unless ``listen`` is false). Its protocol
    must be IPPROTO_TCP (not 0): asyncio sets TCP_NODELAY only on accepted sockets that
    say so, and without it Nagle's algorithm and delayed ACKs held every response ~40 ms."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    if reuse_port:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    try:
        sock.bind((host, port))
        if listen:
            sock.listen(2048)
    except OSError:
        sock.close()
        raise
    return sock


def serve_workers(settings: GatewaySettings, host: str, port: int, log_level: str, workers: int) -> int:
    """Run ``workers`` gateway processes until SIGINT/SIGTERM; 0 after a graceful stop, 1 if
    a worker failed at start-up."""
    from gateway.policy.prefix_warner import PrefixWarner
    from gateway.policy.shared_history import HistoryServer

    sock = bind(host, port, reuse_port=REUSE_PORT, listen=not REUSE_PORT)
    port = sock.getsockname()[1]
    shared = None if REUSE_PORT else sock  # else each worker binds its own socket to (host, port)
    metrics_dir = runtime_dir.create("metrics")
    os.environ[MULTIPROC_ENV] = str(metrics_dir)
    history = HistoryServer(PrefixWarner()).start()
    # One unauthenticated listener for the whole gateway, summing the workers' files.
    listener = MetricsListener(settings.metrics_port, render_workers).start() if settings.metrics_port else None
    settings = dataclasses.replace(settings, metrics_port=None)
    context = multiprocessing.get_context("spawn")
    stop = threading.Event()
    started: dict[int, float] = {}

    def start(index: int) -> Any:
        process = context.Process(
            target=_worker, args=(settings, shared, host, port, log_level, history.path, os.getpid()),
            name=f"prefixgate-worker-{index}",
        )
        process.start()
        started[index] = time.monotonic()
        return process

    previous = {sig: signal.signal(sig, lambda *_: stop.set()) for sig in (signal.SIGINT, signal.SIGTERM)}
    processes = [start(index) for index in range(workers)]
    log.info("%d workers serving on %s:%d", workers, host, port)
    status = 0
    try:
        while not stop.wait(0.5):
            for index, process in enumerate(processes):
                if process.is_alive():
                    continue
                if time.monotonic() - started[index] < STARTUP_GRACE_S:
                    log.error("worker %d exited with %s during start-up; stopping", index, process.exitcode)
                    status = 1
                    stop.set()
                    break
                log.error("worker %d (pid %d) exited with %s; starting another",
                          index, process.pid, process.exitcode)
                processes[index] = start(index)
    finally:
        for process in processes:
            if process.is_alive() and process.pid is not None:
                os.kill(process.pid, signal.SIGTERM)
        for process in processes:
            process.join(60)
            if process.is_alive():
                process.kill()
                process.join()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        history.close()
        if listener is not None:
            listener.close()
        sock.close()
        runtime_dir.remove(metrics_dir)
        os.environ.pop(MULTIPROC_ENV, None)
    return status


def _worker(
    settings: GatewaySettings, shared: socket.socket | None, host: str, port: int, log_level: str,
    history_path: str, parent: int,
) -> None:
    import uvicorn

    from gateway.policy.shared_history import HistoryClient
    from gateway.server.app import create_app
    from gateway.server.process_setup import configure_logging, settle_heap, share_the_gil

    os.setpgrp()  # a terminal's Ctrl-C goes to the supervisor, which forwards SIGTERM once
    die_with(parent)  # SIGTERM when the supervisor dies
    configure_logging(log_level)
    app = create_app(settings, history=HistoryClient(history_path))
    settle_heap()
    share_the_gil()
    config = uvicorn.Config(app, log_level=log_level, access_log=False, lifespan="on")
    sock = shared if shared is not None else bind(host, port, reuse_port=True)
    uvicorn.Server(config).run(sockets=[sock])
