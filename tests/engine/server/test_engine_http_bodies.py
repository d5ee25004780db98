"""Request bodies on the engine's own port, over real HTTP: 415 for anything but JSON,
the read timeout for a stalled upload, and the bytes of bodies in flight per tenant
(``x-prefixgate-tenant``) and overall. The reader itself: test_body_reader.py."""

from __future__ import annotations

import socket

import httpx
import openai
import pytest
from test_engine_http_fixtures import serve, wait_until

from engine.contract.body_reader import TENANT_HEADER, BodyLimits

PATHS = ("/v1/chat/completions", "/v1/completions", "/v1/responses")


@pytest.fixture
def live(tiny_engine):
    limits = BodyLimits(max_bytes=1_000_000, tenant_inflight_bytes=100_000, inflight_bytes=150_000,
                        idle_timeout_s=1.5)
    with serve(tiny_engine, body_limits=limits) as server:
        yield server


def chat(model: str, pad: int = 0) -> dict:
    body = {"model": model, "max_tokens": 1, "messages": [{"role": "user", "content": "hi"}]}
    return {**body, "pad": "x" * pad} if pad else body  # an unknown field: only its bytes count


@pytest.mark.parametrize("content_type", [None, "text/plain", "application/x-www-form-urlencoded",
                                          "multipart/form-data; boundary=x"])
def test_json_routes_answer_415_to_other_content_types(live, tiny_engine, content_type):
    headers = {} if content_type is None else {"content-type": content_type}
    raw = b'{"model": "%s", "prompt": "hi", "input": "hi", "max_tokens": 1}' % tiny_engine.model_id.encode()
    for path in PATHS:
        response = httpx.post(live.base_url + path, content=raw, headers=headers)
        assert response.status_code == 415, response.text
        assert response.json()["error"] == {"message": response.json()["error"]["message"],
                                            "type": "invalid_request_error", "param": None,
                                            "code": "unsupported_media_type"}


def test_json_with_a_charset_and_the_sdk_are_served(live, tiny_engine):
    response = httpx.post(live.base_url + "/v1/completions", content=b'{"prompt": "hi", "max_tokens": 1}',
                          headers={"content-type": "application/json; charset=utf-8"})
    assert response.status_code == 200, response.text
    client = openai.OpenAI(base_url=live.api_url, api_key="x", max_retries=0)
    assert client.chat.completions.create(**chat(tiny_engine.model_id)).usage.completion_tokens == 1


def _stall(live, tenant: str, declared: int) -> socket.socket:
    port = int(live.base_url.rsplit(":", 1)[1])
    sock = socket.create_connection(("127.0.0.1", port))
    sock.sendall(f"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                 f"{TENANT_HEADER}: {tenant}\r\ncontent-length: {declared}\r\n\r\n{{".encode())
    return sock


def _status_of(sock: socket.socket) -> int:
    sock.settimeout(30)
    head = sock.recv(4096)
    sock.close()
    return int(head.split()[1])


def test_bodies_in_flight_are_bounded_and_a_stalled_upload_times_out(live, tiny_engine):
    reader = live.server.config.app.state.handler.bodies
    stalled = [_stall(live, "a", 45_000) for _ in range(2)]
    wait_until(lambda: reader.in_flight == 90_000, 30, "the stalled uploads' declared bytes to be held")
    url = live.base_url + "/v1/chat/completions"
    same = httpx.post(url, json=chat(tiny_engine.model_id, 20_000), headers={TENANT_HEADER: "a"})
    assert same.status_code == 429 and same.json()["error"]["code"] == "body_budget_exceeded"
    other = httpx.post(url, json=chat(tiny_engine.model_id, 1_000), headers={TENANT_HEADER: "b"})
    assert other.status_code == 200, other.text
    full = httpx.post(url, json=chat(tiny_engine.model_id, 70_000), headers={TENANT_HEADER: "b"})
    assert full.status_code == 503 and full.json()["error"]["code"] == "server_overloaded"
    assert [_status_of(sock) for sock in stalled] == [408, 408]
    assert reader.in_flight == 0
    reader.check_integrity()
    again = httpx.post(url, json=chat(tiny_engine.model_id, 70_000), headers={TENANT_HEADER: "a"})
    assert again.status_code == 200, again.text
    assert reader.in_flight == 0
