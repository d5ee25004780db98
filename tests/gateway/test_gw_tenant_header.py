"""The gateway names the tenant to an engine-kind upstream in ``x-prefixgate-tenant``
(the engine's fair prefill sharing and body budgets are keyed by it), whatever the
client sent in that header; hosted OpenAI and llama.cpp upstreams never see it."""

from __future__ import annotations

import asyncio
import dataclasses

import httpx
import orjson
import pytest
from gw_fakes import gateway_client, make_settings

from engine.contract.body_reader import TENANT_HEADER
from gateway.policy.api_key import hash_key

KEY = "pg-acme-key-0123"
CHAT = {"id": "chatcmpl-1", "object": "chat.completion", "model": "m", "created": 0,
        "choices": [{"index": 0, "message": {"role": "assistant", "content": "hi"}, "finish_reason": "stop"}],
        "usage": {"prompt_tokens": 5, "completion_tokens": 1, "total_tokens": 6}}
CHUNK = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "model": "m", "created": 0,
         "choices": [{"index": 0, "delta": {"content": "hi"}, "finish_reason": "stop"}],
         "usage": {"prompt_tokens": 5, "completion_tokens": 1, "total_tokens": 6}}


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize(("kind", "expected"), [("vllm", "acme"), ("openai", None), ("llamacpp", None)])
def test_the_tenant_header_goes_to_engine_kind_upstreams_only(tmp_path, kind, expected, stream) -> None:
    seen: list[str | None] = []

    def upstream(request: httpx.Request) -> httpx.Response:
        seen.append(request.headers.get(TENANT_HEADER))
        if orjson.loads(request.content).get("stream"):
            body = b"data: " + orjson.dumps(CHUNK) + b"\n\ndata: [DONE]\n\n"
            return httpx.Response(200, content=body, headers={"content-type": "text/event-stream"})
        return httpx.Response(200, json=CHAT)

    settings = dataclasses.replace(
        make_settings(tmp_path, {"tenants": {"acme": {"keys": [hash_key(KEY)], "isolation": "shared"}}}),
        upstream_kind=kind)

    async def go() -> None:
        async with gateway_client(settings, httpx.MockTransport(upstream)) as client:
            for claimed in (None, "someone-else"):
                headers = {"authorization": f"Bearer {KEY}"}
                if claimed is not None:
                    headers[TENANT_HEADER] = claimed
                answer = await client.post("/v1/chat/completions", headers=headers, json={
                    "model": "m", "stream": stream, "messages": [{"role": "user", "content": "hi"}]})
                assert answer.status_code == 200, answer.text

    asyncio.run(go())
    assert seen == [expected, expected]
