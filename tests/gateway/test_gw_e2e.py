"""End to end: the official openai SDK against `prefixgate serve` (real bundled model,
real engine child process, real HTTP on loopback). One server for the module."""

from __future__ import annotations

import contextlib
import copy
import io
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import openai
import pytest
from gw_fakes import rows, wait_healthy
from support.net import free_port

from gateway.policy.api_key import hash_key
from gateway.stats.database import default_db_url

pytestmark = pytest.mark.real_model

KEYS = {"alpha": "alpha-key-0123456789", "beta": "beta-key-0123456789", "raw": "raw-key-0123456789",
        "readme": "readme-key-0123456789"}
ADMIN = "admin-key-0123456789"
MODEL = "SmolLM2-135M-Instruct"

SYSTEM = (
    "You are the support assistant of a bicycle shop. Answer briefly and politely. "
    "Opening hours are nine to six on weekdays and ten to four on Saturdays. "
    "We repair city bikes, road bikes and cargo bikes, and we sell spare parts."
)
TOOLS = [
    {"type": "function", "function": {
        "name": "lookup_order", "description": "Find an order by its number.",
        "parameters": {"type": "object", "properties": {"order_number": {"type": "string"},
                                                         "include_items": {"type": "boolean"}},
                       "required": ["order_number"]}}},
    {"type": "function", "function": {
        "name": "book_repair", "description": "Book a repair slot for a bike.",
        "parameters": {"type": "object", "properties": {"day": {"type": "string"},
                                                         "bike_type": {"type": "string"}},
                       "required": ["day", "bike_type"]}}},
]


def reordered(tools):
    """The same tools in the other order with every object's keys reversed."""
    def flip(value):
        if isinstance(value, dict):
            return {k: flip(value[k]) for k in reversed(list(value))}
        if isinstance(value, list):
            return [flip(v) for v in value]
        return value
    return [flip(t) for t in reversed(copy.deepcopy(tools))]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    data = tmp_path_factory.mktemp("serve")
    config = data / "gateway.toml"
    config.write_text(
        f'[server]\nadmin_keys = ["{hash_key(ADMIN)}"]\n'
        + "".join(f'[tenants.{name}]\nkeys = ["{hash_key(key)}"]\n' for name, key in KEYS.items())
        + "[tenants.alpha.canonicalize]\ntool_order = true\n"  # opted in: reordered tools share a prefix
        + "[tenants.raw.canonicalize]\ntools = false\n"
    )
    port, engine_port = free_port(), free_port()
    process = subprocess.Popen(
        [sys.executable, "-m", "gateway.cli", "serve", "--port", str(port), "--engine-port", str(engine_port),
         "--data-dir", str(data), "--config", str(config), "--log-level", "warning"],
        env={**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"},
    )
    url = f"http://127.0.0.1:{port}"
    wait_healthy(url, process, name="prefixgate serve", timeout=900, interval=0.5)
    yield url, data, engine_port
    process.send_signal(signal.SIGINT)
    try:
        assert process.wait(120) == 0
    finally:
        if process.poll() is None:
            process.kill()
    # the engine child is gone too: its port is free again
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"http://127.0.0.1:{engine_port}/health", timeout=5)


def client(server, tenant):
    return openai.OpenAI(base_url=server[0] + "/v1", api_key=KEYS[tenant], max_retries=0, timeout=300)


def test_streaming_with_usage(server):
    stream = client(server, "alpha").chat.completions.create(
        model=MODEL, messages=[{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Hello!"}],
        max_tokens=8, temperature=0, stream=True, stream_options={"include_usage": True},
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text.strip()
    usage = chunks[-1].usage
    assert chunks[-1].choices == [] and usage.prompt_tokens > 0 and usage.completion_tokens > 0
    assert usage.prompt_tokens_details.cached_tokens is not None


def test_streaming_without_usage_still_records_tokens(server):
    stream = client(server, "beta").chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Say one word about bikes."}],
        max_tokens=4, temperature=0, stream=True,
    )
    chunks = list(stream)
    assert chunks and all(c.choices and c.usage is None for c in chunks)


def test_tools_cache_hit_with_reordered_tools_and_keys(server):
    alpha = client(server, "alpha")
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Where is order 4711?"}]
    first = alpha.chat.completions.with_raw_response.create(
        model=MODEL, messages=messages, tools=TOOLS, max_tokens=4, temperature=0,
    )
    second = alpha.chat.completions.with_raw_response.create(
        model=MODEL, messages=messages, tools=reordered(TOOLS), max_tokens=4, temperature=0,
    )
    assert "tools.ordered_by_name" in first.headers["x-prefixgate-canonicalized"]
    assert "tools.keys_sorted" in second.headers["x-prefixgate-canonicalized"]
    first, second = first.parse(), second.parse()
    prompt = second.usage.prompt_tokens
    assert first.usage.prompt_tokens == prompt > 100
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert cached >= prompt - 16, (cached, prompt)  # every full block of the prompt was reused
    # the same pair without tool canonicalization diverges early and reuses much less
    raw = client(server, "raw")
    raw.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS, max_tokens=4, temperature=0)
    raw_second = raw.chat.completions.create(model=MODEL, messages=messages, tools=reordered(TOOLS),
                                             max_tokens=4, temperature=0)
    assert raw_second.usage.prompt_tokens_details.cached_tokens < cached


def test_tenant_isolation_even_with_the_same_client_salt(server):
    messages = [{"role": "system", "content": SYSTEM + " Secret discount code: tenant A only."},
                {"role": "user", "content": "What are your opening hours on Saturday?"}]
    salt = {"cache_salt": "user-42"}
    alpha, beta = client(server, "alpha"), client(server, "beta")
    alpha.chat.completions.create(model=MODEL, messages=messages, max_tokens=2, temperature=0, extra_body=salt)
    again = alpha.chat.completions.create(model=MODEL, messages=messages, max_tokens=2, temperature=0,
                                          extra_body=salt)
    assert again.usage.prompt_tokens_details.cached_tokens > 0
    replay = beta.chat.completions.create(model=MODEL, messages=messages, max_tokens=2, temperature=0,
                                          extra_body=salt)
    assert replay.usage.prompt_tokens_details.cached_tokens == 0
    other_salt = alpha.chat.completions.create(model=MODEL, messages=messages, max_tokens=2, temperature=0,
                                               extra_body={"cache_salt": "user-43"})
    assert other_salt.usage.prompt_tokens_details.cached_tokens == 0


def test_prefix_warnings_reach_the_sdk_and_errors_are_openai_shaped(server):
    alpha = client(server, "alpha")
    raw = alpha.chat.completions.with_raw_response.create(
        model=MODEL, max_tokens=2, temperature=0,
        messages=[{"role": "system", "content": "Today is 2026-11-22T00:12:00Z."}, {"role": "user", "content": "hi"}],
    )
    assert "PS101" in raw.headers["x-prefixgate-warnings"]
    assert any(w["code"] == "PS101" for w in raw.parse().model_extra["prefix_warnings"])
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=server[0] + "/v1", api_key="wrong", max_retries=0).models.list()
    with pytest.raises(openai.NotFoundError):
        alpha.chat.completions.create(model="no-such-model", messages=[{"role": "user", "content": "x"}])
    assert [m.id for m in alpha.models.list()] == [MODEL]


