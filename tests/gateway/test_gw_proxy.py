"""The proxy path against a fake upstream (in process): salts, canonicalization,
warnings, auth, usage and stats rows."""

from __future__ import annotations

import asyncio

import httpx
import orjson
from gw_fakes import SECRET, gateway_client, make_settings, rows, serve_in_thread
from support.net import free_port
from support.sse import sse_data, sse_events

from gateway.policy.api_key import hash_key
from gateway.policy.prefix_warner import CONVERSATION_HEADER
from gateway.policy.salt import derive_cache_salt

KEY_A, KEY_B, ADMIN = "key-a-secret", "key-b-secret", "admin-secret"
CONFIG = {
    "server": {"admin_keys": [hash_key(ADMIN)]},
    "tenants": {
        "alpha": {"keys": [hash_key(KEY_A)], "canonicalize": {"tool_order": True}},
        "beta": {"keys": [hash_key(KEY_B)], "isolation": "group:team"},
        "gamma": {"keys": [hash_key("key-c")], "isolation": "shared", "canonicalize": False},
        "delta": {"keys": [hash_key("key-d")], "isolation": "group:team"},
        "strict": {"keys": [hash_key("key-s")], "reject_on": ["PS101"]},
    },
}

CHAT = {
    "model": "fake-model",
    "messages": [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "hi"}],
}


def run(coro):
    return asyncio.run(coro)


def auth(key: str) -> dict[str, str]:
    return {"authorization": f"Bearer {key}"}


def test_salt_is_server_side_and_client_salt_is_replaced(tmp_path, fake_upstream):
    async def go():
        async with gateway_client(make_settings(tmp_path, CONFIG), httpx.ASGITransport(fake_upstream.app)) as gw:
            plain = await gw.post("/v1/chat/completions", json=CHAT, headers=auth(KEY_A))
            salted = await gw.post("/v1/chat/completions", json={**CHAT, "cache_salt": "user-7"}, headers=auth(KEY_A))
            shared = await gw.post("/v1/chat/completions", json=CHAT, headers=auth("key-c"))
            for key in (KEY_B, "key-d", KEY_B):
                await gw.post("/v1/chat/completions", json={**CHAT, "cache_salt": "u1"}, headers=auth(key))
            return plain, salted, shared

    plain, salted, shared = run(go())
    group = [body["cache_salt"] for body in fake_upstream.bodies[3:]]
    assert group[0] == group[1] == group[2] == derive_cache_salt(SECRET, "group:team", "u1")
    assert plain.status_code == salted.status_code == shared.status_code == 200
    sent = fake_upstream.bodies
    assert sent[0]["cache_salt"] == derive_cache_salt(SECRET, "tenant:alpha", None)
    assert sent[1]["cache_salt"] == derive_cache_salt(SECRET, "tenant:alpha", "user-7")
    assert sent[1]["cache_salt"] != "user-7"
    assert "cache_salt" not in sent[2]  # shared tenant without a client salt
    assert plain.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 16


