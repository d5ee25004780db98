"""engine.server.metrics: Prometheus text read from a real KVCacheManager, one registry per app."""

from types import SimpleNamespace

from prometheus_client.parser import text_string_to_metric_families

from engine import KVCacheManager, Request
from engine.server.metrics import EngineMetrics


def samples(text: str) -> dict[str, float]:
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            key = s.name + "".join(f",{k}={v}" for k, v in sorted(s.labels.items()) if k != "model_name")
            out[key] = s.value
    return out


def holder(kv, running=0, waiting=0):
    """An object with LLMEngine.stats() read from a real KVCacheManager."""

    def stats():
        cache, free = kv.stats, kv.num_free_blocks
        return SimpleNamespace(
            prefix_cache_queries=cache.queries, prefix_cache_hits=cache.hits, evictions=cache.evictions,
            num_blocks=kv.num_blocks, num_used_blocks=kv.num_blocks - free, num_free_blocks=free,
            num_running=running, num_waiting=waiting,
        )

    return SimpleNamespace(stats=stats)


def test_prefix_cache_and_block_figures_follow_the_manager():
    kv = KVCacheManager(num_blocks=10, block_size=4)
    metrics = EngineMetrics(holder(kv, running=1, waiting=2), "m")
    first = Request("a", list(range(12)), block_size=4)
    blocks, computed = kv.get_computed_blocks(first)
    kv.allocate_slots(first, 12 - computed, computed, blocks)
    kv.free(first)
    second = Request("b", list(range(12)), block_size=4)
    blocks, computed = kv.get_computed_blocks(second)
    assert computed == 8
    kv.allocate_slots(second, 12 - computed, computed, blocks)

    got = samples(metrics.render().decode())
    stats = kv.stats
    assert got["prefixgate_engine_prefix_cache_queries_tokens_total"] == stats.queries > 0
    assert got["prefixgate_engine_prefix_cache_hits_tokens_total"] == stats.hits == 8
    assert got["prefixgate_engine_prefix_cache_evictions_total"] == stats.evictions
    assert got["prefixgate_engine_kv_blocks_used"] == 3
    assert got["prefixgate_engine_kv_blocks_free"] == 7
    assert got["prefixgate_engine_kv_blocks_total"] == 10
    assert got["prefixgate_engine_requests_running"] == 1
    assert got["prefixgate_engine_requests_waiting"] == 2


def test_ttft_histogram_and_request_counter():
    metrics = EngineMetrics(holder(KVCacheManager(4, 4)), "m")
    metrics.observe_ttft(0.02)
    metrics.observe_ttft(3.0)
    metrics.count_request("chat", "stop")
    got = samples(metrics.render().decode())
    assert got["prefixgate_engine_time_to_first_token_seconds_count"] == 2
    assert got["prefixgate_engine_time_to_first_token_seconds_bucket,le=0.025"] == 1
    assert got["prefixgate_engine_time_to_first_token_seconds_bucket,le=5.0"] == 2
    assert got["prefixgate_engine_requests_total,endpoint=chat,outcome=stop"] == 1


def test_two_apps_in_one_process_have_separate_registries():
    a = EngineMetrics(holder(KVCacheManager(4, 4)), "a")
    b = EngineMetrics(holder(KVCacheManager(8, 4)), "b")
    a.observe_ttft(0.1)
    assert samples(a.render().decode())["prefixgate_engine_time_to_first_token_seconds_count"] == 1
    assert samples(b.render().decode())["prefixgate_engine_time_to_first_token_seconds_count"] == 0
    assert samples(b.render().decode())["prefixgate_engine_kv_blocks_total"] == 8


def test_vllm_names_alongside_our_own():
    """vLLM v1's series for the prefix cache and KV usage, from the same figures."""
    kv = KVCacheManager(num_blocks=10, block_size=4)
    metrics = EngineMetrics(holder(kv, running=1, waiting=0), "m")
    first = Request("a", list(range(12)), block_size=4)
    blocks, computed = kv.get_computed_blocks(first)
    kv.allocate_slots(first, 12 - computed, computed, blocks)
    kv.free(first)
    second = Request("b", list(range(12)), block_size=4)
    blocks, computed = kv.get_computed_blocks(second)
    kv.allocate_slots(second, 12 - computed, computed, blocks)

    text = metrics.render().decode()
    got = samples(text)
    assert got["vllm:prefix_cache_queries_total,engine=0"] == got["prefixgate_engine_prefix_cache_queries_tokens_total"]
    assert got["vllm:prefix_cache_hits_total,engine=0"] == kv.stats.hits == 8
    assert got["vllm:kv_cache_usage_perc,engine=0"] == 0.3  # 3 of 10 blocks held by the running request
    assert got["vllm:num_requests_running,engine=0"] == 1
    assert got["vllm:num_requests_waiting,engine=0"] == 0
    assert 'vllm:prefix_cache_hits_total{engine="0",model_name="m"} 8.0' in text
    assert 'vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.3' in text


def test_computed_and_generated_token_counters_render_the_engines_figures():
    kv = KVCacheManager(4, 4)

    def stats():
        return SimpleNamespace(**vars(holder(kv).stats()), prompt_tokens_computed=1234, generation_tokens=56,
                               spec_draft_tokens=40, spec_accepted_tokens=31)

    got = samples(EngineMetrics(SimpleNamespace(stats=stats), "m").render().decode())
    assert got["prefixgate_engine_prompt_tokens_computed_total"] == 1234
    assert got["prefixgate_engine_generation_tokens_total"] == 56
    assert got["prefixgate_engine_spec_decode_draft_tokens_total"] == 40
    assert got["prefixgate_engine_spec_decode_accepted_tokens_total"] == 31
