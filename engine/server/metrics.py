"""EngineMetrics: the engine server's Prometheus metrics, in a registry of its own.

Each app gets its own ``CollectorRegistry`` (never the process-global one), so
several servers in one process (tests) do not clash. Prefix-cache and block
figures are read from the engine at scrape time, so they can never drift from the
KV cache manager's own counters; the server observes the TTFT histogram and counts
requests itself.

Exposed series (all labelled ``model_name``):

* ``prefixgate_engine_prefix_cache_queries_tokens_total`` / ``..._hits_tokens_total``:
  prompt tokens looked up in the prefix cache and tokens found there;
* ``prefixgate_engine_prefix_cache_evictions_total``: cached blocks reused for new data;
* ``prefixgate_engine_kv_blocks_used`` / ``..._free`` / ``..._total``;
* ``prefixgate_engine_requests_running`` / ``..._waiting``;
* ``prefixgate_engine_prompt_tokens_computed_total``: prompt tokens run through the
  model (what prefix-cache hits and reused modules saved is not counted; a
  preempted request's are counted again when recomputed), and
  ``..._generation_tokens_total``: tokens sampled. Their rates are the engine's
  prefill and decode throughput;
* ``prefixgate_engine_spec_decode_draft_tokens_total`` / ``..._accepted_tokens_total``:
  draft tokens verified (speculative decoding, ``--speculative-tokens``) and those
  kept (acceptance rate = accepted / draft; each accepted one saved a forward);
* ``prefixgate_engine_module_blocks`` (an engine whose model has rotary position
  embeddings): KV blocks holding prompt modules (issue 21),
  ``..._module_reused_tokens_total`` / ``..._module_encoded_tokens_total``: module
  tokens reused in segmented requests (copied, not recomputed) and encoded;
* ``prefixgate_engine_time_to_first_token_seconds``: histogram, request arrival to
  the first generated token;
* ``prefixgate_engine_requests_total{endpoint, outcome}``: finished HTTP requests;
* ``prefixgate_engine_kv_retained_tokens``: summary, per KV compression (count) the
  tokens kept averaged over layers (sum), and ``..._kv_compressed_tokens_total``: the
  tokens those requests had (retained share = sum / compressed tokens);
  ``..._kv_reselections_total`` / ``..._kv_reselect_freed_blocks_total``: selections
  again while they decode (every ``--kv-window`` tokens) and the blocks given back;
* ``prefixgate_engine_encoder_cache_hits_total`` / ``..._misses_total``: image
  feature lookups in the encoder cache (a miss runs the vision tower), and
  ``..._entries`` / ``..._bytes``: what it holds (vision-language models only).
* with ``--kv-offload-dir``: ``prefixgate_engine_disk_cache_hits_blocks_total`` /
  ``..._misses_total`` (blocks loaded from disk; hash chains that stopped at a
  block not on disk), ``..._read_bytes_total`` / ``..._written_bytes_total``,
  ``..._corrupt_files_total`` (unusable files removed), ``..._dropped_writes_total``,
  ``..._load_seconds`` (summary: one observation per load), ``..._blocks`` /
  ``..._bytes`` (files held).

The same figures under vLLM's names (labels ``model_name`` and ``engine="0"``, as
vLLM v1 exposes them), so dashboards built for vLLM work unchanged:

* ``vllm:prefix_cache_queries_total`` / ``vllm:prefix_cache_hits_total``: tokens;
* ``vllm:kv_cache_usage_perc``: fraction of KV blocks held by requests (0 to 1; a
  compressed request counts the packed blocks it holds);
* ``vllm:num_requests_running`` / ``vllm:num_requests_waiting``.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    Metric,
    SummaryMetricFamily,
)
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from prometheus_client.registry import Collector

PREFIX = "prefixgate_engine"
VLLM_LABELS = ["model_name", "engine"]
VLLM_ENGINE_INDEX = "0"  # one engine core per server, as vLLM labels its first
TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                10.0, 20.0, 40.0, 80.0)


class _EngineCollector(Collector):
    """Reads ``engine.stats()`` (an :class:`~engine.core.llm_engine.EngineStats`) at scrape time."""

    def __init__(self, engine: Any, model_name: str) -> None:
        self.engine = engine
        self.model_name = model_name

    def collect(self) -> Iterator[Metric]:
        stats = self.engine.stats()
        labels = [self.model_name]
        yield _counter("prefix_cache_queries_tokens", "Prompt tokens looked up in the prefix cache.",
                       stats.prefix_cache_queries, labels)
        yield _counter("prefix_cache_hits_tokens", "Prompt tokens found in the prefix cache.",
                       stats.prefix_cache_hits, labels)
        yield _counter("prefix_cache_evictions", "Cached KV blocks evicted to hold new data.",
                       stats.evictions, labels)
        yield _gauge("kv_blocks_used", "KV cache blocks held by running requests.",
                     stats.num_used_blocks, labels)
        yield _gauge("kv_blocks_free", "KV cache blocks in the free queue (cached or empty).",
                     stats.num_free_blocks, labels)
        yield _gauge("kv_blocks_total", "KV cache blocks in the pool.", stats.num_blocks, labels)
        yield _gauge("requests_running", "Requests running in the engine.", stats.num_running, labels)
        yield _gauge("requests_waiting", "Requests waiting for admission.", stats.num_waiting, labels)
        yield _counter("prompt_tokens_computed", "Prompt tokens run through the model (cache hits not counted).",
                       getattr(stats, "prompt_tokens_computed", 0), labels)
        yield _counter("generation_tokens", "Tokens sampled.", getattr(stats, "generation_tokens", 0), labels)
        yield _counter("spec_decode_draft_tokens", "Draft tokens verified (speculative decoding).",
                       getattr(stats, "spec_draft_tokens", 0), labels)
        yield _counter("spec_decode_accepted_tokens", "Draft tokens kept: equal to the token sampled.",
                       getattr(stats, "spec_accepted_tokens", 0), labels)
        if getattr(self.engine, "supports_images", False):
            yield _counter("encoder_cache_hits", "Image features found in the encoder cache.",
                           stats.encoder_cache_hits, labels)
            yield _counter("encoder_cache_misses", "Image features computed by the vision tower.",
                           stats.encoder_cache_misses, labels)
            yield _gauge("encoder_cache_entries", "Images whose features the encoder cache holds.",
                         stats.encoder_cache_entries, labels)
            yield _gauge("encoder_cache_bytes", "Bytes of image features in the encoder cache.",
                         stats.encoder_cache_bytes, labels)
        if getattr(self.engine, "offload", None) is not None:
            yield from self._disk(stats, labels)
        if getattr(self.engine, "shifter", None) is not None:  # an engine that can reuse prompt modules
            yield _gauge("module_blocks", "KV blocks holding prompt modules' K/V (held or evictable).",
                         stats.module_blocks, labels)
            yield _counter("module_reused_tokens", "Prompt-module tokens reused (copied, not recomputed).",
                           stats.module_tokens_reused, labels)
            yield _counter("module_encoded_tokens", "Prompt-module tokens encoded into module blocks.",
                           stats.module_tokens_encoded, labels)
        retained = SummaryMetricFamily(
            f"{PREFIX}_kv_retained_tokens", "Tokens a compressed request keeps after prefill, averaged "
            "over layers (one observation per compression).", labels=["model_name"])
        retained.add_metric(labels, getattr(stats, "kv_compressed", 0), getattr(stats, "kv_retained_tokens", 0.0))
        yield retained
        yield _counter("kv_compressed_tokens", "Tokens compressed requests had when compressed.",
                       getattr(stats, "kv_compressed_tokens", 0), labels)
        yield _counter("kv_reselections", "Selections again of compressed requests' KV as they grow.",
                       getattr(stats, "kv_reselections", 0), labels)
        yield _counter("kv_reselect_freed_blocks", "KV blocks those selections gave back to the pool.",
                       getattr(stats, "kv_reselect_freed_blocks", 0), labels)
        yield from self._vllm_named(stats)

    def _disk(self, stats: Any, labels: list[str]) -> Iterator[Metric]:
        name = "disk_cache"
        yield _counter(f"{name}_hits_blocks", "KV blocks loaded from the disk tier.", stats.disk_hits, labels)
        yield _counter(f"{name}_misses", "Prefix lookups whose hash chain stopped at a block not on disk.",
                       stats.disk_misses, labels)
        yield _counter(f"{name}_read_bytes", "Bytes read from the disk tier.", stats.disk_bytes_read, labels)
        yield _counter(f"{name}_written_bytes", "Bytes written to the disk tier.", stats.disk_bytes_written, labels)
        yield _counter(f"{name}_corrupt_files", "Corrupt, truncated or foreign block files removed.",
                       stats.disk_corrupt, labels)
        yield _counter(f"{name}_dropped_writes", "Blocks not written because the write queue was full.",
                       stats.disk_dropped, labels)
        load = SummaryMetricFamily(f"{PREFIX}_{name}_load_seconds", "Time to load blocks from the disk tier.",
                                   labels=["model_name"])
        load.add_metric(labels, stats.disk_load_count, stats.disk_load_seconds)
        yield load
        yield _gauge(f"{name}_blocks", "Block files in the disk tier.", stats.disk_blocks, labels)
        yield _gauge(f"{name}_bytes", "Bytes of block files in the disk tier.", stats.disk_bytes, labels)

    def _vllm_named(self, stats: Any) -> Iterator[Metric]:
        labels = [self.model_name, VLLM_ENGINE_INDEX]
        usage = stats.num_used_blocks / stats.num_blocks if stats.num_blocks else 0.0
        for name, doc, value, family_type in (
            ("prefix_cache_queries", "Prefix cache queries, in tokens.", stats.prefix_cache_queries, CounterMetricFamily),
            ("prefix_cache_hits", "Prefix cache hits, in tokens.", stats.prefix_cache_hits, CounterMetricFamily),
            ("kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", usage, GaugeMetricFamily),
            ("num_requests_running", "Number of requests in model execution batches.", stats.num_running,
             GaugeMetricFamily),
            ("num_requests_waiting", "Number of requests waiting to be processed.", stats.num_waiting,
             GaugeMetricFamily),
        ):
            family = family_type(f"vllm:{name}", doc, labels=VLLM_LABELS)
            family.add_metric(labels, value)
            yield family


def _counter(name: str, doc: str, value: float, labels: list[str]) -> CounterMetricFamily:
    family = CounterMetricFamily(f"{PREFIX}_{name}", doc, labels=["model_name"])
    family.add_metric(labels, value)
    return family


def _gauge(name: str, doc: str, value: float, labels: list[str]) -> GaugeMetricFamily:
    family = GaugeMetricFamily(f"{PREFIX}_{name}", doc, labels=["model_name"])
    family.add_metric(labels, value)
    return family


class EngineMetrics:
    """The metrics of one server app; :meth:`render` is the body of ``GET /metrics``."""

    content_type = CONTENT_TYPE_LATEST

    def __init__(self, engine: Any, model_name: str) -> None:
        self.model_name = model_name
        self.registry = CollectorRegistry(auto_describe=True)
        self.registry.register(_EngineCollector(engine, model_name))
        self._ttft = Histogram(
            f"{PREFIX}_time_to_first_token_seconds",
            "Seconds from request arrival to the first generated token.",
            labelnames=["model_name"], buckets=TTFT_BUCKETS, registry=self.registry,
        )
        self._ttft_child = self._ttft.labels(model_name)  # exported as 0 before any observation
        self._requests = Counter(
            f"{PREFIX}_requests", "Finished HTTP generation requests.",
            labelnames=["model_name", "endpoint", "outcome"], registry=self.registry,
        )

    def observe_ttft(self, seconds: float) -> None:
        self._ttft_child.observe(seconds)

    def count_request(self, endpoint: str, outcome: str) -> None:
        """``outcome``: a finish reason ("stop", "length"), "abort", "error" or "client_error"."""
        self._requests.labels(self.model_name, endpoint, outcome).inc()

    def render(self) -> bytes:
        return bytes(generate_latest(self.registry))