def test_canonicalization_reaches_upstream_and_is_recorded(tmp_path, fake_upstream):
    tools = [
        {"type": "function", "function": {"name": "zeta", "parameters": {"type": "object", "properties": {}}}},
        {"function": {"parameters": {"properties": {}, "type": "object"}, "name": "alpha"}, "type": "function"},
    ]
    body = {**CHAT, "tools": tools, "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]}

    async def go():
        settings = make_settings(tmp_path, CONFIG)
        async with gateway_client(settings, httpx.ASGITransport(fake_upstream.app)) as gw:
            first = await gw.post("/v1/chat/completions", json=body, headers=auth(KEY_A))
            off = await gw.post("/v1/chat/completions", json=body, headers=auth("key-c"))
        return settings, first, off

    settings, first, off = run(go())
    canonical = fake_upstream.bodies[0]
    assert [t["function"]["name"] for t in canonical["tools"]] == ["alpha", "zeta"]
    assert list(canonical["tools"][1]) == ["function", "type"]
    assert canonical["messages"][0]["content"] == "hi"
    assert first.headers["x-prefixgate-canonicalized"] == (
        "tools.keys_sorted,tools.ordered_by_name,content.single_text_part"
    )
    # gamma switched canonicalization off: its body goes upstream as sent
    assert [t["function"]["name"] for t in fake_upstream.bodies[1]["tools"]] == ["zeta", "alpha"]
    assert "x-prefixgate-canonicalized" not in off.headers
    logged = rows(settings.db_url)
    assert logged[0].canonicalization == "tools.keys_sorted,tools.ordered_by_name,content.single_text_part"
    assert logged[1].canonicalization == ""


def test_prefix_warnings_in_header_body_and_row(tmp_path, fake_upstream):
    volatile = {**CHAT, "messages": [
        {"role": "system", "content": "Now: 2026-11-22T00:05:17Z. Request id 3f2b9c4e-8a1d-4e2f-9b7a-1c2d3e4f5a6b."},
        {"role": "user", "content": "hi"},
    ]}

    async def go():
        settings = make_settings(tmp_path, CONFIG)
        async with gateway_client(settings, httpx.ASGITransport(fake_upstream.app)) as gw:
            plain = await gw.post("/v1/chat/completions", json=CHAT, headers=auth(KEY_A))
            warned = await gw.post("/v1/chat/completions", json=volatile, headers=auth(KEY_A))
            rejected = await gw.post("/v1/chat/completions", json=volatile, headers=auth("key-s"))
        return settings, plain, warned, rejected

    settings, plain, warned, rejected = run(go())
    assert "x-prefixgate-warnings" not in plain.headers and "prefix_warnings" not in plain.json()
    codes = warned.headers["x-prefixgate-warnings"].split(",")
    assert "PS101" in codes
    found = warned.json()["prefix_warnings"]
    assert {w["code"] for w in found} == set(codes)
    assert all({"code", "message", "location"} <= set(w) for w in found)
    assert any(w["location"].startswith("messages[0]") for w in found if w["code"] == "PS101")
    assert rejected.status_code == 400
    error = rejected.json()["error"]
    assert error["code"] == "prefix_warning_rejected" and "PS101" in error["message"]
    assert len(fake_upstream.bodies) == 2  # the rejected request never reached the upstream
    logged = rows(settings.db_url)
    assert [r.status for r in logged] == [200, 200, 400]
    assert "PS101" in logged[1].warning_codes.split(",") and logged[0].warning_codes == ""


def test_history_rewrite_between_turns_is_warned(tmp_path, fake_upstream):
    turn1 = {"model": "fake-model", "messages": [
        {"role": "system", "content": "You are a helpful assistant for the billing team."},
        {"role": "user", "content": "What is my balance?"},
        {"role": "assistant", "content": "Your balance is 12 euros."},
        {"role": "user", "content": "And last month?"},
    ]}
    edited = {**turn1, "messages": [*turn1["messages"][:2],
                                    {"role": "assistant", "content": "Balance: 12 EUR."},
                                    turn1["messages"][3], {"role": "user", "content": "thanks"}]}

    async def go():
        async with gateway_client(make_settings(tmp_path, CONFIG), httpx.ASGITransport(fake_upstream.app)) as gw:
            thread = {CONVERSATION_HEADER: "thread-7"}
            first = await gw.post("/v1/chat/completions", json=turn1, headers={**auth(KEY_A), **thread})
            second = await gw.post("/v1/chat/completions", json=edited, headers={**auth(KEY_A), **thread})
            other_tenant = await gw.post("/v1/chat/completions", json=edited, headers={**auth(KEY_B), **thread})
        return first, second, other_tenant

    first, second, other_tenant = run(go())
    assert "x-prefixgate-warnings" not in first.headers
    assert any(code.startswith("PS2") for code in second.headers["x-prefixgate-warnings"].split(","))
    # history is per tenant: beta never saw turn 1
    assert "x-prefixgate-warnings" not in other_tenant.headers


def test_unrelated_requests_starting_with_hi_get_no_cross_request_warning(tmp_path, fake_upstream):
    system = {"role": "system", "content": "You are a helpful assistant for the billing team."}
    hi = {"role": "user", "content": "hi"}
    first = {"model": "fake-model", "messages": [system, hi, {"role": "assistant", "content": "Hello!"},
                                                  {"role": "user", "content": "What is my balance?"}]}
    second = {"model": "fake-model", "tool_choice": "none", "messages": [
        system, hi, {"role": "assistant", "content": "Hi, how can I help?"}, {"role": "user", "content": "Cancel my plan."}]}

    async def go():
        async with gateway_client(make_settings(tmp_path, CONFIG), httpx.ASGITransport(fake_upstream.app)) as gw:
            return [await gw.post("/v1/chat/completions", json=body, headers=auth(KEY_A)) for body in (first, second)]

    for response in run(go()):
        assert response.status_code == 200
        codes = response.headers.get("x-prefixgate-warnings", "")
        assert not [c for c in codes.split(",") if c.startswith("PS2")], codes


def test_auth_with_config(tmp_path, fake_upstream):
    async def go():
        settings = make_settings(tmp_path, CONFIG)
        async with gateway_client(settings, httpx.ASGITransport(fake_upstream.app)) as gw:
            missing = await gw.post("/v1/chat/completions", json=CHAT)
            wrong = await gw.post("/v1/chat/completions", json=CHAT, headers=auth("nope"))
            models_bad = await gw.get("/v1/models", headers=auth("nope"))
            models = await gw.get("/v1/models", headers=auth(KEY_B))
            stats_tenant = await gw.get("/v1/cache/stats", headers=auth(KEY_A))
            stats = await gw.get("/v1/cache/stats", headers=auth(ADMIN))
        return settings, missing, wrong, models_bad, models, stats_tenant, stats

    settings, missing, wrong, models_bad, models, stats_tenant, stats = run(go())
    for response in (missing, wrong, models_bad):
        assert response.status_code == 401
        assert response.json()["error"]["type"] == "authentication_error"
    # A valid tenant key on an admin endpoint: a permission error, not "invalid key".
    assert stats_tenant.status_code == 403
    assert stats_tenant.json()["error"]["type"] == "permission_error"
    assert stats_tenant.json()["error"]["code"] == "admin_key_required"
    assert models.json()["data"][0]["id"] == "fake-model"
    body = stats.json()
    assert body["tenants"]["(unauthenticated)"]["requests"] == 2
    assert body["tenants"]["(unauthenticated)"]["errors"] == 2
    assert fake_upstream.bodies == []
    logged = rows(settings.db_url)
    assert [(r.tenant, r.status, r.model) for r in logged] == [(None, 401, None), (None, 401, None)]


def test_open_mode_gives_each_token_its_own_tenant(tmp_path, fake_upstream):
    async def go():
        settings = make_settings(tmp_path, None)
        async with gateway_client(settings, httpx.ASGITransport(fake_upstream.app)) as gw:
            for key in ("one", "two", "one"):
                assert (await gw.post("/v1/chat/completions", json=CHAT, headers=auth(key))).status_code == 200
            anonymous = await gw.post("/v1/chat/completions", json=CHAT)
            stats = await gw.get("/v1/cache/stats")
        return settings, anonymous, stats

    settings, anonymous, stats = run(go())
    salts = [body["cache_salt"] for body in fake_upstream.bodies]
    assert salts[0] == salts[2] != salts[1]
    assert anonymous.status_code == 200 and salts[3] not in salts[:3]
    assert stats.status_code == 403  # no admin key configured
    tenants = [r.tenant for r in rows(settings.db_url)]
    assert tenants[0] == tenants[2] != tenants[1] and tenants[3] == "anonymous"


def test_usage_without_cached_tokens_is_unknown_not_zero(tmp_path, fake_upstream):
    fake_upstream.mode = "no_cached"

    async def go():
        settings = make_settings(tmp_path, CONFIG)
        async with gateway_client(settings, httpx.ASGITransport(fake_upstream.app)) as gw:
            response = await gw.post("/v1/chat/completions", json=CHAT, headers=auth(KEY_A))
            stats = await gw.get("/v1/cache/stats", headers=auth(ADMIN))
        return settings, response, stats

    settings, response, stats = run(go())
    assert response.status_code == 200
    (row,) = rows(settings.db_url)
    assert row.prompt_tokens > 0 and row.cached_tokens is None
    alpha = stats.json()["tenants"]["alpha"]
    assert alpha["hit_rate"] is None and alpha["requests_with_unknown_cached_tokens"] == 1


def test_streaming_relays_chunks_strips_injected_usage_and_records_it(tmp_path, fake_upstream):
    volatile = {**CHAT, "stream": True, "messages": [
        {"role": "system", "content": "Session 3f2b9c4e-8a1d-4e2f-9b7a-1c2d3e4f5a6b"},
        {"role": "user", "content": "hi"},
    ]}

    async def go():
        settings = make_settings(tmp_path, CONFIG)
        async with gateway_client(settings, httpx.ASGITransport(fake_upstream.app)) as gw:
            plain = await gw.post("/v1/chat/completions", json=volatile, headers=auth(KEY_A))
            with_usage = await gw.post(
                "/v1/chat/completions",
                json={**volatile, "stream_options": {"include_usage": True}}, headers=auth(KEY_A),
            )
        return settings, plain, with_usage

    settings, plain, with_usage = run(go())
    assert fake_upstream.bodies[0]["stream_options"] == {"include_usage": True}
    events = sse_events(plain.text)
    assert events[-1] == "data: [DONE]"
    chunks = [orjson.loads(e[len("data: "):]) for e in events[:-1]]
    assert all("usage" not in c for c in chunks), "the injected usage must not reach the client"
    assert all(c["choices"] for c in chunks)
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks) == "hello!"
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"
    assert "PS101" in {w["code"] for w in chunks[-1]["prefix_warnings"]}
    assert "PS101" in plain.headers["x-prefixgate-warnings"]
    asked = sse_data(with_usage.text)
    assert asked[-1]["choices"] == [] and asked[-1]["usage"]["prompt_tokens"] > 0
    assert "prefix_warnings" in asked[-1]
    logged = rows(settings.db_url)
    assert [r.status for r in logged] == [200, 200]
    assert all(r.stream and r.prompt_tokens > 0 and r.cached_tokens == 16 and r.ttft_ms is not None for r in logged)


