"""The engine server over real loopback HTTP with the official openai SDK (tiny random Llama).

The engine is the real LLMEngine around a tiny randomly initialised Llama and the
bundled tokenizer (the ``tiny_engine`` fixture), so outputs are gibberish but every
path (prefix reuse, streaming, cancellation, errors) is the production one.
"""

import json
import socket

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families
from support.sse import sse_events
from test_engine_http_fixtures import wait_until

LONG_TEXT = " ".join(f"Fact {i}: the sky over city {i} is blue and the river is wide." for i in range(30))


def chat(client, engine, content, **kwargs):
    kwargs.setdefault("max_tokens", 4)
    kwargs.setdefault("temperature", 0)
    return client.chat.completions.create(
        model=engine.model_id, messages=[{"role": "user", "content": content}], **kwargs
    )


def all_blocks_free(engine) -> bool:
    kv = engine.kv_cache_manager
    return kv.num_free_blocks == kv.num_blocks


def expected_hit(prompt_tokens: int, block_size: int) -> int:
    """Full blocks only, never the last prompt token."""
    return ((prompt_tokens - 1) // block_size) * block_size


def metric_values(live) -> dict[str, float]:
    values: dict[str, float] = {}
    for family in text_string_to_metric_families(httpx.get(live.base_url + "/metrics").text):
        for s in family.samples:
            key = s.name + "".join(f",{k}={v}" for k, v in sorted(s.labels.items()) if k != "model_name")
            values[key] = values.get(key, 0.0) + s.value
    return values


def aborted_requests(live) -> float:
    values = metric_values(live)
    return sum(v for k, v in values.items() if k.startswith("prefixgate_engine_requests_total") and "outcome=abort" in k)


# ------------------------------------------------------------------ basics
def test_health_and_models(live, tiny_engine, client):
    health = httpx.get(live.base_url + "/health")
    assert health.status_code == 200 and health.json()["status"] == "ok"
    models = client.models.list()
    assert [m.id for m in models.data] == [tiny_engine.model_id]
    raw = httpx.get(live.api_url + "/models").json()
    assert raw["data"][0]["max_model_len"] == tiny_engine.max_model_len


def test_chat_non_stream_has_usage_with_cached_tokens(client, tiny_engine):
    resp = chat(client, tiny_engine, "A fresh question about apples?", max_tokens=5, extra_body={"ignore_eos": True})
    assert resp.object == "chat.completion"
    assert resp.choices[0].message.role == "assistant"
    assert isinstance(resp.choices[0].message.content, str)
    assert resp.choices[0].finish_reason == "length"
    assert resp.usage.completion_tokens == 5
    assert resp.usage.prompt_tokens > 0
    assert resp.usage.prompt_tokens_details.cached_tokens == 0


def test_repeated_long_prompt_hits_the_cache_by_the_block_rule(client, tiny_engine):
    first = chat(client, tiny_engine, LONG_TEXT + " Question one?")
    second = chat(client, tiny_engine, LONG_TEXT + " Question one?")
    prompt_tokens = first.usage.prompt_tokens
    assert prompt_tokens > 3 * tiny_engine.block_size
    assert second.usage.prompt_tokens == prompt_tokens
    assert second.usage.prompt_tokens_details.cached_tokens == expected_hit(prompt_tokens, tiny_engine.block_size)
    assert second.choices[0].message.content == first.choices[0].message.content


def test_a_different_cache_salt_gets_no_cached_tokens(client, tiny_engine):
    content = LONG_TEXT + " Salted question?"
    a1 = chat(client, tiny_engine, content, extra_body={"cache_salt": "tenant-a"})
    a2 = chat(client, tiny_engine, content, extra_body={"cache_salt": "tenant-a"})
    b = chat(client, tiny_engine, content, extra_body={"cache_salt": "tenant-b"})
    unsalted = chat(client, tiny_engine, content)
    assert a1.usage.prompt_tokens_details.cached_tokens == 0
    assert a2.usage.prompt_tokens_details.cached_tokens > 0
    assert b.usage.prompt_tokens_details.cached_tokens == 0
    assert unsalted.usage.prompt_tokens_details.cached_tokens == 0


def test_stream_with_usage_matches_the_non_stream_answer(client, tiny_engine):
    content = LONG_TEXT + " Streamed question?"
    whole = chat(client, tiny_engine, content, max_tokens=6, extra_body={"ignore_eos": True})
    chunks = list(
        chat(client, tiny_engine, content, max_tokens=6, stream=True, stream_options={"include_usage": True},
             extra_body={"ignore_eos": True})
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    ids = {c.id for c in chunks}
    assert len(ids) == 1 and chunks[0].object == "chat.completion.chunk"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == ["length"]
    assert chunks[-1].choices == [] and all(c.usage is None for c in chunks[:-1])
    usage = chunks[-1].usage
    assert usage.completion_tokens == 6 and usage.prompt_tokens == whole.usage.prompt_tokens
    assert usage.prompt_tokens_details.cached_tokens == expected_hit(usage.prompt_tokens, tiny_engine.block_size)


def test_stream_without_usage_request_sends_no_usage(client, tiny_engine):
    chunks = list(chat(client, tiny_engine, "Short one", stream=True))
    assert all(c.usage is None for c in chunks)
    assert chunks[-1].choices[0].finish_reason in ("stop", "length")


def test_raw_sse_framing_ends_with_done(live, tiny_engine):
    body = {"model": tiny_engine.model_id, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3,
            "stream": True, "stream_options": {"include_usage": True}}
    with httpx.stream("POST", live.api_url + "/chat/completions", json=body, timeout=60) as resp:
        assert resp.headers["content-type"].startswith("text/event-stream")
        raw = resp.read().decode()
    events = sse_events(raw)
    assert all(e.startswith("data: ") for e in events)
    assert events[-1] == "data: [DONE]"
    usage = json.loads(events[-2][len("data: "):])["usage"]
    assert usage["prompt_tokens_details"]["cached_tokens"] >= 0


def test_completions_with_text_and_token_prompts(client, tiny_engine):
    text = client.completions.create(model=tiny_engine.model_id, prompt=LONG_TEXT, max_tokens=3, temperature=0)
    assert text.object == "text_completion" and isinstance(text.choices[0].text, str)
    ids = tiny_engine.tokenizer.encode(LONG_TEXT)
    by_ids = client.completions.create(model=tiny_engine.model_id, prompt=ids, max_tokens=3, temperature=0)
    assert by_ids.usage.prompt_tokens == len(ids)
    assert by_ids.choices[0].text == text.choices[0].text
    assert by_ids.usage.prompt_tokens_details.cached_tokens == expected_hit(len(ids), tiny_engine.block_size)
    streamed = list(client.completions.create(model=tiny_engine.model_id, prompt=ids, max_tokens=3, temperature=0,
                                              stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in streamed if c.choices) == text.choices[0].text
    assert streamed[-1].usage.completion_tokens == 3


def test_seeded_sampling_is_reproducible_over_http(client, tiny_engine):
    a = chat(client, tiny_engine, "Tell a story", max_tokens=8, temperature=1.0, top_p=0.9, seed=1234,
             extra_body={"top_k": 50, "ignore_eos": True})
    b = chat(client, tiny_engine, "Tell a story", max_tokens=8, temperature=1.0, top_p=0.9, seed=1234,
             extra_body={"top_k": 50, "ignore_eos": True})
    assert a.choices[0].message.content == b.choices[0].message.content
    assert a.usage.completion_tokens == b.usage.completion_tokens == 8


def test_stop_token_ids_and_max_completion_tokens(client, tiny_engine):
    resp = chat(client, tiny_engine, "count", max_tokens=None, max_completion_tokens=2, extra_body={"ignore_eos": True})
    assert resp.usage.completion_tokens == 2
    greedy = chat(client, tiny_engine, "stop here", max_tokens=3, extra_body={"ignore_eos": True})
    first_id = tiny_engine.tokenizer.encode(greedy.choices[0].message.content, add_special_tokens=False)[0]
    stopped = chat(client, tiny_engine, "stop here", max_tokens=3, extra_body={"ignore_eos": True, "stop_token_ids": [first_id]})
    assert stopped.choices[0].finish_reason == "stop"
    assert stopped.usage.completion_tokens == 1


def test_text_parts_are_accepted(client, tiny_engine):
    parts = [{"type": "text", "text": "one"}, {"type": "text", "text": "two"}]
    as_parts = client.chat.completions.create(model=tiny_engine.model_id, messages=[{"role": "user", "content": parts}],
                                              max_tokens=3, temperature=0)
    as_text = chat(client, tiny_engine, "one\ntwo", max_tokens=3)
    assert as_parts.usage.prompt_tokens == as_text.usage.prompt_tokens
    assert as_parts.choices[0].message.content == as_text.choices[0].message.content


def test_tools_change_the_prompt(client, tiny_engine):
    tools = [{"type": "function", "function": {"name": "get_weather", "description": "Weather by city",
                                               "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]
    plain = chat(client, tiny_engine, "Weather in Paris?")
    with_tools = chat(client, tiny_engine, "Weather in Paris?", tools=tools)
    assert with_tools.usage.prompt_tokens > plain.usage.prompt_tokens


def test_concurrent_requests_all_succeed_and_free_their_blocks(client, tiny_engine):
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(lambda i: chat(client, tiny_engine, f"question {i} " + LONG_TEXT[:200], max_tokens=3), range(6)))
    assert all(r.choices[0].finish_reason in ("stop", "length") for r in results)
    wait_until(lambda: all_blocks_free(tiny_engine), 30, "every KV block to be free")
    tiny_engine.kv_cache_manager.check_integrity()


# ------------------------------------------------------------------ disconnects
def test_client_disconnect_mid_stream_frees_the_blocks(live, tiny_engine):
    # No max_tokens: the request may generate until the context is full.
    body = {"model": tiny_engine.model_id, "messages": [{"role": "user", "content": "go on"}],
            "ignore_eos": True, "stream": True}
    with httpx.stream("POST", live.api_url + "/chat/completions", json=body, timeout=60) as resp:
        assert resp.status_code == 200
        lines = resp.iter_lines()
        first = next(line for line in lines if line.startswith("data: "))
        assert "chat.completion.chunk" in first
        assert not all_blocks_free(tiny_engine)  # the request holds blocks while running
    wait_until(lambda: all_blocks_free(tiny_engine), 60, "the cancelled stream's blocks to be freed")
    tiny_engine.kv_cache_manager.check_integrity()
    assert aborted_requests(live) == 1


def test_client_disconnect_during_a_non_stream_request_frees_the_blocks(live, tiny_engine):
    payload = json.dumps({"model": tiny_engine.model_id, "messages": [{"role": "user", "content": "go on"}],
                          "ignore_eos": True}).encode()
    port = int(live.base_url.rsplit(":", 1)[1])
    sock = socket.create_connection(("127.0.0.1", port))
    try:
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     + f"Content-Length: {len(payload)}\r\n\r\n".encode() + payload)
        wait_until(lambda: not all_blocks_free(tiny_engine), 60, "the request to start running")
    finally:
        sock.close()
    wait_until(lambda: all_blocks_free(tiny_engine), 60, "the abandoned request's blocks to be freed")
    tiny_engine.kv_cache_manager.check_integrity()
    assert aborted_requests(live) == 1


# ------------------------------------------------------------------ metrics
def test_metrics_report_prefix_cache_blocks_and_ttft(live, client, tiny_engine):
    chat(client, tiny_engine, LONG_TEXT + " metrics")
    chat(client, tiny_engine, LONG_TEXT + " metrics")
    values = metric_values(live)
    stats = tiny_engine.kv_cache_manager.stats
    assert values["prefixgate_engine_prefix_cache_queries_tokens_total"] == stats.queries
    assert values["prefixgate_engine_prefix_cache_hits_tokens_total"] == stats.hits > 0
    assert "prefixgate_engine_prefix_cache_evictions_total" in values
    assert values["prefixgate_engine_kv_blocks_total"] == tiny_engine.kv_cache_manager.num_blocks
    assert values["prefixgate_engine_kv_blocks_free"] + values["prefixgate_engine_kv_blocks_used"] == values["prefixgate_engine_kv_blocks_total"]
    assert values["prefixgate_engine_time_to_first_token_seconds_count"] >= 2


# ------------------------------------------------------------------ engine failures
def fail_first_forward(engine):
    def explode(request_id, logits):
        raise RuntimeError("injected failure")

    engine.first_logits_observer = explode


def test_an_engine_failure_is_a_500_server_error_and_frees_the_blocks(client, tiny_engine):
    fail_first_forward(tiny_engine)
    with pytest.raises(openai.InternalServerError) as info:
        chat(client, tiny_engine, LONG_TEXT)
    error = info.value.response.json()["error"]
    assert error["type"] == "server_error" and "injected failure" in error["message"]
    wait_until(lambda: all_blocks_free(tiny_engine), 30, "the failed request's blocks to be freed")
    tiny_engine.first_logits_observer = None
    assert chat(client, tiny_engine, "still serving").choices[0].finish_reason in ("stop", "length")


def test_an_engine_failure_mid_stream_is_an_error_event(client, live, tiny_engine):
    fail_first_forward(tiny_engine)
    with pytest.raises(openai.APIError, match="injected failure"):
        list(chat(client, tiny_engine, LONG_TEXT, stream=True))
    body = {"model": tiny_engine.model_id, "messages": [{"role": "user", "content": "x"}], "stream": True}
    raw = httpx.post(live.api_url + "/chat/completions", json=body, timeout=60).text
    events = sse_events(raw)
    assert json.loads(events[-2][len("data: "):])["error"]["type"] == "server_error"
    assert events[-1] == "data: [DONE]"
    tiny_engine.first_logits_observer = None
    wait_until(lambda: all_blocks_free(tiny_engine), 30, "the failed requests' blocks to be freed")
