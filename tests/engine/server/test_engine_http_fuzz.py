"""Fuzz: seeded malformed requests against the engine and the gateway in front of it.

Both servers run under uvicorn on loopback (the engine with an API key, the
gateway holding it, as ``prefixgate serve`` wires them). Every answer must be a
status below 500, OpenAI's error shape for a 4xx, and a well-formed body or
stream for a 200 (:func:`bad_requests.check_answer`). Afterwards the engine holds
no block and the gateway wrote one stats row per request. The seed changes each
day (printed, and settable with ``PREFIXGATE_FUZZ_SEED``) so runs cover new cases
while any failure can be replayed. ``benchmarks/fault_campaign.py`` runs thousands.
"""

from __future__ import annotations

import asyncio
import datetime
import json
import os
import random
import socket
import threading
from collections import Counter

import httpx
import pytest
import uvicorn
from bad_requests import cases, check_answer
from support.sse import sse_events
from test_engine_http_fixtures import serve, wait_until

from gateway.server.app import create_app as create_gateway
from gateway.server.settings import GatewaySettings
from gateway.stats.database import default_db_url, upgrade

CASES_PER_RUN = int(os.environ.get("PREFIXGATE_FUZZ_CASES") or 300)
KEY = "fuzz-engine-key"
SEED = int(os.environ.get("PREFIXGATE_FUZZ_SEED") or datetime.date.today().strftime("%Y%m%d"))


class _Gateway:
    """The gateway app under uvicorn in a thread (lifespan on: its stats writer runs)."""

    def __init__(self, settings: GatewaySettings) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        config = uvicorn.Config(create_gateway(settings), log_level="warning", access_log=False, lifespan="on")
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)

    def __enter__(self) -> str:
        self.thread.start()
        wait_until(lambda: self.server.started, 60, "the gateway to start")
        return self.url

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self.thread.join(60)
        self.sock.close()


async def _send_all(url: str, all_cases, headers: dict[str, str]) -> list[tuple[object, int, bytes]]:
    limits = httpx.Limits(max_connections=8)
    async with httpx.AsyncClient(base_url=url, timeout=120, limits=limits) as client:
        semaphore = asyncio.Semaphore(8)

        async def one(case):
            async with semaphore:
                response = await client.post(case.path, content=case.body,
                                             headers={"content-type": "application/json", **headers})
                return case, response.status_code, response.content

        return await asyncio.gather(*(one(case) for case in all_cases))


@pytest.fixture
def servers(tiny_engine, tmp_path):
    with serve(tiny_engine, api_key=KEY, max_body_bytes=2 * 1024 * 1024) as engine:
        db_url = default_db_url(tmp_path)
        upgrade(db_url)
        settings = GatewaySettings(upstream=engine.base_url, secret=b"fuzz-secret-0123456789abcdef0123",
                                   db_url=db_url, data_dir=tmp_path, upstream_api_key=KEY)
        with _Gateway(settings) as gateway:
            yield engine.base_url, gateway, db_url


def test_no_malformed_request_gets_a_5xx_from_either_server(servers, tiny_engine):
    engine_url, gateway_url, _db_url = servers
    all_cases = list(cases(SEED, CASES_PER_RUN, tiny_engine.model_id))
    print(f"fuzz seed {SEED} (PREFIXGATE_FUZZ_SEED={SEED} replays it)")
    failures: list[str] = []
    statuses: Counter[tuple[str, int]] = Counter()
    for name, url in (("engine", engine_url), ("gateway", gateway_url)):
        answers = asyncio.run(_send_all(url, all_cases, {"authorization": f"Bearer {KEY}"}))
        for case, status, content in answers:
            statuses[(name, status)] += 1
            problem = check_answer(status, content)
            if problem is not None:
                failures.append(f"{name} case {case.index} ({case.kind}, {case.path}): {problem}\n"
                                f"  body: {case.body[:300]!r}")
    print(sorted(statuses.items()))
    assert not failures, f"seed {SEED}: {len(failures)} bad answers\n" + "\n".join(failures[:20])
    # Some cases are served, most are refused: the generator exercises both paths.
    assert statuses[("engine", 200)] > 10 and statuses[("engine", 400)] > 100
    kv = tiny_engine.kv_cache_manager
    wait_until(lambda: kv.num_free_blocks == kv.num_blocks, 30, "every block back in the free queue")
    kv.check_integrity()


