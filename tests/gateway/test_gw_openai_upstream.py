"""``--upstream-kind openai``: against a fake that enforces OpenAI's parameter set,
the gateway sends a server-derived ``prompt_cache_key`` and never ``cache_salt``,
two tenants never share a key, and canonicalization, warnings and stats still work."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections.abc import AsyncIterator
from typing import Any

import httpx
import openai
import pytest
from gw_fake_openai import API_KEY, FakeOpenAI
from gw_fakes import SECRET, make_settings, rows

from gateway.config.config_file import parse_config
from gateway.policy.api_key import hash_key
from gateway.server.app import create_app
from gateway.server.settings import GatewaySettings
from gateway.upstream.kinds import prompt_cache_key, resolve_kind, scoped_body

KEYS = {"acme": "pg-acme-key", "beta": "pg-beta-key", "gamma": "pg-gamma-key", "delta": "pg-delta-key"}
CONFIG = {
    "server": {"upstream_kind": "openai"},
    "tenants": {
        "acme": {"keys": [hash_key(KEYS["acme"])]},
        "beta": {"keys": [hash_key(KEYS["beta"])]},
        "gamma": {"keys": [hash_key(KEYS["gamma"])], "isolation": "group:team"},
        "delta": {"keys": [hash_key(KEYS["delta"])], "isolation": "group:team"},
    },
}
SYSTEM = "You are the assistant of a bicycle repair shop. Answer in one short sentence. " * 4


def chat(question: str, **extra: Any) -> dict[str, Any]:
    return {"model": "gpt-4o-mini", "max_tokens": 8,
            "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}], **extra}


def openai_settings(tmp_path, config: dict[str, Any] | None = CONFIG) -> GatewaySettings:
    settings = make_settings(tmp_path, config, upstream="https://api.openai.com/v1")
    return dataclasses.replace(settings, upstream_kind="openai", upstream_api_key=API_KEY)


@contextlib.asynccontextmanager
async def gateway(settings: GatewaySettings, fake: FakeOpenAI) -> AsyncIterator[httpx.AsyncClient]:
    upstream = httpx.AsyncClient(transport=httpx.ASGITransport(fake.app), timeout=5.0)
    app = create_app(settings, upstream)
    try:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gw") as client:
            yield client
    finally:
        await app.state.gateway.aclose()
        await upstream.aclose()


def sdk(client: httpx.AsyncClient, key: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url="http://gw/v1", api_key=key, http_client=client, max_retries=0)


def test_the_fake_enforces_openais_parameters():
    fake = FakeOpenAI()

    async def go() -> httpx.Response:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(fake.app), base_url="http://o") as client:
            return await client.post("/v1/chat/completions", json=chat("hi", cache_salt="x"),
                                     headers={"authorization": f"Bearer {API_KEY}"})

    response = asyncio.run(go())
    assert response.status_code == 400
    assert response.json()["error"]["message"] == "Unrecognized request argument supplied: cache_salt"


def test_vllm_kind_in_front_of_openai_fails_as_the_issue_describes(tmp_path):
    fake = FakeOpenAI()
    settings = dataclasses.replace(openai_settings(tmp_path), upstream_kind="vllm")

    async def go() -> httpx.Response:
        async with gateway(settings, fake) as gw:
            return await gw.post("/v1/chat/completions", json=chat("hi"),
                                 headers={"authorization": f"Bearer {KEYS['acme']}"})

    response = asyncio.run(go())
    assert response.status_code == 400 and "cache_salt" in response.json()["error"]["message"]


def test_sdk_request_carries_a_derived_key_and_no_salt(tmp_path):
    fake = FakeOpenAI()
    settings = openai_settings(tmp_path)

    async def go() -> list[Any]:
        async with gateway(settings, fake) as gw:
            client = sdk(gw, KEYS["acme"])
            first = await client.chat.completions.create(
                **chat("When are you open?"), extra_body={"cache_salt": "mine", "prompt_cache_key": "client-key"})
            second = await client.chat.completions.create(**chat("Do you fix cargo bikes?"))
            stream = await client.chat.completions.create(**chat("Any discounts?"), stream=True)
            chunks = [chunk async for chunk in stream]
            return [first, second, chunks]

    first, second, chunks = asyncio.run(go())
    assert first.choices[0].message.content == "Hi." and chunks[-1].choices[0].finish_reason == "stop"
    assert all("cache_salt" not in body for body in fake.bodies)
    keys = [body["prompt_cache_key"] for body in fake.bodies]
    assert all(key.startswith("pg-") and len(key) == 35 for key in keys)
    assert "client-key" not in keys
    # The client's key narrows its own scope (like a client salt); without one, the
    # tenant's family key is stable across questions, streamed or not.
    assert keys[0] != keys[1] == keys[2]
    assert keys[1] == prompt_cache_key(SECRET, "tenant:acme", chat("another question"), None)
    assert set(fake.authorizations) == {f"Bearer {API_KEY}"}
    assert "stream_options" not in fake.bodies[1] and fake.bodies[2]["stream_options"] == {"include_usage": True}
    # cached_tokens come from OpenAI's usage (the streamed one too) into the stats rows:
    # the third request repeats the second's system message under the same key.
    logged = rows(settings.db_url)
    assert [row.status for row in logged] == [200, 200, 200]
    assert second.usage.prompt_tokens_details.cached_tokens == 0
    assert [row.cached_tokens for row in logged] == [0, 0, fake.usages[2]["prompt_tokens_details"]["cached_tokens"]]
    assert logged[2].cached_tokens > 0 and logged[2].prompt_tokens == fake.usages[2]["prompt_tokens"]


def test_two_tenants_never_share_a_key(tmp_path):
    fake = FakeOpenAI()
    settings = openai_settings(tmp_path)

    async def go() -> None:
        async with gateway(settings, fake) as gw:
            for tenant in ("acme", "beta", "gamma", "delta"):
                for extra in ({}, {"prompt_cache_key": "same-for-all"}):
                    response = await gw.post("/v1/chat/completions", json=chat("hi", **extra),
                                             headers={"authorization": f"Bearer {KEYS[tenant]}"})
                    assert response.status_code == 200, response.text

    asyncio.run(go())
    keys = [body["prompt_cache_key"] for body in fake.bodies]
    acme, acme_c, beta, beta_c, gamma, gamma_c, delta, delta_c = keys
    assert len({acme, acme_c, beta, beta_c, gamma, gamma_c}) == 6  # isolated tenants and the group differ
    assert (gamma, gamma_c) == (delta, delta_c)  # one group: one scope, shared on purpose


def test_families_get_their_own_keys_and_volatile_values_do_not_split_one():
    body = chat("hi")
    other = {**body, "messages": [{"role": "system", "content": "You are a tax adviser."}, *body["messages"][1:]]}
    dated = [{"role": "system", "content": f"Today is 2026-11-{day} 09:00. " + SYSTEM} for day in (22, 23)]
    key = prompt_cache_key(SECRET, "tenant:acme", body, None)
    assert key != prompt_cache_key(SECRET, "tenant:acme", other, None)
    assert key != prompt_cache_key(SECRET, "tenant:acme", {**body, "model": "gpt-4o"}, None)
    assert prompt_cache_key(SECRET, "tenant:acme", {**body, "messages": dated[:1]}, None) == prompt_cache_key(
        SECRET, "tenant:acme", {**body, "messages": dated[1:]}, None)
    assert key != prompt_cache_key(b"another-secret-0123456789abcdef", "tenant:acme", body, None)


def test_scoped_body_per_kind():
    body = chat("hi", prompt_cache_key="c")
    vllm = scoped_body("vllm", body, SECRET, "tenant:acme", None)
    assert "cache_salt" in vllm and vllm["prompt_cache_key"] == "c"
    hosted = scoped_body("openai", body, SECRET, "tenant:acme", None)
    assert "cache_salt" not in hosted and hosted["prompt_cache_key"].startswith("pg-")
    legacy = scoped_body("openai", {"model": "m", "prompt": "p", "prompt_cache_key": "c"}, SECRET, None, "s")
    assert legacy == {"model": "m", "prompt": "p"}
    assert body["prompt_cache_key"] == "c"  # the input is never mutated


def test_canonicalization_warnings_and_legacy_completions_still_work(tmp_path):
    fake = FakeOpenAI()
    settings = openai_settings(tmp_path)
    tools = [{"type": "function", "function": {"name": n, "parameters": {"type": "object", "properties": {}}}}
             for n in ("zeta", "alpha")]
    dated = {**chat("hi", tools=tools)}
    dated["messages"] = [{"role": "system", "content": "Now: 2026-11-23T09:14:07Z. " + SYSTEM},
                         {"role": "user", "content": "hi"}]

    async def go() -> list[httpx.Response]:
        async with gateway(settings, fake) as gw:
            auth = {"authorization": f"Bearer {KEYS['acme']}"}
            return [
                await gw.post("/v1/chat/completions", json=dated, headers=auth),
                await gw.post("/v1/completions", json={"model": "gpt-3.5-turbo-instruct", "prompt": "Hi"},
                              headers=auth),
                await gw.get("/health"),
                await gw.get("/v1/models", headers=auth),
            ]

    chat_response, legacy, health, models = asyncio.run(go())
    assert chat_response.status_code == 200, chat_response.text
    assert chat_response.headers["x-prefixgate-warnings"]
    assert "tools" in chat_response.headers["x-prefixgate-canonicalized"]
    assert [tool["function"]["name"] for tool in fake.bodies[0]["tools"]] == ["zeta", "alpha"]  # order is opt-in
    assert legacy.status_code == 200, legacy.text
    assert health.json() == {"status": "ok", "upstream": "ok"}  # OpenAI has no /health: /v1/models
    assert models.json()["data"][0]["id"] == "gpt-4o-mini"
    first, second = rows(settings.db_url)
    assert first.warning_codes and "tools" in first.canonicalization
    assert second.endpoint == "completions" and second.status == 200


@pytest.mark.parametrize(("kind", "url", "expected"), [
    (None, "https://api.openai.com/v1", "openai"),
    (None, "http://127.0.0.1:8001", "vllm"),
    ("vllm", "https://api.openai.com/v1", "vllm"),
    ("openai", "http://127.0.0.1:9000", "openai"),
])
def test_upstream_kind_resolution(kind, url, expected):
    assert resolve_kind(kind, url) == expected


def test_upstream_kind_is_validated():
    with pytest.raises(ValueError, match="'tgi'"):
        resolve_kind("tgi", "http://x")
    with pytest.raises(ValueError, match=r"server\.upstream_kind"):
        parse_config({"server": {"upstream_kind": "tgi"}})
    assert parse_config({"server": {"upstream_kind": "openai"}}).upstream_kind == "openai"


def test_the_gateway_command_fronts_openai_over_real_http(tmp_path):
    """``prefixgate gateway --upstream-kind openai`` as a process: the key from
    $OPENAI_API_KEY, the derived prompt_cache_key, the official SDK on loopback."""
    import os
    import signal
    import subprocess
    import sys

    from gw_fakes import serve_in_thread, wait_healthy
    from support.net import free_port

    fake = FakeOpenAI()
    port = free_port()
    with serve_in_thread(fake.app) as fake_url:
        env = {**os.environ, "OPENAI_API_KEY": API_KEY, "PREFIXGATE_SECRET": SECRET.decode()}
        env.pop("PREFIXGATE_UPSTREAM_API_KEY", None)
        process = subprocess.Popen(
            [sys.executable, "-m", "gateway.cli", "gateway", "--upstream", fake_url + "/v1",
             "--upstream-kind", "openai", "--data-dir", str(tmp_path), "--port", str(port)],
            stderr=subprocess.PIPE, text=True, env=env,
        )
        try:
            url = f"http://127.0.0.1:{port}"
            wait_healthy(url, process, name="gateway")  # /health asks the fake's /v1/models
            client = openai.OpenAI(base_url=url + "/v1", api_key="my-local-key", max_retries=0)
            answer = client.chat.completions.create(**chat("When are you open?"),
                                                    extra_body={"cache_salt": "ignored-upstream"})
            process.send_signal(signal.SIGINT)
            _, stderr = process.communicate(timeout=60)
        finally:
            if process.poll() is None:
                process.kill()
    assert process.returncode == 0, stderr
    assert answer.choices[0].message.content == "Hi."
    (body,) = fake.bodies
    assert "cache_salt" not in body and body["prompt_cache_key"].startswith("pg-")
    assert API_KEY not in stderr  # the upstream key is never logged
    assert set(fake.authorizations) == {f"Bearer {API_KEY}"}