def test_completions_endpoint_and_upstream_4xx_passthrough(tmp_path, fake_upstream):
    async def go():
        settings = make_settings(tmp_path, CONFIG)
        async with gateway_client(settings, httpx.ASGITransport(fake_upstream.app)) as gw:
            completion = await gw.post("/v1/completions", json={"model": "fake-model", "prompt": "Hello"},
                                       headers=auth(KEY_A))
            missing = await gw.post("/v1/chat/completions", json={**CHAT, "model": "missing-model"},
                                    headers=auth(KEY_A))
        return settings, completion, missing

    settings, completion, missing = run(go())
    assert completion.status_code == 200
    assert fake_upstream.bodies[0]["prompt"] == "Hello" and "cache_salt" in fake_upstream.bodies[0]
    assert missing.status_code == 404
    assert missing.json()["error"]["code"] == "model_not_found"
    assert [(r.endpoint, r.status) for r in rows(settings.db_url)] == [("completions", 200), ("chat.completions", 404)]


def test_health_and_metrics(tmp_path, fake_upstream):
    async def go():
        async with gateway_client(make_settings(tmp_path, CONFIG), httpx.ASGITransport(fake_upstream.app)) as gw:
            await gw.post("/v1/chat/completions", json=CHAT, headers=auth(KEY_A))
            scrapes = [await gw.get("/metrics", headers=headers) for headers in ({}, auth("nope"), auth(KEY_A))]
            return await gw.get("/health"), await gw.get("/metrics", headers=auth(ADMIN)), await gw.get("/nope"), scrapes

    health, metrics, missing, refused = run(go())
    assert health.json() == {"status": "ok", "upstream": "ok"}
    # Every tenant's totals move in /metrics: only an admin key reads them.
    assert [r.status_code for r in refused] == [401, 401, 403]
    assert refused[0].json()["error"]["type"] == "authentication_error" and "--metrics-port" in refused[0].text
    assert "prefixgate_" not in "".join(r.text for r in refused)
    assert metrics.status_code == 200
    text = metrics.text
    assert 'prefixgate_requests_total{endpoint="chat.completions",status="200"} 1.0' in text
    assert "prefixgate_cached_tokens_total 16.0" in text
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "not_found"


