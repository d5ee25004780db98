"""`prefixgate engine --api-key`: every route but /health needs the bearer key (vLLM's flag)."""

import httpx
import openai
import pytest
from test_engine_http_fixtures import serve

from engine.contract.api_key import ApiKeyGuard

KEY = "per-run-key-0123456789"
MSG = [{"role": "user", "content": "hi"}]


@pytest.fixture
def live(tiny_engine):
    with serve(tiny_engine, api_key=KEY) as server:
        yield server


@pytest.mark.parametrize("headers", [{}, {"authorization": "Bearer wrong"}, {"authorization": KEY},
                                     {"authorization": f"Basic {KEY}"}, {"authorization": f"Bearer {KEY}x"}])
def test_requests_without_the_key_are_401_before_anything_runs(live, tiny_engine, headers):
    body = {"model": tiny_engine.model_id, "messages": MSG, "prompt": "hi", "max_tokens": 1}
    for method, path in [("POST", "/v1/chat/completions"), ("POST", "/v1/completions"),
                         ("GET", "/v1/models"), ("GET", "/metrics"), ("POST", "/v1/nothing")]:
        resp = httpx.request(method, live.base_url + path, json=body, headers=headers, timeout=30)
        assert resp.status_code == 401, (path, resp.text)
        error = resp.json()["error"]
        assert set(error) == {"message", "type", "param", "code"}
        assert (error["type"], error["code"]) == ("authentication_error", "invalid_api_key")
    stats = tiny_engine.stats()
    assert (stats.prefix_cache_requests, stats.num_finished, stats.num_running) == (0, 0, 0)


def test_health_is_open_and_the_key_serves_the_sdk(live, tiny_engine):
    assert httpx.get(live.base_url + "/health", timeout=30).status_code == 200
    client = openai.OpenAI(base_url=live.api_url, api_key=KEY, max_retries=0, timeout=60)
    answer = client.chat.completions.create(model=tiny_engine.model_id, messages=MSG, max_tokens=2)
    assert answer.usage.completion_tokens >= 1
    streamed = list(client.completions.create(model=tiny_engine.model_id, prompt="hi", max_tokens=2, stream=True))
    assert streamed
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=live.api_url, api_key="nope", max_retries=0).models.list()


def test_an_empty_key_is_refused():
    with pytest.raises(ValueError, match="non-empty"):
        ApiKeyGuard(lambda scope, receive, send: None, "")