def test_gateway_wrote_one_row_per_fuzzed_request(servers, tiny_engine):
    _engine_url, gateway_url, db_url = servers
    few = list(cases(SEED + 1, 60, tiny_engine.model_id))
    answers = asyncio.run(_send_all(gateway_url, few, {"authorization": "Bearer tenant-key"}))
    assert all(check_answer(status, content) is None for _, status, content in answers)
    from sqlalchemy import func, select

    from gateway.stats.database import create_db_engine
    from gateway.stats.table import request_log

    def written() -> int:
        engine = create_db_engine(db_url)
        try:
            with engine.connect() as connection:
                return int(connection.execute(select(func.count()).select_from(request_log)).scalar_one())
        finally:
            engine.dispose()

    wait_until(lambda: written() == len(few), 30, "one stats row per request")


SELF_REQUIRING = {"$defs": {"n": {"type": "object", "properties": {"c": {"$ref": "#/$defs/n"}},
                                  "required": ["c"]}}, "$ref": "#/$defs/n"}
ISSUE_SCHEMAS = [  # issue 28's two 500s
    {"$defs": {"n": {"properties": {"c": {"$ref": "#/$defs/n"}}, "required": ["c"]}}, "$ref": "#/$defs/n"},
    {"type": "string", "pattern": "^a{1000000}$"},
]


def hostile_schema(rng: random.Random) -> object:
    """A schema meant to hurt a grammar compiler: no finite instance, huge repetitions,
    huge enums, deep nesting, many branches, contradictions, bad references."""
    n = rng.choice([10, 1000, 100_000, 1_000_000])
    depth = rng.choice([20, 60, 120])  # past the servers' JSON depth limit too
    deep: object = {"type": "string"}
    for _ in range(depth):
        deep = {"type": "object", "properties": {"a": deep}, "required": ["a"]}
    return rng.choice([
        SELF_REQUIRING, *ISSUE_SCHEMAS, False, True, {}, deep,
        {"type": "object", "properties": {"a": {"type": "string"}, "b": {"$ref": "#/$defs/n"}},
         "required": ["a", "b"], "$defs": SELF_REQUIRING["$defs"]},
        {"$defs": {"n": {"type": "array", "minItems": 1, "items": {"$ref": "#/$defs/n"}}}, "$ref": "#/$defs/n"},
        {"type": "string", "pattern": f"^(ab|cd|e{{2,9}}){{{n}}}$"},
        {"type": "string", "pattern": "^((a{100}){100}){100}$"},
        {"type": "string", "pattern": "(((("},
        {"type": "string", "minLength": n},
        {"type": "array", "minItems": n, "items": {"type": "integer"}},
        {"enum": [f"value-{i}" for i in range(min(n, 20_000))]},
        {"anyOf": [{"const": i} for i in range(min(n, 5000))]},
        {"type": "object", "properties": {f"k{i}": {"type": "integer"} for i in range(min(n, 5000))},
         "required": [f"k{i}" for i in range(min(n, 5000))]},
        {"type": "integer", "minimum": 5, "maximum": 1},
        {"type": "object", "required": ["x"], "properties": {}, "additionalProperties": False},
        {"not": {}}, {"$ref": "#/$defs/missing"}, {"$ref": "https://example.com/s.json"},
        {"type": "string", "format": "date-time", "pattern": "^[0-9]{4}$"},
        {"type": "object", "patternProperties": {"^(a+)+$": {"type": "string"}}, "minProperties": 3},
        {"allOf": [{"type": "string"}, {"type": "integer"}]},
    ])