def test_metrics_port_serves_metrics_without_a_key_on_its_own_port(tmp_path, fake_upstream):
    import dataclasses

    from gateway.server.app import create_app

    metrics_port = free_port()
    with serve_in_thread(fake_upstream.app) as upstream:
        settings = dataclasses.replace(make_settings(tmp_path, upstream=upstream), metrics_port=metrics_port)
        with serve_in_thread(create_app(settings)) as url:
            assert httpx.post(url + "/v1/chat/completions", json=CHAT, headers=auth("me")).status_code == 200
            assert httpx.get(url + "/metrics").status_code == 401  # open mode: no admin key exists
            scrape = httpx.get(f"http://127.0.0.1:{metrics_port}/metrics")
            other = httpx.get(f"http://127.0.0.1:{metrics_port}/v1/cache/stats")
    assert scrape.status_code == 200
    assert 'prefixgate_requests_total{endpoint="chat.completions",status="200"} 1.0' in scrape.text
    assert 'prefixgate_replica_healthy{replica="r0"} 1.0' in scrape.text
    assert other.status_code == 404


def _png_url(seed: int, side: int) -> str:
    import base64
    import io
    import random

    from PIL import Image

    image = Image.frombytes("RGB", (side, side), random.Random(seed).randbytes(side * side * 3))
    out = io.BytesIO()
    image.save(out, format="PNG")
    return "data:image/png;base64," + base64.b64encode(out.getvalue()).decode()


