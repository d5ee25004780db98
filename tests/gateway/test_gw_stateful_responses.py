"""Stateful Responses through the gateway: ``store``, ``previous_response_id``, ``GET`` /
``DELETE /v1/responses/{id}`` and ``input_items``, against prefixgate's real engine app
(a tiny random Llama, in process) with the official openai SDK.

Checked: turn N's upstream input is turn N-1's input bytes + its output bytes + the new
items; instructions are not carried over; tenants never see each other's responses;
``store: false`` keeps nothing; DELETE removes; the TTL and size bounds; a streamed
response is stored before its last event reaches the client and a cancelled one is not;
the migration; a fuzz of the new routes with no 5xx. The real model's cached tokens:
``test_gw_responses_e2e.py``."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
import stat
from collections.abc import AsyncIterator
from typing import Any
from urllib.parse import quote

import httpx
import openai
import orjson
import pytest
from gw_fakes import SECRET, make_settings, rows, serve_in_thread
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from sqlalchemy import inspect

from gateway.policy.api_key import hash_key
from gateway.responses.store import (
    ResponseLimits,
    ResponseStore,
    StoredResponse,
    join_arrays,
    parse_ttl,
)
from gateway.server.app import create_app
from gateway.server.settings import GatewaySettings
from gateway.stats import database

MODEL = "tiny-llama"
KEYS = {"acme": "pg-acme-key-0123", "beta": "pg-beta-key-0123"}
CONFIG = {"tenants": {name: {"keys": [hash_key(key)]} for name, key in KEYS.items()}}


@pytest.fixture(scope="module")
def engine_app():
    """prefixgate's engine app serving a 2-layer random Llama (the bundled tokenizer)."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from engine.config import EngineConfig
    from engine.core.llm_engine import LLMEngine
    from engine.model_store import ensure_converted_model
    from engine.server.app import create_app as create_engine_app

    tokenizer = AutoTokenizer.from_pretrained(str(ensure_converted_model()), local_files_only=True)
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                         eos_token_id=tokenizer.eos_token_id, bos_token_id=tokenizer.bos_token_id)
    model = LlamaForCausalLM(config).to(torch.float32).eval()
    model.config._attn_implementation = "sdpa"
    engine = LLMEngine(model, tokenizer, EngineConfig(kv_cache_memory_gib=0.004, served_model_name=MODEL, seed=0))
    engine.start()
    yield create_engine_app(engine)
    engine.shutdown()
    kv = engine.kv_cache_manager
    kv.check_integrity()
    assert kv.num_free_blocks == kv.num_blocks


class Recording(httpx.AsyncBaseTransport):
    """The engine app as the gateway's upstream, keeping every request body it got."""

    def __init__(self, app: Any) -> None:
        self.inner = httpx.ASGITransport(app=app)
        self.bodies: list[bytes] = []

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        self.bodies.append(await request.aread())
        return await self.inner.handle_async_request(request)


@contextlib.asynccontextmanager
async def gateway(settings: GatewaySettings, engine_app: Any) -> AsyncIterator[tuple[Any, Recording]]:
    upstream = Recording(engine_app)
    client = httpx.AsyncClient(transport=upstream, timeout=60.0)
    app = create_app(settings, client)
    try:
        yield app, upstream
    finally:
        await app.state.gateway.aclose()
        await client.aclose()


def sdk(app: Any, tenant: str = "acme") -> openai.AsyncOpenAI:
    http = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gw", timeout=60.0)
    return openai.AsyncOpenAI(base_url="http://gw/v1", api_key=KEYS[tenant], http_client=http, max_retries=0)


def raw(app: Any, tenant: str = "acme") -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gw", timeout=60.0,
                             headers={"authorization": f"Bearer {KEYS[tenant]}"})


def run(coroutine: Any) -> Any:
    return asyncio.run(coroutine)


