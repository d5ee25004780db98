"""EngineStats: a snapshot of an engine's counters, read by the metrics endpoint."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class EngineStats:
    """A snapshot of the engine's counters (tokens for queries and hits). The ``disk_*``
    fields are the disk tier's (``--kv-offload-dir``): blocks loaded (hits), chains
    that stopped at a block not on disk (misses), bytes, files removed as unusable,
    writes dropped under back-pressure, loads and their total time, files held. The
    ``module_*`` fields are prompt modules' (:mod:`engine.core.module_assembler`):
    cached module blocks in the pool, module tokens reused (copied, not recomputed)
    and module tokens encoded, cumulative."""

    prefix_cache_requests: int
    prefix_cache_queries: int
    prefix_cache_hits: int
    evictions: int
    num_blocks: int
    num_used_blocks: int
    num_free_blocks: int
    num_running: int
    num_waiting: int
    num_finished: int
    num_aborted: int
    num_failed: int
    num_preemptions: int
    ttft_count: int
    ttft_sum_s: float
    prompt_tokens_computed: int = 0
    """Prompt tokens run through the model (prefix-cache hits and reused module tokens
    not counted; a preempted request's recomputed tokens counted again)."""
    generation_tokens: int = 0
    """Tokens sampled (a request's every generated token)."""
    spec_draft_tokens: int = 0
    """Draft tokens verified (speculative decoding, ``speculative_tokens``)."""
    spec_accepted_tokens: int = 0
    """Of those, the ones equal to the token sampled (each saved a forward)."""
    encoder_cache_hits: int = 0
    encoder_cache_misses: int = 0
    encoder_cache_entries: int = 0
    encoder_cache_bytes: int = 0
    disk_hits: int = 0
    disk_misses: int = 0
    disk_bytes_read: int = 0
    disk_bytes_written: int = 0
    disk_corrupt: int = 0
    disk_dropped: int = 0
    disk_load_count: int = 0
    disk_load_seconds: float = 0.0
    disk_blocks: int = 0
    disk_bytes: int = 0
    module_blocks: int = 0
    module_tokens_reused: int = 0
    module_tokens_encoded: int = 0
    kv_compressed: int = 0
    """Requests whose KV was compressed after prefill (a preempted one counts again)."""
    kv_compressed_tokens: int = 0
    """Tokens those requests had when compressed (summed over compressions)."""
    kv_retained_tokens: float = 0.0
    """Tokens they kept, averaged over layers (summed over compressions)."""
    kv_reselections: int = 0
    """Selections again of compressed requests' KV (while decoding, or after a progressive chunk)."""
    kv_reselect_freed_blocks: int = 0
    """Blocks those selections gave back to the pool."""
