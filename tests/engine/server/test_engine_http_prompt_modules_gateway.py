"""Prompt schemas through the gateway: two tenants, one engine, neither sees the other's schemas.

The tiny engine and the gateway (open mode: every key an isolated tenant) on
loopback, the official openai SDK for completions. The gateway replaces whatever
cache_salt a client sends with the one it derives for the tenant, for the schema
routes as for completions, so a tenant's ``<prompt schema=...>`` finds only its own
schemas, and a client salt only narrows the tenant's own namespace.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import httpx
import openai
import pytest
from test_engine_http_fixtures import serve, wait_until
from test_engine_http_fuzz import _Gateway

from gateway.server.settings import GatewaySettings
from gateway.stats.database import default_db_url, upgrade

KEY = "pml-engine-key"
ALICE, BOB = "alice-key-0123456789", "bob-key-0123456789"
DOC = "The harbour closes at dusk; boats must be moored at the north pier before then. " * 3
SCHEMA = f'<schema name="rag"><module name="doc">{DOC}</module></schema>'
PROMPT = '<prompt schema="rag"><doc/>When does the harbour close?</prompt>'


@dataclass
class Stack:
    engine_url: str
    gateway_url: str
    db_url: str
    gateway: Any  # the gateway's GatewayState
    registry: Any  # the engine's SchemaRegistry


@pytest.fixture
def stack(tiny_engine, tmp_path):
    with serve(tiny_engine, api_key=KEY) as engine:
        db_url = default_db_url(tmp_path)
        upgrade(db_url)
        settings = GatewaySettings(upstream=engine.base_url, secret=b"pml-secret-0123456789abcdef012345",
                                   db_url=db_url, data_dir=tmp_path, upstream_api_key=KEY)
        gateway = _Gateway(settings)
        with gateway as url:
            yield Stack(engine.base_url, url, db_url, gateway.server.config.app.state.gateway,
                        engine.server.config.app.state.handler.prompt_modules.registry)


def _http(url: str, key: str) -> httpx.Client:
    return httpx.Client(base_url=url, timeout=60, headers={"authorization": f"Bearer {key}"})


def test_two_tenants_cannot_use_list_or_delete_each_others_schemas(stack, tiny_engine):
    engine_url, gateway_url, db_url = stack.engine_url, stack.gateway_url, stack.db_url
    with _http(gateway_url, ALICE) as alice, _http(gateway_url, BOB) as bob, _http(engine_url, KEY) as engine:
        created = alice.post("/v1/prompt_schemas", json={"pml": SCHEMA, "cache_salt": "ignored-by-the-gateway"})
        assert created.status_code == 200, created.text
        assert created.json()["modules"][0]["name"] == "doc"
        # Alice's client salt only narrowed her own namespace; without it she sees nothing there.
        assert alice.get("/v1/prompt_schemas").json()["data"] == []
        alice.post("/v1/prompt_schemas", json={"pml": SCHEMA})
        assert [s["name"] for s in alice.get("/v1/prompt_schemas").json()["data"]] == ["rag"]
        # Bob: nothing to list, nothing to delete, nothing to import, whatever salt he sends.
        assert bob.get("/v1/prompt_schemas").json()["data"] == []
        assert bob.get("/v1/prompt_schemas", params={"cache_salt": "ignored-by-the-gateway"}).json()["data"] == []
        refused = bob.delete("/v1/prompt_schemas/rag")
        assert refused.status_code == 404 and refused.json()["error"]["code"] == "schema_not_found"
        # The engine itself holds the schemas only under salts the gateway derived.
        assert engine.get("/v1/prompt_schemas").json()["data"] == []
    sdk = {name: openai.OpenAI(base_url=gateway_url + "/v1", api_key=key, max_retries=0, timeout=120)
           for name, key in (("alice", ALICE), ("bob", BOB))}
    with pytest.raises(openai.BadRequestError) as info:
        sdk["bob"].completions.create(model=tiny_engine.model_id, prompt=PROMPT, max_tokens=2,
                                      extra_body={"prompt_format": "pml"})
    assert "unknown schema 'rag'" in info.value.body["message"]
    out = sdk["alice"].completions.create(model=tiny_engine.model_id, prompt=PROMPT, max_tokens=2,
                                          extra_body={"prompt_format": "pml"})
    assert out.usage.prompt_tokens > 40 and out.usage.prompt_tokens_details is not None
    with _http(gateway_url, BOB) as bob, _http(gateway_url, ALICE) as alice:
        assert bob.post("/v1/prompt_schemas", json={"pml": SCHEMA.replace("dusk", "noon")}).status_code == 200
        assert alice.delete("/v1/prompt_schemas/rag").json()["deleted"] is True
        assert [s["name"] for s in bob.get("/v1/prompt_schemas").json()["data"]] == ["rag"]  # Bob's own survives
    # The generation requests left their stats rows, with the cached-token column filled.
    from sqlalchemy import select

    from gateway.stats.database import create_db_engine
    from gateway.stats.table import request_log

    def rows():
        engine = create_db_engine(db_url)
        try:
            with engine.connect() as connection:
                return connection.execute(select(request_log.c.status, request_log.c.cached_tokens)).all()
        finally:
            engine.dispose()

    wait_until(lambda: len(rows()) == 2, 30, "one stats row per completion")
    assert sorted(r.status for r in rows()) == [200, 400]
    assert [r.cached_tokens for r in rows() if r.status == 200] == [out.usage.prompt_tokens_details.cached_tokens]
    kv = tiny_engine.kv_cache_manager
    wait_until(lambda: kv.num_free_blocks == kv.num_blocks, 30, "every block back in the free queue")


def test_segment_reuse_passes_through_the_gateway(stack, tiny_engine):
    gateway_url = stack.gateway_url
    sdk = openai.OpenAI(base_url=gateway_url + "/v1", api_key=ALICE, max_retries=0, timeout=120)
    messages = [{"role": "user", "content": [{"type": "text", "text": DOC}, {"type": "text", "text": "When?"}]}]
    plain = sdk.chat.completions.create(model=tiny_engine.model_id, messages=messages, max_tokens=2)
    reused = sdk.chat.completions.create(model=tiny_engine.model_id, messages=messages, max_tokens=2,
                                         extra_body={"segment_reuse": True})
    assert reused.usage.prompt_tokens == plain.usage.prompt_tokens
    with pytest.raises(openai.BadRequestError) as info:  # the engine's refusal reaches the client as it was
        sdk.chat.completions.create(model=tiny_engine.model_id, messages=messages, max_tokens=2,
                                    extra_body={"segment_reuse": "yes"})
    assert info.value.body["param"] == "segment_reuse"


def test_one_tenant_cannot_fill_the_schema_registry_for_others(stack, tiny_engine):
    gateway_url, state, registry = stack.gateway_url, stack.gateway, stack.registry
    state.schema_quota.max_namespaces = 2
    with _http(gateway_url, ALICE) as greedy, _http(gateway_url, BOB) as bob:
        for salt in ("a", "b"):
            assert greedy.post("/v1/prompt_schemas", json={"pml": SCHEMA, "cache_salt": salt}).status_code == 200
        # The gateway's per-tenant quota: a third client salt is refused before the engine is asked.
        refused = greedy.post("/v1/prompt_schemas", json={"pml": SCHEMA, "cache_salt": "c"})
        assert refused.status_code == 400, refused.text
        assert refused.json()["error"] == {"message": refused.json()["error"]["message"], "param": "cache_salt",
                                           "type": "invalid_request_error", "code": "schema_limit"}
        assert len(registry.owner_usage()) == 1 and registry.total_tokens > 0
        # Replacing under a held salt is no new namespace; deleting a salt's last schema frees it.
        assert greedy.post("/v1/prompt_schemas", json={"pml": SCHEMA, "cache_salt": "a"}).status_code == 200
        assert greedy.delete("/v1/prompt_schemas/rag", params={"cache_salt": "b"}).status_code == 200
        assert greedy.post("/v1/prompt_schemas", json={"pml": SCHEMA, "cache_salt": "c"}).status_code == 200
        state.schema_quota.check_integrity()

        # Past the gateway (a quota raised, or several gateway workers), the engine shares its
        # bounds fairly: the tenant alone fills them and is refused, a newcomer evicts its oldest.
        state.schema_quota.max_namespaces = 100
        registry.max_salts = 3
        assert greedy.post("/v1/prompt_schemas", json={"pml": SCHEMA, "cache_salt": "d"}).status_code == 200
        full = greedy.post("/v1/prompt_schemas", json={"pml": SCHEMA, "cache_salt": "e"})
        assert full.status_code == 429 and full.json()["error"]["code"] == "schema_store_full"
        assert bob.post("/v1/prompt_schemas", json={"pml": SCHEMA.replace("dusk", "noon")}).status_code == 200
        assert [s["name"] for s in bob.get("/v1/prompt_schemas").json()["data"]] == ["rag"]
        assert greedy.get("/v1/prompt_schemas", params={"cache_salt": "a"}).json()["data"] == []  # evicted
        assert [s["name"] for s in greedy.get("/v1/prompt_schemas", params={"cache_salt": "d"}).json()["data"]] \
            == ["rag"]
        assert registry.evicted == 1 and sorted(n for n, _ in registry.owner_usage().values()) == [1, 2]
        registry.check_integrity()
        # The gateway's token quota: known from the engine's answer, so a schema past it is deleted again.
        tenant = state.authenticator.tenant_for(f"Bearer {ALICE}").name
        held = state.schema_quota.tokens(tenant)
        state.schema_quota.max_tokens = held + 1
        before = registry.total_tokens
        over = greedy.post("/v1/prompt_schemas", json={"pml": SCHEMA.replace('"rag"', '"rag2"'), "cache_salt": "d"})
        assert over.status_code == 400 and over.json()["error"]["param"] == "pml", over.text
        assert over.json()["error"]["code"] == "schema_limit"
        assert [s["name"] for s in greedy.get("/v1/prompt_schemas", params={"cache_salt": "d"}).json()["data"]] \
            == ["rag"]
        assert registry.total_tokens == before and state.schema_quota.tokens(tenant) == held
        registry.check_integrity()
        state.schema_quota.check_integrity()
    # Bob's schema serves his prompts.
    sdk = openai.OpenAI(base_url=gateway_url + "/v1", api_key=BOB, max_retries=0, timeout=120)
    out = sdk.completions.create(model=tiny_engine.model_id, prompt=PROMPT, max_tokens=2,
                                 extra_body={"prompt_format": "pml"})
    assert out.usage.prompt_tokens > 40
