"""Prometheus metrics of one gateway app (its own registry, so several apps can
live in one process).

With several worker processes (``--workers``), the supervisor sets
``PROMETHEUS_MULTIPROC_DIR`` before it starts them: prometheus_client then keeps
every value in a memory-mapped file per process, and ``render`` (whichever worker
answers the scrape) sums the files of all workers, including those that exited.
Collectors of live state (``add_collector``, e.g. the replicas' health) are read
from the worker that answers.

Access: the totals move with every tenant's traffic (another tenant's cache hit
shows as +N cached tokens), so the gateway's ``/metrics`` needs an admin key (401
without one). For a Prometheus scraper without keys, ``--metrics-port PORT`` adds a
:class:`MetricsListener` on ``127.0.0.1:PORT`` (loopback only, never the public
address) that answers ``GET /metrics`` alone, unauthenticated. With several workers
the supervisor runs it and sums the workers' files (the replicas' live gauges are
then absent: they live in the workers).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest, multiprocess

from gateway.request_record import RequestRecord

MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"
CONTENT_TYPE = "text/plain; version=0.0.4"
METRICS_HOST = "127.0.0.1"

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)


class GatewayMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self._live: list[Any] = []
        # Child metrics by label values: ``labels()`` costs more than the increment itself.
        self._request_children: dict[tuple[str, int], Any] = {}
        self._warning_children: dict[str, Any] = {}
        self._step_children: dict[str, Any] = {}
        self.requests = Counter(
            "prefixgate_requests", "Proxied requests by endpoint and status.",
            ["endpoint", "status"], registry=self.registry,
        )
        self.prompt_tokens = Counter(
            "prefixgate_prompt_tokens", "Prompt tokens reported by the upstream.", registry=self.registry
        )
        self.cached_tokens = Counter(
            "prefixgate_cached_tokens", "Prompt tokens served from the prefix cache.", registry=self.registry
        )
        self.unknown_cached = Counter(
            "prefixgate_unknown_cached_responses",
            "Responses whose upstream did not report cached tokens.", registry=self.registry,
        )
        self.warnings = Counter(
            "prefixgate_prefix_warnings", "Prefix warnings by rule code.", ["code"], registry=self.registry
        )
        self.canonicalized = Counter(
            "prefixgate_canonicalization_steps", "Canonicalization steps applied.", ["step"],
            registry=self.registry,
        )
        self.latency = Histogram(
            "prefixgate_request_latency_seconds", "Total request latency.",
            buckets=LATENCY_BUCKETS, registry=self.registry,
        )
        self.ttft = Histogram(
            "prefixgate_ttft_seconds", "Time to the first upstream byte or event.",
            buckets=LATENCY_BUCKETS, registry=self.registry,
        )

    def observe(self, record: RequestRecord) -> None:
        key = (record.endpoint, record.status)
        counter = self._request_children.get(key)
        if counter is None:
            counter = self._request_children[key] = self.requests.labels(record.endpoint, str(record.status))
        counter.inc()
        if record.prompt_tokens is not None:
            self.prompt_tokens.inc(record.prompt_tokens)
            if record.cached_tokens is None:
                self.unknown_cached.inc()
        if record.cached_tokens is not None:
            self.cached_tokens.inc(record.cached_tokens)
        for code in set(record.warning_codes):
            child = self._warning_children.get(code)
            if child is None:
                child = self._warning_children[code] = self.warnings.labels(code)
            child.inc()
        for step in record.canonicalization:
            child = self._step_children.get(step)
            if child is None:
                child = self._step_children[step] = self.canonicalized.labels(step)
            child.inc()
        self.latency.observe(record.latency_ms / 1000.0)
        if record.ttft_ms is not None:
            self.ttft.observe(record.ttft_ms / 1000.0)

    def add_collector(self, collector: Any) -> None:
        """A collector read at scrape time (live state of this process, e.g. replicas)."""
        self.registry.register(collector)
        self._live.append(collector)

    def render(self) -> bytes:
        directory = os.environ.get(MULTIPROC_ENV)
        if not directory:
            return generate_latest(self.registry)
        registry = CollectorRegistry()  # every worker's counters, plus this worker's live view
        multiprocess.MultiProcessCollector(registry, path=directory)
        for collector in self._live:
            registry.register(collector)
        return generate_latest(registry)


def render_workers() -> bytes:
    """Every worker's counters from ``PROMETHEUS_MULTIPROC_DIR`` (the supervisor's view)."""
    registry = CollectorRegistry()
    multiprocess.MultiProcessCollector(registry, path=os.environ[MULTIPROC_ENV])
    return generate_latest(registry)


class MetricsListener:
    """``GET /metrics`` without a key on ``127.0.0.1:port``, from a daemon thread; 404 for anything else."""

    def __init__(self, port: int, render: Callable[[], bytes]) -> None:
        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                if self.path.split("?", 1)[0] != "/metrics":
                    self.send_error(404)
                    return
                body = render()
                self.send_response(200)
                self.send_header("content-type", CONTENT_TYPE)
                self.send_header("content-length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, format: str, *args: Any) -> None:
                pass  # scrapes are not worth a log line each

        self._server = ThreadingHTTPServer((METRICS_HOST, port), Handler)
        self._server.daemon_threads = True
        self.port = int(self._server.server_address[1])
        self._thread = threading.Thread(target=self._server.serve_forever, name="prefixgate-metrics", daemon=True)

    def start(self) -> MetricsListener:
        self._thread.start()
        return self

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
