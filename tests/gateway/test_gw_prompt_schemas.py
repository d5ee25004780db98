"""The prompt schema routes in front of an upstream kind that has none: 404 ``not_supported``,
in OpenAI's error shape, after authentication (the engine-backed routes are tested with
the real engine in tests/engine/server/test_engine_http_prompt_modules_gateway.py)."""

from __future__ import annotations

import asyncio
import dataclasses

from gw_fake_openai import FakeOpenAI
from test_gw_openai_upstream import KEYS, gateway, openai_settings


def test_schema_routes_need_a_prefixgate_engine_upstream(tmp_path):
    async def run() -> None:
        async with gateway(openai_settings(tmp_path), FakeOpenAI()) as client:
            auth = {"authorization": f"Bearer {KEYS['acme']}"}
            for method, path in (("POST", "/v1/prompt_schemas"), ("GET", "/v1/prompt_schemas"),
                                 ("DELETE", "/v1/prompt_schemas/docs")):
                response = await client.request(method, path, headers=auth,
                                                json={"pml": "<schema name='s'/>"} if method == "POST" else None)
                assert response.status_code == 404, response.text
                assert response.json()["error"]["code"] == "not_supported"
            anonymous = await client.get("/v1/prompt_schemas")
            assert anonymous.status_code == 401

    asyncio.run(run())


def test_bad_client_salt_is_a_400_naming_it(tmp_path):
    async def run() -> None:
        settings = dataclasses.replace(openai_settings(tmp_path), upstream_kind="vllm")
        async with gateway(settings, FakeOpenAI()) as client:
            auth = {"authorization": f"Bearer {KEYS['acme']}"}
            response = await client.post("/v1/prompt_schemas", headers=auth,
                                         json={"pml": "<schema name='s'/>", "cache_salt": 5})
            assert response.status_code == 400 and response.json()["error"]["param"] == "cache_salt"
            response = await client.post("/v1/prompt_schemas", headers={**auth, "content-type": "application/json"},
                                         content=b"[1]")
            assert response.status_code == 400 and response.json()["error"]["code"] == "invalid_json"

    asyncio.run(run())
