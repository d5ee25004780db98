"""Request bodies through the gateway: 415 for anything but JSON, read timeouts, the bytes
of bodies in flight per tenant and overall, and nothing of a refused body kept afterwards.

The process RSS figures around bursts live in benchmarks/gateway_memory.py; here the
mechanisms are asserted: what holds a body after its request ended, and the budget."""

from __future__ import annotations

import asyncio
import gc
import socket
import time
import types

import httpx
import openai
import orjson
import pytest
from gw_fakes import FakeUpstream, gateway_client, make_settings, rows, serve_in_thread

from gateway.policy.api_key import hash_key
from gateway.proxy.handler import Proxy
from gateway.server.app import create_app

KEYS = {"alpha": "key-alpha", "beta": "key-beta"}
CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


def config(**server):
    return {"server": server, "tenants": {name: {"keys": [hash_key(key)], "warnings": False}
                                          for name, key in KEYS.items()}}


def auth(tenant: str = "alpha") -> dict[str, str]:
    return {"authorization": f"Bearer {KEYS[tenant]}"}


@pytest.mark.parametrize("content_type", [None, "text/plain", "text/plain; charset=utf-8",
                                          "application/x-www-form-urlencoded", "multipart/form-data"])
def test_json_routes_answer_415_to_other_content_types(tmp_path, fake_upstream, content_type):
    """A page cannot make a browser send a JSON body as a "simple" (preflight-free) request."""
    settings = make_settings(tmp_path, config())
    headers = auth() if content_type is None else {**auth(), "content-type": content_type}

    async def go():
        async with gateway_client(settings, httpx.ASGITransport(fake_upstream.app)) as gw:
            return [await gw.post(path, content=b'{"model": "m", "prompt": "x", "input": "x", "messages": '
                                  b'[{"role": "user", "content": "hi"}]}', headers=headers)
                    for path in ("/v1/chat/completions", "/v1/completions", "/v1/responses")]

    for response in asyncio.run(go()):
        assert response.status_code == 415, response.text
        assert response.json() == {"error": {
            "message": response.json()["error"]["message"], "type": "invalid_request_error", "param": None,
            "code": "unsupported_media_type"}}
    assert fake_upstream.bodies == []
    assert [row.status for row in rows(settings.db_url)] == [415, 415, 415]


def test_json_with_parameters_and_the_sdk_pass(tmp_path, fake_upstream):
    settings = make_settings(tmp_path, config())

    async def go():
        async with gateway_client(settings, httpx.ASGITransport(fake_upstream.app)) as gw:
            with_charset = await gw.post("/v1/chat/completions", json=CHAT,
                                         headers={**auth(), "content-type": "application/json; charset=utf-8"})
            sdk = openai.AsyncOpenAI(base_url="http://gw/v1", api_key=KEYS["beta"], http_client=gw, max_retries=0)
            completion = await sdk.chat.completions.create(**CHAT)
            return with_charset, completion

    with_charset, completion = asyncio.run(go())
    assert with_charset.status_code == 200 and completion.choices[0].message.content == "hi!"
    assert len(fake_upstream.bodies) == 2


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("mode", ["error429", "error500"])
def test_a_refused_request_leaves_no_frame_holding_its_body(tmp_path, fake_upstream, mode, stream):
    """With the cyclic collector off (the gateway runs it rarely, see settle_heap), a request
    the upstream refused must be freed by reference counting alone: no frame of
    ``Proxy._handle`` (whose locals hold the body three times over) may outlive it."""
    fake_upstream.mode = mode
    settings = make_settings(tmp_path, config())
    big = {**CHAT, "messages": [{"role": "user", "content": "x" * 200_000}], "stream": stream}

    def handle_frames() -> int:
        return sum(1 for o in gc.get_objects()
                   if isinstance(o, types.FrameType) and o.f_code is Proxy._handle.__code__)

    async def go():
        async with gateway_client(settings, httpx.ASGITransport(fake_upstream.app)) as gw:
            statuses = [(await gw.post("/v1/chat/completions", json=big, headers=auth())).status_code
                        for _ in range(5)]
            reader = gw._transport.app.state.gateway.proxy.bodies  # type: ignore[attr-defined]
            reader.check_integrity()
            return statuses, handle_frames(), reader.in_flight

    gc.collect()
    gc.disable()
    try:
        statuses, frames, in_flight = asyncio.run(go())
    finally:
        gc.enable()
    assert statuses == [429 if mode == "error429" else 502] * 5
    assert frames == 0
    assert in_flight == 0