def hostile_bodies(seed: int, count: int, model: str) -> list[tuple[str, dict, bool]]:
    """(path, body, stream): each hostile schema as chat's response_format, as Responses'
    text.format, or as a forced tool's parameters."""
    out = []
    for i in range(count):
        rng = random.Random(f"schema:{seed}:{i}")
        schema, stream = hostile_schema(rng), rng.random() < 0.5
        where = rng.choice(["chat", "responses", "tool", "responses-tool"])
        if where == "chat":
            body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 8, "response_format": {
                "type": "json_schema", "json_schema": {"name": "s", "schema": schema}}}
        elif where == "tool":
            body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 8, "tool_choice": "required",
                    "tools": [{"type": "function", "function": {"name": "f", "parameters": schema}}]}
        elif where == "responses":
            body = {"input": "hi", "max_output_tokens": 8, "text": {"format": {
                "type": "json_schema", "name": "s", "schema": schema}}}
        else:
            body = {"input": "hi", "max_output_tokens": 8, "tool_choice": "required",
                    "tools": [{"type": "function", "name": "f", "parameters": schema}]}
        path = "/v1/responses" if where.startswith("responses") else "/v1/chat/completions"
        out.append((path, {"model": model, "stream": stream, **body}, stream))
    return out


def responses_stream_problem(content: bytes) -> str | None:
    """None when a Responses stream ends as it should: its last event completes the response."""
    events = sse_events(content)
    last = events[-1].split(b"data: ", 1)[-1] if events else b"{}"
    kind = json.loads(last).get("type")
    return None if kind in ("response.completed", "response.incomplete") else f"stream ends with {kind}"


def test_hostile_schemas_get_no_5xx_from_either_server(servers, tiny_engine):
    engine_url, gateway_url, _db_url = servers
    bodies = hostile_bodies(SEED, 60, tiny_engine.model_id) + [
        ("/v1/chat/completions", {"model": tiny_engine.model_id, "stream": stream, "max_tokens": 8,
                                  "messages": [{"role": "user", "content": "hi"}], "response_format": {
                                      "type": "json_schema", "json_schema": {"name": "s", "schema": s}}}, stream)
        for s in ISSUE_SCHEMAS for stream in (False, True)]
    statuses: Counter[tuple[str, int]] = Counter()
    failures = []
    for name, url in (("engine", engine_url), ("gateway", gateway_url)):
        with httpx.Client(base_url=url, timeout=120, headers={"authorization": f"Bearer {KEY}"}) as client:
            for path, body, stream in bodies:
                response = client.post(path, json=body)
                statuses[(name, response.status_code)] += 1
                if path == "/v1/responses" and stream and response.status_code == 200:
                    problem = responses_stream_problem(response.content)
                else:
                    problem = check_answer(response.status_code, response.content)
                if problem is not None:
                    failures.append(f"{name} {path}: {problem}\n  schema: {json.dumps(body)[:300]}")
    print(sorted(statuses.items()))
    assert not failures, "\n".join(failures[:10])
    assert statuses[("engine", 400)] >= 10 and statuses[("engine", 200)] >= 5
    kv = tiny_engine.kv_cache_manager
    wait_until(lambda: kv.num_free_blocks == kv.num_blocks, 30, "every block back in the free queue")


@pytest.mark.parametrize(("path", "field", "param"), [
    ("/v1/chat/completions", "response_format", "response_format.json_schema.schema"),
    ("/v1/chat/completions", "tools", "tools[0].function.parameters"),
    ("/v1/responses", "text", "text.format.schema"),
    ("/v1/responses", "tools", "tools[0].parameters"),
])
def test_unsatisfiable_and_over_limit_schemas_are_a_400_naming_the_schema(servers, tiny_engine, path, field,
                                                                          param):
    engine_url, gateway_url, _db_url = servers
    for schema in [SELF_REQUIRING, ISSUE_SCHEMAS[1]]:
        body: dict = {"model": tiny_engine.model_id, "max_tokens": 8, "messages": [{"role": "user", "content": "x"}]}
        if path == "/v1/responses":
            body = {"model": tiny_engine.model_id, "input": "x"}
        if field == "response_format":
            body["response_format"] = {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}}
        elif field == "text":
            body["text"] = {"format": {"type": "json_schema", "name": "s", "schema": schema}}
        elif path == "/v1/responses":
            body.update(tool_choice="required", tools=[{"type": "function", "name": "f", "parameters": schema}])
        else:
            body.update(tool_choice="required",
                        tools=[{"type": "function", "function": {"name": "f", "parameters": schema}}])
        for url in (engine_url, gateway_url):
            response = httpx.post(url + path, json=body, headers={"authorization": f"Bearer {KEY}"}, timeout=60)
            assert response.status_code == 400, response.text
            error = response.json()["error"]
            assert (error["param"], error["code"]) == (param, "invalid_schema"), error