def test_an_image_changed_between_turns_is_warned_with_the_tokens_lost(tmp_path, fake_upstream):
    """Small images are checked in a thread, large bodies (over 64 KB) in the helper process: both."""
    question = {"type": "text", "text": "What is in this picture? Please describe it in detail."}

    def turns(first: str, second: str) -> tuple[dict, dict]:
        one = {"model": "fake-model", "messages": [{"role": "user", "content": [question, {
            "type": "image_url", "image_url": {"url": first}}]}]}
        two = {"model": "fake-model", "messages": [
            {"role": "user", "content": [question, {"type": "image_url", "image_url": {"url": second}}]},
            {"role": "assistant", "content": "Noise."}, {"role": "user", "content": "Which colours?"}]}
        return one, two

    async def go():
        results = []
        async with gateway_client(make_settings(tmp_path, CONFIG), httpx.ASGITransport(fake_upstream.app)) as gw:
            for n, side in enumerate((24, 200)):
                a, b = _png_url(2 * n, side), _png_url(2 * n + 1, side)
                for first, second, thread in ((a, a, f"same-{n}"), (a, b, f"other-{n}")):
                    one, two = turns(first, second)
                    headers = {**auth(KEY_A), CONVERSATION_HEADER: thread}
                    await gw.post("/v1/chat/completions", json=one, headers=headers)
                    results.append((side, first == second, await gw.post("/v1/chat/completions", json=two,
                                                                         headers=headers)))
        return results

    for side, same, response in run(go()):
        assert response.status_code == 200
        found = [w for w in response.json().get("prefix_warnings", []) if w["code"].startswith("PS2")]
        if same:
            assert found == [], (side, found)
            continue
        (warning,) = found
        assert warning["code"] == "PS207" and warning["location"] == "messages[0].content[1]", (side, warning)
        assert warning["tokens_lost"] >= 255 - 16  # at least the image's own estimate (one 512-px tile)


def test_large_bodies_are_parsed_and_canonicalized_off_the_event_loop(tmp_path, fake_upstream, monkeypatch):
    """Past 64 KiB, parsing, canonicalization and encoding the upstream body run on a
    thread (they grow with the body); small bodies stay on the loop (a hand-off costs
    more than they do). The answer is the same either way."""
    import gateway.proxy.handler as proxy

    seen: list[tuple[int, bool]] = []
    real = proxy.canonicalize

    def watched(body, switches):
        seen.append((len(body["messages"]), asyncio._get_running_loop() is not None))
        return real(body, switches)

    monkeypatch.setattr(proxy, "canonicalize", watched)
    small = {"model": "fake-model", "messages": [{"role": "user", "content": "hi"}]}
    large = {"model": "fake-model", "messages": [{"role": "user", "content": f"word {i}"} for i in range(8000)]}
    assert len(orjson.dumps(large)) > proxy.LOOP_MAX_BODY_BYTES

    async def go():
        async with gateway_client(make_settings(tmp_path, CONFIG), httpx.ASGITransport(fake_upstream.app)) as gw:
            return [await gw.post("/v1/chat/completions", json=body, headers=auth(KEY_A)) for body in (small, large)]

    answers = run(go())
    assert [a.status_code for a in answers] == [200, 200]
    assert seen == [(1, True), (8000, False)]