def test_cache_stats_endpoint(server):
    stats = httpx.get(server[0] + "/v1/cache/stats", headers={"authorization": f"Bearer {ADMIN}"}, timeout=30)
    assert stats.status_code == 200
    alpha = stats.json()["tenants"]["alpha"]
    assert alpha["cached_tokens"] > 0 and 0 < alpha["hit_rate"] < 1
    assert rows(default_db_url(server[1]))  # rows reach the SQLite file while serving


def test_readme_snippet_shows_cached_tokens_on_the_second_call(server):
    """Runs the README's SDK example as written (only the URL and key swapped)."""
    snippet = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    code = re.search(r"```python\n(.*?)```", snippet, re.S).group(1)
    code = code.replace("http://127.0.0.1:8000/v1", server[0] + "/v1").replace("my-local-key", KEYS["readme"])
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(code, "readme-snippet", "exec"), {})
    counts = [tuple(map(int, m)) for m in re.findall(r"prompt_tokens=(\d+) cached_tokens=(\d+)", out.getvalue())]
    assert len(counts) == 2
    (_, first_cached), (second_prompt, second_cached) = counts
    assert first_cached == 0
    assert second_cached >= 96 and second_cached < second_prompt


def test_the_engine_port_answers_only_the_gateway(server):
    """`serve` gives its engine a per-run key: the engine's own port refuses everyone else."""
    engine = f"http://127.0.0.1:{server[2]}"
    body = {"model": "SmolLM2-135M-Instruct", "max_tokens": 1, "messages": [{"role": "user", "content": "hi"}]}
    for headers in ({}, {"authorization": "Bearer anything"}, {"authorization": f"Bearer {KEYS['alpha']}"}):
        for path in ("/v1/chat/completions", "/v1/completions"):
            refused = httpx.post(engine + path, json={**body, "prompt": "hi"}, headers=headers, timeout=30)
            assert refused.status_code == 401
            assert refused.json()["error"]["type"] == "authentication_error"
        assert httpx.get(engine + "/v1/models", headers=headers, timeout=30).status_code == 401
        assert httpx.get(engine + "/metrics", headers=headers, timeout=30).status_code == 401
    assert httpx.get(engine + "/health", timeout=30).status_code == 200
    sdk = openai.OpenAI(base_url=engine + "/v1", api_key="guess", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        sdk.chat.completions.create(**body)
    # ...while the gateway in front of it serves the tenant.
    answer = client(server, "alpha").chat.completions.create(**body)
    assert answer.usage.completion_tokens == 1


def test_a_body_parsed_in_pieces_gets_the_answer_of_the_compact_body(server):
    """A body past piecewise_json's threshold (JSON whitespace between messages makes it
    large, not its prompt) is parsed in pieces and answered exactly as the compact body."""
    import orjson

    from engine.contract import piecewise_json

    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": 'Say "[hi]", {please}.'},
                {"role": "assistant", "content": "[hi]"}, {"role": "user", "content": "And again, with \\ é."}]
    request = {"model": MODEL, "max_tokens": 12, "temperature": 0, "messages": messages}
    compact = orjson.dumps(request)
    padding = b" \n" * (100 * 1024)
    padded = compact.replace(b'"messages":[', b'"messages":[' + padding).replace(b'},{', b"}," + padding + b"{")
    assert orjson.loads(padded) == request and len(padded) > 2 * piecewise_json.PIECED_ABOVE_BYTES
    assert [key for key, *_ in piecewise_json._plan(padded) or []] == ["messages"]  # split in runs
    headers = {"authorization": f"Bearer {KEYS['beta']}", "content-type": "application/json"}
    answers = [httpx.post(server[0] + "/v1/chat/completions", content=body, headers=headers, timeout=300)
               for body in (compact, padded)]
    assert [a.status_code for a in answers] == [200, 200], answers[1].text
    first, second = (a.json() for a in answers)
    assert first["choices"][0]["message"] == second["choices"][0]["message"]
    assert first["usage"]["prompt_tokens"] == second["usage"]["prompt_tokens"]