def test_a_grammar_failing_mid_generation_ends_as_a_client_error_on_both_servers(servers, tiny_engine,
                                                                                  monkeypatch):
    """Fault injection: the grammar reaches a limit at the third token. Both servers answer
    a 400 naming the schema, end a chat stream with the error event then [DONE], and end a
    Responses stream with one Responses error event (nothing chat-shaped appended)."""
    from engine.structured.grammar import GrammarConstraint, GrammarError

    real_accept = GrammarConstraint.accept

    def failing_accept(self, token_id):
        self.accepted = getattr(self, "accepted", 0) + 1
        if self.accepted == 3:
            raise GrammarError("parser error: Too many items (limit 50000; ff_tokens)")
        real_accept(self, token_id)

    monkeypatch.setattr(GrammarConstraint, "accept", failing_accept)
    engine_url, gateway_url, _db_url = servers
    schema = {"type": "object", "properties": {"a": {"type": "string"}}}
    chat = {"model": tiny_engine.model_id, "max_tokens": 20, "messages": [{"role": "user", "content": "x"}],
            "response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}}}
    responses = {"model": tiny_engine.model_id, "max_output_tokens": 20, "input": "x",
                 "text": {"format": {"type": "json_schema", "name": "s", "schema": schema}}}
    endings = {}
    for name, url in (("engine", engine_url), ("gateway", gateway_url)):
        with httpx.Client(base_url=url, timeout=60, headers={"authorization": f"Bearer {KEY}"}) as client:
            for path, body, param in (("/v1/chat/completions", chat, "response_format.json_schema.schema"),
                                      ("/v1/responses", responses, "text.format.schema")):
                whole = client.post(path, json=body)
                assert whole.status_code == 400, (name, whole.text)
                assert whole.json()["error"]["param"] == param and whole.json()["error"]["code"] == "invalid_schema"
                streamed = client.post(path, json={**body, "stream": True})
                assert streamed.status_code == 200
                events = sse_events(streamed.text)
                if path == "/v1/responses":
                    assert events[-1].startswith("event: error\n") and "[DONE]" not in streamed.text
                    error = json.loads(events[-1].split("data: ", 1)[1])
                    assert (error["type"], error["code"], error["param"]) == ("error", "invalid_schema", param)
                    assert '"error":{' not in streamed.text.replace(" ", "")
                else:
                    error = json.loads(events[-2][len("data: "):])["error"]
                    assert (error["type"], error["code"]) == ("invalid_request_error", "invalid_schema")
                    assert error["param"] == param
                    endings[name] = events[-1]
    assert endings == {"engine": "data: [DONE]", "gateway": "data: [DONE]"}
    kv = tiny_engine.kv_cache_manager
    wait_until(lambda: kv.num_free_blocks == kv.num_blocks, 30, "every block back in the free queue")


PML_SCHEMA = ('<schema name="fz"><system>Use the notes.</system><module name="a">Note A: the gate opens at '
              'nine.</module><union><module name="b">Note B.</module><module name="c">Note C.</module></union>'
              '<module name="d">Dear <param name="who" len="4"/>, <module name="e">inner</module> end.</module>'
              '</schema>')
PML_PROMPT = '<prompt schema="fz"><a/><b/><d who="Ann"><e/></d><user>When?</user><assistant/></prompt>'
PML_PIECES = ["<", ">", "/>", "</module>", "<module name='x'>", "<param name='p' len='99999999999'/>", "&",
              "&lol;", "&#0;", "&#x110000;", "<!DOCTYPE x [<!ENTITY a 'b'>]>", "<![CDATA[", "]]>", "<!--", "\"",
              "<union>", "<user>", "<a/>", "<d who='" + "w " * 50 + "'/>", "<zz/>", "\x00", "\ud7ff", "\u2028",
              "<" * 3, "<module name='a'>" * 40]


def _mutate(rng: random.Random, text: str) -> str:
    for _ in range(rng.randint(1, 4)):
        at = rng.randrange(len(text) + 1)
        if rng.random() < 0.5:
            text = text[:at] + rng.choice(PML_PIECES) + text[at:]
        else:
            text = text[:at] + text[at + rng.randint(1, 20):]
    return text


def pml_cases(seed: int, count: int, model: str) -> list[tuple[str, str, object]]:
    """(method, path, JSON body or query) for the PML routes; case i depends on (seed, i)."""
    out: list[tuple[str, str, object]] = []
    for index in range(count):
        rng = random.Random(f"pml:{seed}:{index}")
        kind = rng.choice(["schema", "schema", "prompt", "prompt", "list", "delete", "field"])
        if kind == "schema":
            out.append(("POST", "/v1/prompt_schemas", {"pml": _mutate(rng, PML_SCHEMA)}))
        elif kind == "prompt":
            out.append(("POST", "/v1/completions", {"model": model, "prompt_format": "pml", "max_tokens": 2,
                                                    "prompt": _mutate(rng, PML_PROMPT),
                                                    "stream": rng.random() < 0.3}))
        elif kind == "list":
            out.append(("GET", "/v1/prompt_schemas", {"cache_salt": rng.choice(["", "x" * 300, "ok", "\u0000"])}))
        elif kind == "delete":
            out.append(("DELETE", "/v1/prompt_schemas/" + rng.choice(["fz", "nope", "%00", "a" * 500]), {}))
        else:
            out.append(("POST", rng.choice(["/v1/completions", "/v1/prompt_schemas"]), {
                "model": model, "prompt": PML_PROMPT, "pml": rng.choice([PML_SCHEMA, None, 3, [], {"a": 1}]),
                "prompt_format": rng.choice(["pml", "PML", None, 1, ["pml"]]),
                "recovery": rng.choice([None, {}, {"mode": "epic", "first_tokens": 2**70}, {"fraction": "x"},
                                        {"mode": None}, 5]),
                "cache_salt": rng.choice([None, "", 7, "t" * 2000])}))
    return out


def test_pml_routes_get_no_5xx_from_either_server(servers, tiny_engine):
    engine_url, gateway_url, _db_url = servers
    all_cases = pml_cases(SEED, 150, tiny_engine.model_id)
    statuses: Counter[tuple[str, int]] = Counter()
    failures = []
    for name, url in (("engine", engine_url), ("gateway", gateway_url)):
        with httpx.Client(base_url=url, timeout=120, headers={"authorization": f"Bearer {KEY}"}) as client:
            assert client.post("/v1/prompt_schemas", json={"pml": PML_SCHEMA}).status_code == 200
            for method, path, payload in all_cases:
                if method == "POST":
                    response = client.post(path, json=payload)
                else:
                    response = client.request(method, path, params=payload)  # type: ignore[arg-type]
                statuses[(name, response.status_code)] += 1
                problem = check_answer(response.status_code, response.content)
                if problem is not None:
                    failures.append(f"{name} {method} {path}: {problem}\n  body: {json.dumps(payload)[:300]}")
    print(f"pml fuzz seed {SEED}", sorted(statuses.items()))
    assert not failures, "\n".join(failures[:10])
    assert statuses[("engine", 400)] >= 20 and statuses[("engine", 200)] >= 5
    kv = tiny_engine.kv_cache_manager
    wait_until(lambda: kv.num_free_blocks == kv.num_blocks, 30, "every block back in the free queue")
    kv.check_integrity()