def _stall(url: str, tenant: str, declared: int, sent: bytes) -> socket.socket:
    """A connection that sends ``sent`` of a declared ``declared``-byte body, then nothing."""
    host, port = url.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)))
    sock.sendall(f"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                 f"authorization: Bearer {KEYS[tenant]}\r\ncontent-length: {declared}\r\n\r\n".encode() + sent)
    return sock


def _status_of(sock: socket.socket) -> int:
    sock.settimeout(30)
    head = sock.recv(4096)
    sock.close()
    return int(head.split()[1])


def test_bodies_in_flight_are_bounded_per_tenant_and_overall_and_stalls_time_out(tmp_path):
    """Real HTTP: two stalled uploads fill alpha's share (429 for alpha's next request
    while beta is served), a third tenant-less fill of the server's whole budget is a 503;
    the stalls end as 408 after the idle timeout, with a row each, and the budget is free."""
    upstream = FakeUpstream()
    settings_config = config(tenant_inflight_body_bytes=100_000, inflight_body_bytes=150_000,
                             body_idle_timeout_s=1.5)
    with serve_in_thread(upstream.app) as upstream_url:
        settings = make_settings(tmp_path, settings_config, upstream=upstream_url)
        app = create_app(settings)
        reader = app.state.gateway.proxy.bodies
        with serve_in_thread(app) as url:
            stalled = [_stall(url, "alpha", 45_000, b'{"model": ') for _ in range(2)]
            with httpx.Client(base_url=url, timeout=30) as client:
                statuses = [client.post("/v1/chat/completions", json=CHAT, headers=auth("beta")).status_code]
                # The stalls' declared 90,000 bytes are held once their headers are read.
                deadline = time.monotonic() + 30
                while reader.in_flight != 90_000:
                    assert time.monotonic() < deadline, reader.in_flight
                    time.sleep(0.01)
                alpha = client.post("/v1/chat/completions", json={**CHAT, "pad": "x" * 20_000}, headers=auth())
                assert alpha.status_code == 429 and alpha.json()["error"]["code"] == "body_budget_exceeded"
                assert alpha.json()["error"]["type"] == "rate_limit_error"
                beta = client.post("/v1/chat/completions", json={**CHAT, "pad": "x" * 70_000}, headers=auth("beta"))
                assert beta.status_code == 503 and beta.json()["error"]["code"] == "server_overloaded"
                statuses += [_status_of(sock) for sock in stalled]
                assert statuses == [200, 408, 408]
                assert reader.in_flight == 0
                reader.check_integrity()
                after = client.post("/v1/chat/completions", json={**CHAT, "pad": "x" * 90_000}, headers=auth())
                assert after.status_code == 200
    by_status = sorted(row.status for row in rows(settings.db_url))
    assert by_status == [200, 200, 408, 408, 429, 503]


def test_a_large_body_parsed_in_pieces_is_answered_as_one_parsed_whole(tmp_path, fake_upstream, monkeypatch):
    """A 40,000-message body (past piecewise_json's threshold) reaches the upstream exactly as
    when it is parsed by one orjson.loads, and a broken one gets the same 400."""
    from engine.contract import piecewise_json

    messages = [{"role": "user" if i % 2 == 0 else "assistant", "content": f"n {i}" + ' "]}},[{ \\ é ✓'}
                for i in range(40_000)]
    raw = orjson.dumps({"model": "m", "max_tokens": 1, "messages": messages,
                        "tools": [{"type": "function", "function": {"name": f"f{i}", "parameters": {
                            "type": "object", "properties": {"a": {"type": "string"}}}}} for i in range(3000)]})
    middle = raw.index(b"},{", len(raw) // 2)
    broken = raw[:middle] + b"},,{" + raw[middle + 3:]  # a stray comma between two messages
    assert len(raw) > 4 * piecewise_json.PIECED_ABOVE_BYTES and piecewise_json._plan(raw) is not None
    settings = make_settings(tmp_path, config())

    async def go():
        async with gateway_client(settings, httpx.ASGITransport(fake_upstream.app)) as gw:
            headers = {**auth(), "content-type": "application/json"}
            return [await gw.post("/v1/chat/completions", content=body, headers=headers) for body in (raw, broken)]

    pieced = asyncio.run(go())
    monkeypatch.setattr(piecewise_json, "PIECED_ABOVE_BYTES", 1 << 40)  # one orjson.loads, as before
    whole = asyncio.run(go())
    assert [r.status_code for r in pieced] == [r.status_code for r in whole] == [200, 400]
    assert pieced[0].json() == whole[0].json()
    assert pieced[1].json() == whole[1].json()
    assert pieced[1].json()["error"]["code"] == "invalid_json"
    assert len(fake_upstream.bodies) == 2 and fake_upstream.bodies[0] == fake_upstream.bodies[1]
    assert fake_upstream.bodies[0]["messages"] == messages