def test_a_chain_sends_the_previous_items_and_output_verbatim(tmp_path, engine_app):
    async def go() -> None:
        async with gateway(make_settings(tmp_path, CONFIG), engine_app) as (app, upstream):
            client = sdk(app)
            first = await client.responses.create(model=MODEL, input="Hello there.", max_output_tokens=12)
            assert first.store is True and first.previous_response_id is None
            second = await client.responses.create(model=MODEL, previous_response_id=first.id,
                                                   input=[{"role": "user", "content": "And then?"}],
                                                   max_output_tokens=12)
            assert second.previous_response_id == first.id and second.store is True
            third = await client.responses.create(model=MODEL, previous_response_id=second.id, input="Last one.",
                                                  max_output_tokens=12)
            sent = [orjson.loads(body) for body in upstream.bodies]
            assert all(body["store"] is False for body in sent)
            assert "previous_response_id" not in sent[1]
            assert sent[0]["input"] == "Hello there."  # a first turn goes up as sent
            first_items = orjson.dumps([{"role": "user", "content": "Hello there."}])
            async with raw(app) as http:  # the output as the engine wrote it (the SDK reorders keys)
                outputs = [orjson.dumps(orjson.loads((await http.get(f"/v1/responses/{r.id}")).content)["output"])
                           for r in (first, second)]
            first_output, second_output = outputs
            second_input = join_arrays(first_items, first_output, b'[{"role":"user","content":"And then?"}]')
            assert b'"input":' + second_input + b"," in upstream.bodies[1]  # byte for byte
            third_input = join_arrays(second_input, second_output, b'[{"role":"user","content":"Last one."}]')
            assert b'"input":' + third_input + b"," in upstream.bodies[2]
            # The prompt of each turn is in the engine's cache when the next one comes (the tiny
            # model's random output may re-tokenize differently: the real model's test checks it).
            for before, after in ((first, second), (second, third)):
                assert after.usage.input_tokens_details.cached_tokens >= before.usage.input_tokens - 16
            got = await client.responses.retrieve(second.id)
            assert got.id == second.id and got.output_text == second.output_text
            items = await client.responses.input_items.list(third.id, order="asc")
            assert items.data[0].type == "message"
            listed = [item.model_dump(mode="json", exclude_unset=True) for item in items.data]
            assert len(listed) == len(orjson.loads(third_input))
            assert listed[-1]["content"] == [{"type": "input_text", "text": "Last one."}]
            assert listed[0]["content"] == [{"type": "input_text", "text": "Hello there."}]
    run(go())


def test_a_tool_call_and_its_output_chain_byte_for_byte(tmp_path, engine_app):
    """A generated function call is replayed as the engine wrote it (canonicalization is on,
    but only new items are canonicalized), followed by the client's function_call_output."""
    tool = {"type": "function", "name": "get_weather", "description": "The weather in a city.",
            "parameters": {"type": "object", "properties": {"city": {"enum": ["Paris", "Oslo"]}}, "required": ["city"],
                           "additionalProperties": False}}

    async def go() -> None:
        async with gateway(make_settings(tmp_path, CONFIG), engine_app) as (app, upstream):
            client = sdk(app)
            first = await client.responses.create(model=MODEL, input="Weather in Paris?", tools=[tool],
                                                  tool_choice="required", max_output_tokens=200)
            calls = [item for item in first.output if item.type == "function_call"]
            assert calls, first.output
            call = calls[0]
            result = [{"type": "function_call_output", "call_id": call.call_id, "output": "Sunny."}]
            second = await client.responses.create(model=MODEL, previous_response_id=first.id, input=result,
                                                   tools=[tool], max_output_tokens=8)
            async with raw(app) as http:
                stored = orjson.loads((await http.get(f"/v1/responses/{first.id}")).content)
            expected = join_arrays(b'[{"role":"user","content":"Weather in Paris?"}]', orjson.dumps(stored["output"]),
                                   orjson.dumps(result))
            assert b'"input":' + expected + b"," in upstream.bodies[1]
            replayed = orjson.loads(upstream.bodies[1])["input"][1]
            assert replayed["type"] == "function_call" and replayed["arguments"] == call.arguments
            assert second.usage.input_tokens_details.cached_tokens >= first.usage.input_tokens - 16
    run(go())


def test_instructions_are_not_carried_over_unless_resent(tmp_path, engine_app):
    async def go() -> None:
        async with gateway(make_settings(tmp_path, CONFIG), engine_app) as (app, upstream):
            client = sdk(app)
            first = await client.responses.create(model=MODEL, input="Hi.", instructions="Be brief.",
                                                  max_output_tokens=4)
            second = await client.responses.create(model=MODEL, previous_response_id=first.id, input="Go on.",
                                                   max_output_tokens=4)
            third = await client.responses.create(model=MODEL, previous_response_id=second.id, input="More.",
                                                  instructions="Be kind.", max_output_tokens=4)
            sent = [orjson.loads(body) for body in upstream.bodies]
            assert [body.get("instructions") for body in sent] == ["Be brief.", None, "Be kind."]
            assert not any("Be brief." in orjson.dumps(body["input"]).decode() for body in sent[1:])
            assert [(await client.responses.retrieve(r.id)).instructions for r in (first, second, third)] == [
                "Be brief.", None, "Be kind."]
    run(go())


