"""Malformed client input gets a 4xx in OpenAI's shape (never a 500), and a row."""

from __future__ import annotations

import asyncio

import httpx
import pytest
from gw_fakes import gateway_client, make_settings, rows

from gateway.policy.api_key import hash_key

CONFIG = {"server": {"max_body_bytes": 8192}, "tenants": {"alpha": {"keys": [hash_key("k")]}}}
HEADERS = {"authorization": "Bearer k", "content-type": "application/json"}
MESSAGES = [{"role": "user", "content": "hi"}]

def _nested_tools(depth: int) -> bytes:
    """A chat body whose first tool's parameters nest ``depth`` objects deep."""
    parameters = b'{"a": ' * depth + b"1" + b"}" * depth
    return (b'{"model": "m", "messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "function", '
            b'"function": {"name": "f", "parameters": ' + parameters + b"}}]}")


CASES = [
    ("not json", b"{\"model\": ", 400, None),
    ("array", b"[1, 2]", 400, None),
    ("no model", b'{"messages": [{"role": "user", "content": "x"}]}', 400, "model"),
    ("model type", b'{"model": 7, "messages": []}', 400, "model"),
    ("messages type", b'{"model": "m", "messages": "hello"}', 400, "messages"),
    ("empty messages", b'{"model": "m", "messages": []}', 400, "messages"),
    ("message type", b'{"model": "m", "messages": [3]}', 400, "messages[0]"),
    ("role type", b'{"model": "m", "messages": [{"role": 1}]}', 400, "messages[0].role"),
    ("stream type", b'{"model": "m", "messages": [{"role": "user"}], "stream": "yes"}', 400, "stream"),
    ("tools type", b'{"model": "m", "messages": [{"role": "user"}], "tools": {}}', 400, "tools"),
    ("salt type", b'{"model": "m", "messages": [{"role": "user"}], "cache_salt": 5}', 400, "cache_salt"),
    ("salt empty", b'{"model": "m", "messages": [{"role": "user"}], "cache_salt": ""}', 400, "cache_salt"),
    ("salt long", b'{"model": "m", "messages": [{"role": "user"}], "cache_salt": "' + b"s" * 1025 + b'"}',
     400, "cache_salt"),
    ("utf8", b'{"model": "\xff\xfe", "messages": []}', 400, None),
    ("utf8 in content", b'{"model": "m", "messages": [{"role": "user", "content": "a\xc3"}]}', 400, None),
    ("lone surrogate", b'{"model": "m", "messages": [{"role": "user", "content": "\\ud800"}]}', 400, None),
    ("huge number", b'{"model": "m", "messages": [{"role": "user"}], "temperature": 1e400}', 400, None),
    *[(f"tools {depth} deep", _nested_tools(depth), 400, "tools") for depth in (130, 254, 300, 1000)],
    ("messages 260 deep", b'{"model": "m", "messages": [{"role": "user", "content": '
     + b"[" * 260 + b"]" * 260 + b"}]}", 400, "messages"),
    ("body 1100 deep", b'{"model": "m", "x": ' + b"[" * 1100 + b"]" * 1100 + b"}", 400, None),
    ("oversized", b'{"model": "m", "messages": [{"role": "user", "content": "' + b"x" * 9000 + b'"}]}',
     413, None),
]


@pytest.mark.parametrize(("name", "raw", "status", "param"), CASES, ids=[c[0] for c in CASES])
def test_bad_body_is_a_clean_4xx(tmp_path, fake_upstream, name, raw, status, param):
    async def go():
        settings = make_settings(tmp_path, CONFIG)
        async with gateway_client(settings, httpx.ASGITransport(fake_upstream.app)) as gw:
            return settings, await gw.post("/v1/chat/completions", content=raw, headers=HEADERS)

    settings, response = asyncio.run(go())
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["param"] == param and error["message"]
    assert fake_upstream.bodies == []
    (row,) = rows(settings.db_url)
    assert (row.status, row.tenant) == (status, "alpha")


def test_completions_without_prompt_and_wrong_method(tmp_path, fake_upstream):
    async def go():
        async with gateway_client(make_settings(tmp_path, CONFIG), httpx.ASGITransport(fake_upstream.app)) as gw:
            no_prompt = await gw.post("/v1/completions", json={"model": "m"}, headers=HEADERS)
            get_chat = await gw.get("/v1/chat/completions", headers=HEADERS)
        return no_prompt, get_chat

    no_prompt, get_chat = asyncio.run(go())
    assert no_prompt.status_code == 400 and no_prompt.json()["error"]["param"] == "prompt"
    assert get_chat.status_code == 405 and get_chat.json()["error"]["code"] == "method_not_allowed"


def test_streamed_oversized_body_without_content_length(tmp_path, fake_upstream):
    async def body():
        for _ in range(10):
            yield b"x" * 1000

    async def go():
        async with gateway_client(make_settings(tmp_path, CONFIG), httpx.ASGITransport(fake_upstream.app)) as gw:
            return await gw.post("/v1/chat/completions", content=body(), headers=HEADERS)

    response = asyncio.run(go())
    assert response.status_code == 413
    assert response.json()["error"]["code"] == "request_too_large"
