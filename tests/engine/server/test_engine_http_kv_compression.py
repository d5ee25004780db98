"""kv_compression over real loopback HTTP (the official openai SDK): the engine's default,
a request's own choice either way, the metrics, and bad values refused with a 400."""

from __future__ import annotations

import httpx
import openai
import pytest
from test_engine_http_fixtures import serve

PROMPT = " ".join(f"Item {i} is on shelf {i % 7}." for i in range(40))


@pytest.fixture
def live(make_tiny_engine):
    with serve(make_tiny_engine(kv_compression="pyramid")) as server:
        yield server


def metric(live, name):
    text = httpx.get(f"{live.base_url}/metrics", timeout=30).text
    return next(float(line.split()[-1]) for line in text.splitlines() if line.startswith(name))


def test_requests_choose_and_metrics_count(live):
    client = openai.OpenAI(base_url=live.api_url, api_key="x", max_retries=0, timeout=120)
    model = client.models.list().data[0].id
    plain = client.completions.create(model=model, prompt=PROMPT, max_tokens=6, temperature=0,
                                      extra_body={"kv_compression": "none", "cache_salt": "s1"})
    assert metric(live, "prefixgate_engine_kv_retained_tokens_count") == 0
    squeezed = client.completions.create(model=model, prompt=PROMPT, max_tokens=6, temperature=0,
                                         extra_body={"cache_salt": "s2"})  # the engine's default
    assert squeezed.usage.completion_tokens == plain.usage.completion_tokens == 6
    assert metric(live, "prefixgate_engine_kv_retained_tokens_count") == 1
    tokens = metric(live, "prefixgate_engine_kv_compressed_tokens_total")
    kept = metric(live, "prefixgate_engine_kv_retained_tokens_sum")
    assert tokens == squeezed.usage.prompt_tokens and 0 < kept < tokens
    chat = client.chat.completions.create(model=model, messages=[{"role": "user", "content": PROMPT}],
                                          max_tokens=4, extra_body={"kv_compression": "pyramid"})
    assert chat.usage.completion_tokens >= 1
    assert metric(live, "prefixgate_engine_kv_retained_tokens_count") == 2
    assert metric(live, "prefixgate_engine_kv_reselections_total") == 0  # fewer than 32 tokens decoded
    long = client.completions.create(model=model, prompt=PROMPT, max_tokens=70, temperature=0,
                                     extra_body={"cache_salt": "s3", "ignore_eos": True})
    assert long.usage.completion_tokens == 70
    assert metric(live, "prefixgate_engine_kv_reselections_total") == 2  # after 32 and 64 decoded tokens
    assert metric(live, "prefixgate_engine_kv_reselect_freed_blocks_total") >= 0
    assert metric(live, "vllm:kv_cache_usage_perc") == 0.0


@pytest.mark.parametrize("bad", ["zip", 1, True])
def test_bad_values_are_a_400(live, bad):
    r = httpx.post(f"{live.api_url}/completions", timeout=60,
                   json={"prompt": "hi", "max_tokens": 2, "kv_compression": bad})
    assert r.status_code == 400
    assert r.json()["error"]["param"] == "kv_compression"


def test_layerwise_engine_serves_long_prompts_and_prompt_logprobs(make_tiny_engine):
    """`--kv-layerwise` behind real HTTP: a prompt longer than a step's budget is
    compressed chunk by chunk and answered; a request asking for prompt_logprobs (every
    row's logits, so no row dropped) gets one entry per prompt token; an exact request
    beside them gets the tokens an engine without compression gives."""
    prompt = " ".join(f"Item {i} is on shelf {i % 7}." for i in range(75))
    with serve(make_tiny_engine()) as server:
        client = openai.OpenAI(base_url=server.api_url, api_key="x", max_retries=0, timeout=120)
        reference = client.completions.create(model="tiny-llama", prompt=prompt, max_tokens=8, temperature=0)
    with serve(make_tiny_engine(kv_compression="pyramid", kv_layerwise=True,
                                max_num_batched_tokens=256)) as live:
        client = openai.OpenAI(base_url=live.api_url, api_key="x", max_retries=0, timeout=120)
        squeezed = client.completions.create(model="tiny-llama", prompt=prompt, max_tokens=40, temperature=0,
                                             extra_body={"ignore_eos": True})
        assert squeezed.usage.prompt_tokens > 512 and squeezed.usage.completion_tokens == 40
        assert metric(live, "prefixgate_engine_kv_retained_tokens_count") == 1
        assert metric(live, "prefixgate_engine_kv_reselections_total") >= 2  # chunks over packed pages
        scored = httpx.post(f"{live.api_url}/completions", timeout=120,
                            json={"prompt": prompt, "max_tokens": 1, "prompt_logprobs": 0, "cache_salt": "p"})
        assert scored.status_code == 200, scored.text
        entries = scored.json()["choices"][0]["prompt_logprobs"]
        assert len(entries) == squeezed.usage.prompt_tokens and entries[0] is None
        assert all(e is not None for e in entries[1:])
        exact = client.completions.create(model="tiny-llama", prompt=prompt, max_tokens=8, temperature=0,
                                          extra_body={"kv_compression": "none", "cache_salt": "e"})
        assert exact.choices[0].text == reference.choices[0].text
        assert metric(live, "vllm:kv_cache_usage_perc") == 0.0