def test_input_items_pages(tmp_path, engine_app):
    async def go() -> None:
        async with gateway(make_settings(tmp_path, CONFIG), engine_app) as (app, _):
            client = sdk(app)
            first = await client.responses.create(model=MODEL, input="One.", max_output_tokens=4)
            second = await client.responses.create(model=MODEL, previous_response_id=first.id, input="Two.",
                                                   max_output_tokens=4)
            async with raw(app) as http:
                whole = (await http.get(f"/v1/responses/{second.id}/input_items")).json()
                assert whole["object"] == "list" and not whole["has_more"]
                ids = [item["id"] for item in whole["data"]]
                assert len(ids) == len(set(ids)) >= 3 and whole["data"][0]["content"][0]["text"] == "Two."  # newest
                page = (await http.get(f"/v1/responses/{second.id}/input_items",
                                       params={"limit": 1, "order": "asc"})).json()
                assert page["has_more"] and page["data"][0]["content"][0]["text"] == "One."
                rest = (await http.get(f"/v1/responses/{second.id}/input_items",
                                       params={"order": "asc", "after": page["last_id"]})).json()
                assert [item["id"] for item in rest["data"]] == ids[::-1][1:]
                for params, param in (({"limit": 0}, "limit"), ({"limit": "x"}, "limit"),
                                      ({"order": "up"}, "order"), ({"after": "nope"}, "after")):
                    bad = await http.get(f"/v1/responses/{second.id}/input_items", params=params)
                    assert bad.status_code == 400 and bad.json()["error"]["param"] == param
    run(go())


def test_tenants_never_see_each_others_responses(tmp_path, engine_app):
    async def go() -> None:
        async with gateway(make_settings(tmp_path, CONFIG), engine_app) as (app, _):
            acme, beta = sdk(app, "acme"), sdk(app, "beta")
            mine = await acme.responses.create(model=MODEL, input="A secret of acme.", max_output_tokens=4)
            with pytest.raises(openai.NotFoundError):
                await beta.responses.retrieve(mine.id)
            with pytest.raises(openai.NotFoundError):
                await beta.responses.input_items.list(mine.id)
            with pytest.raises(openai.NotFoundError):
                await beta.responses.delete(mine.id)
            with pytest.raises(openai.BadRequestError) as refused:
                await beta.responses.create(model=MODEL, previous_response_id=mine.id, input="Go on.")
            assert refused.value.code == "previous_response_not_found"
            assert (await acme.responses.retrieve(mine.id)).id == mine.id  # untouched by beta's delete
            async with raw(app, "beta") as http:
                unauthenticated = await http.get(f"/v1/responses/{mine.id}", headers={"authorization": "Bearer x"})
                assert unauthenticated.status_code == 401
    run(go())


def test_store_false_keeps_nothing_and_delete_removes(tmp_path, engine_app):
    async def go() -> None:
        settings = make_settings(tmp_path, CONFIG)
        async with gateway(settings, engine_app) as (app, _):
            client = sdk(app)
            unstored = await client.responses.create(model=MODEL, input="Forget me.", store=False,
                                                     max_output_tokens=4)
            assert unstored.store is False
            with pytest.raises(openai.NotFoundError):
                await client.responses.retrieve(unstored.id)
            with pytest.raises(openai.BadRequestError):
                await client.responses.create(model=MODEL, previous_response_id=unstored.id, input="Hi.")
            kept = await client.responses.create(model=MODEL, input="Keep me.", max_output_tokens=4)
            deleted = await client.responses.delete(kept.id)
            assert deleted is None or getattr(deleted, "deleted", True)
            with pytest.raises(openai.NotFoundError):
                await client.responses.retrieve(kept.id)
            with pytest.raises(openai.NotFoundError):
                await client.responses.delete(kept.id)
            with pytest.raises(openai.BadRequestError):
                await client.responses.create(model=MODEL, previous_response_id=kept.id, input="Hi.")
        engine = database.create_db_engine(settings.db_url)
        with engine.connect() as connection:
            assert connection.exec_driver_sql("SELECT count(*) FROM stored_response").scalar() == 0
        engine.dispose()
        path = settings.db_url.removeprefix("sqlite:///")
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    run(go())


def test_chain_length_and_size_bounds(tmp_path, engine_app):
    async def go() -> None:
        base = make_settings(tmp_path, CONFIG)
        short = dataclasses.replace(base, responses=ResponseLimits(ttl_s=60, max_turns=2, max_bytes=100_000))
        async with gateway(short, engine_app) as (app, _):
            client = sdk(app)
            first = await client.responses.create(model=MODEL, input="One.", max_output_tokens=4)
            second = await client.responses.create(model=MODEL, previous_response_id=first.id, input="Two.",
                                                   max_output_tokens=4)
            with pytest.raises(openai.BadRequestError) as refused:
                await client.responses.create(model=MODEL, previous_response_id=second.id, input="Three.")
            assert refused.value.code == "conversation_too_long"
        small = dataclasses.replace(base, responses=ResponseLimits(ttl_s=60, max_turns=10, max_bytes=200))
        async with gateway(small, engine_app) as (app, _):
            client = sdk(app)
            first = await client.responses.create(model=MODEL, input="One.", max_output_tokens=4)
            with pytest.raises(openai.BadRequestError) as refused:
                await client.responses.create(model=MODEL, previous_response_id=first.id, input="x" * 300)
            assert refused.value.code == "conversation_too_large"
        off = dataclasses.replace(base, responses=ResponseLimits(ttl_s=0))
        async with gateway(off, engine_app) as (app, _):
            client = sdk(app)
            answer = await client.responses.create(model=MODEL, input="One.", max_output_tokens=4)
            with pytest.raises(openai.NotFoundError):
                await client.responses.retrieve(answer.id)
            with pytest.raises(openai.BadRequestError):
                await client.responses.create(model=MODEL, previous_response_id=answer.id, input="Two.")
    run(go())


def test_the_store_expires_and_purges_by_its_clock(tmp_path):
    url = database.default_db_url(tmp_path)
    database.upgrade(url)
    engine = database.create_db_engine(url)
    now = [1000.0]
    store = ResponseStore(engine, ResponseLimits(ttl_s=10), clock=lambda: now[0])
    kept = StoredResponse("resp_1", "acme", 1000.0, 1, b"[]", b"[]", b"{}")
    assert store.put(kept) and not store.put(dataclasses.replace(kept, tenant="beta"))  # ids are unique
    assert store.get("acme", "resp_1") == kept and store.get("beta", "resp_1") is None
    now[0] = 1011.0
    assert store.get("acme", "resp_1") is None and not store.delete("acme", "resp_1")
    assert store.purge() == 1
    engine.dispose()
    assert parse_ttl("90m") == 5400 and parse_ttl("30d") == 30 * 86400 and parse_ttl("0") == 0
    for bad in ("", "-1", "1w", "inf", "nan", "d"):
        with pytest.raises(ValueError, match="--responses-ttl"):
            parse_ttl(bad)


def test_stored_responses_migrate_up_down_up(tmp_path):
    url = database.default_db_url(tmp_path)
    database.upgrade(url)
    engine = database.create_db_engine(url)
    assert "stored_response" in inspect(engine).get_table_names()
    engine.dispose()
    database.downgrade(url, "2026_11_23_replica_routing")
    engine = database.create_db_engine(url)
    assert set(inspect(engine).get_table_names()) >= {"request_log"}
    assert "stored_response" not in inspect(engine).get_table_names()
    engine.dispose()
    database.upgrade(url)
    assert database.current_revision(url) == "2026_11_24_stored_responses"


async def _events(response: httpx.Response) -> AsyncIterator[dict[str, Any]]:
    async for line in response.aiter_lines():
        if line.startswith("data: "):
            yield orjson.loads(line[6:])


def test_a_stream_is_stored_before_its_last_event_and_a_cancelled_one_never(tmp_path, engine_app):
    settings = make_settings(tmp_path, CONFIG)
    headers = {"authorization": f"Bearer {KEYS['acme']}"}

    async def go(url: str) -> None:
        async with httpx.AsyncClient(base_url=url, headers=headers, timeout=60.0) as http:
            body = {"model": MODEL, "input": "Tell a story.", "stream": True, "max_output_tokens": 8}
            async with http.stream("POST", "/v1/responses", json=body) as response:
                async for event in _events(response):
                    if event["type"] in ("response.completed", "response.incomplete"):
                        done = event["response"]
                        # The stream is still open: the response is already stored.
                        got = await http.get(f"/v1/responses/{done['id']}")
                        assert got.status_code == 200 and got.json()["output"] == done["output"]
                        assert got.json()["store"] is True
            follow = await http.post("/v1/responses", json={"model": MODEL, "previous_response_id": done["id"],
                                                            "input": "Go on.", "max_output_tokens": 4})
            assert follow.status_code == 200, follow.text
            body = {**body, "max_output_tokens": 1500, "input": "Tell a long story."}
            async with http.stream("POST", "/v1/responses", json=body) as response:
                async for event in _events(response):
                    if event["type"] == "response.created":
                        cancelled = event["response"]["id"]
                    if event["type"] == "response.output_text.delta":
                        break  # the client leaves mid-stream
        while len(rows(settings.db_url)) < 3:  # the gateway recorded the cancelled stream
            await asyncio.sleep(0.05)
        assert [row.status for row in rows(settings.db_url)] == [200, 200, 499]
        async with httpx.AsyncClient(base_url=url, headers=headers) as http:
            assert (await http.get(f"/v1/responses/{cancelled}")).status_code == 404

    # Real HTTP on both sides: the upstream's stream must really be cut, not buffered.
    with serve_in_thread(engine_app) as engine_url:
        app = create_app(dataclasses.replace(settings, upstream=engine_url))
        with serve_in_thread(app) as url:
            asyncio.run(go(url))


IDS = st.one_of(st.text(max_size=300), st.sampled_from(["resp_x", "", "%00", "../x", "a" * 200]))
QUERY = st.dictionaries(st.sampled_from(["limit", "order", "after", "include"]),
                        st.one_of(st.text(max_size=20), st.integers(-5, 500).map(str)), max_size=3)
FIELDS = st.one_of(st.none(), st.booleans(), st.integers(), st.text(max_size=40), st.lists(st.integers(), max_size=2),
                   st.dictionaries(st.text(max_size=5), st.integers(), max_size=2))


def test_fuzz_the_state_routes_never_5xx(tmp_path, engine_app):
    settings_ = make_settings(tmp_path, CONFIG)

    async def setup() -> tuple[Any, Any, str]:
        upstream = httpx.AsyncClient(transport=httpx.ASGITransport(app=engine_app), timeout=60.0)
        app = create_app(settings_, upstream)
        async with raw(app) as http:
            made = await http.post("/v1/responses", json={"model": MODEL, "input": "Hi.", "max_output_tokens": 2})
        return app, upstream, made.json()["id"]

    app, upstream, known = asyncio.run(setup())

    @settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
    @given(method=st.sampled_from(["GET", "DELETE", "POST", "PUT"]), ident=IDS, suffix=st.sampled_from(["", "/input_items", "/cancel", "/"]),
           query=QUERY, store=FIELDS, previous=st.one_of(FIELDS, st.just(known)),
           tenant=st.sampled_from(["acme", "beta"]))
    def check(method: str, ident: str, suffix: str, query: dict[str, str], store: Any, previous: Any,
              tenant: str) -> None:
        async def one() -> None:
            async with raw(app, tenant) as http:
                path = "/v1/responses/" + quote(ident, safe="") + suffix
                answer = await http.request(method, path, params=query)
                assert answer.status_code < 500, (method, path, answer.text)
                if answer.status_code >= 400:
                    assert set(answer.json()["error"]) >= {"message", "type", "param", "code"}
                body = {"model": MODEL, "input": "Hi.", "max_output_tokens": 1, "store": store,
                        "previous_response_id": previous}
                created = await http.post("/v1/responses", json=body)
                assert created.status_code < 500, created.text
        asyncio.run(one())

    try:
        check()
    finally:
        async def close() -> None:
            await app.state.gateway.aclose()
            await upstream.aclose()
        asyncio.run(close())


def test_the_row_of_a_continued_turn_is_written(tmp_path, engine_app):
    async def go() -> None:
        settings = make_settings(tmp_path, CONFIG)
        async with gateway(settings, engine_app) as (app, _):
            client = sdk(app)
            first = await client.responses.create(model=MODEL, input="One.", max_output_tokens=4)
            await client.responses.create(model=MODEL, previous_response_id=first.id, input="Two.",
                                          max_output_tokens=4)
            with pytest.raises(openai.BadRequestError):
                await client.responses.create(model=MODEL, previous_response_id="resp_missing", input="x")
        assert [(row.endpoint, row.status, row.model) for row in rows(settings.db_url)] == [
            ("responses", 200, MODEL), ("responses", 200, MODEL), ("responses", 400, MODEL)]
        assert SECRET  # the same secret as every gateway test
    run(go())


def test_a_bad_responses_option_is_one_line_and_exit_2(tmp_path):
    import subprocess
    import sys

    from support.net import free_port

    for option, value in (("--responses-ttl", "3w"), ("--responses-max-turns", "0")):
        done = subprocess.run([sys.executable, "-m", "gateway.cli", "gateway", "--upstream", "http://127.0.0.1:9",
                               "--data-dir", str(tmp_path), "--port", str(free_port()), option, value],
                              capture_output=True, text=True, timeout=120)
        assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
        assert len(done.stderr.strip().splitlines()) == 1 and option in done.stderr, done.stderr
