"""PML over HTTP: /v1/prompt_schemas, completions with "prompt_format": "pml", chat segment_reuse.

The tiny engine behind a real uvicorn server, the official openai SDK for
generation. Until the engine consumes SegmentedPrompts these assert what holds
either way: routes and shapes, salt isolation, 400s naming line and column, and
that the prompt the engine gets is exactly the intended text.
"""

from __future__ import annotations

import httpx
import openai
import pytest
from test_engine_http_fixtures import serve

from engine.promptcache.pml_compiler import PmlCompiler, PmlLimits

DOC_A = "Alpha document: the river floods every spring and the town built dikes. " * 3
DOC_B = "Beta document: the mill grinds grain from the northern farms each autumn. " * 3
SCHEMA = (f'<schema name="rag"><system>Answer from the documents.</system>'
          f'<module name="a">{DOC_A}</module><module name="b">{DOC_B}</module>'
          '<module name="ask"><user>Question: <param name="q" len="16"/></user></module></schema>')
PROMPT = '<prompt schema="rag"><b/><a/><ask q="when does it flood?"/><assistant/></prompt>'


@pytest.fixture
def http(live):
    with httpx.Client(base_url=live.base_url, timeout=60) as c:
        yield c


def _post_schema(http, pml=SCHEMA, **extra):
    return http.post("/v1/prompt_schemas", json={"pml": pml, **extra})


def test_schema_routes(http):
    created = _post_schema(http)
    assert created.status_code == 200, created.text
    body = created.json()
    assert body["name"] == "rag" and [m["name"] for m in body["modules"]] == ["a", "b", "ask"]
    assert all(m["tokens"] > 0 for m in body["modules"])
    listed = http.get("/v1/prompt_schemas").json()
    assert [s["name"] for s in listed["data"]] == ["rag"]
    assert http.delete("/v1/prompt_schemas/rag").json()["deleted"] is True
    gone = http.delete("/v1/prompt_schemas/rag")
    assert gone.status_code == 404 and gone.json()["error"]["code"] == "schema_not_found"
    assert http.get("/v1/prompt_schemas").json()["data"] == []


def test_schemas_are_scoped_by_cache_salt(http, client):
    assert _post_schema(http, cache_salt="tenant-a").status_code == 200
    assert http.get("/v1/prompt_schemas", params={"cache_salt": "tenant-b"}).json()["data"] == []
    assert http.get("/v1/prompt_schemas").json()["data"] == []
    assert http.delete("/v1/prompt_schemas/rag", params={"cache_salt": "tenant-b"}).status_code == 404
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model="tiny-llama", prompt=PROMPT, max_tokens=2,
                                  extra_body={"prompt_format": "pml", "cache_salt": "tenant-b"})
    assert "unknown schema 'rag'" in info.value.body["message"]
    out = client.completions.create(model="tiny-llama", prompt=PROMPT, max_tokens=2,
                                    extra_body={"prompt_format": "pml", "cache_salt": "tenant-a"})
    assert out.choices[0].finish_reason in ("length", "stop")
    assert http.get("/v1/prompt_schemas", params={"cache_salt": "tenant-a"}).json()["data"][0]["name"] == "rag"


def test_pml_completion_prompt_is_the_intended_text(http, client, tiny_engine, bundled_tokenizer):
    assert _post_schema(http).status_code == 200
    out = client.completions.create(model="tiny-llama", prompt=PROMPT, max_tokens=3, temperature=0,
                                    extra_body={"prompt_format": "pml", "recovery": {"mode": "none"}})
    compiled = PmlCompiler(bundled_tokenizer, PmlLimits(max_param_tokens=tiny_engine.max_model_len)).prompt(
        PROMPT, {"rag": PmlCompiler(bundled_tokenizer, PmlLimits(512)).schema(SCHEMA)}.get)
    assert out.usage.prompt_tokens == len(compiled.token_ids)
    # ChatML glue around the role tags; the modules outside any role tag are bare text.
    assert bundled_tokenizer.decode(compiled.token_ids) == (
        "<|im_start|>system\nAnswer from the documents.<|im_end|>\n" + DOC_B + DOC_A
        + "<|im_start|>user\nQuestion: when does it flood?<|im_end|>\n<|im_start|>assistant\n")
    # The same tokens sent as plain ids give a prompt of the same length.
    plain = client.completions.create(model="tiny-llama", prompt=compiled.token_ids, max_tokens=1)
    assert plain.usage.prompt_tokens == out.usage.prompt_tokens


def test_the_engine_gets_the_segmented_prompt(live, http):
    import orjson

    assert _post_schema(http).status_code == 200
    handler = live.server.config.app.state.handler
    body = orjson.dumps({"prompt": PROMPT, "prompt_format": "pml", "max_tokens": 1})
    request = handler._prepare(body, "completion").fanout.requests[0]
    assert request.segmented is not None
    assert request.segmented.token_ids == request.prompt_token_ids
    assert {s.module for s in request.segmented.segments} >= {"rag/a", "rag/b", "rag/ask", "rag/@preamble", None}
    plain = handler._prepare(orjson.dumps({"prompt": "<b/>", "max_tokens": 1}), "completion")
    assert plain.fanout.requests[0].segmented is None  # never applied silently


def test_chat_segment_reuse_cuts_the_normal_prompt(live, client):
    import orjson

    handler = live.server.config.app.state.handler
    messages = [{"role": "system", "content": "Be short."},
                {"role": "user", "content": [{"type": "text", "text": DOC_A}, {"type": "text", "text": DOC_B}]},
                {"role": "user", "content": "Which comes first?"}]
    plain = handler._prepare(orjson.dumps({"messages": messages}), "chat").fanout.requests[0]
    reuse = handler._prepare(orjson.dumps({"messages": messages, "segment_reuse": True,
                                           "recovery": {"mode": "cacheblend", "fraction": 0.2}}),
                             "chat").fanout.requests[0]
    assert plain.segmented is None
    assert reuse.segmented is not None and reuse.prompt_token_ids == plain.prompt_token_ids
    assert reuse.segmented.token_ids == plain.prompt_token_ids
    assert [s.module for s in reuse.segmented.segments].count("segment") == 2
    assert reuse.segmented.recovery.mode == "cacheblend" and reuse.segmented.recovery.fraction == 0.2
    a = client.chat.completions.create(model="tiny-llama", messages=messages, max_tokens=2)
    b = client.chat.completions.create(model="tiny-llama", messages=messages, max_tokens=2,
                                       extra_body={"segment_reuse": True})
    assert a.usage.prompt_tokens == b.usage.prompt_tokens


def test_recovery_without_segment_reuse_is_refused(http):
    res = http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}],
                                                   "recovery": {"mode": "none"}})
    assert res.status_code == 400 and res.json()["error"]["param"] == "recovery"
    res = http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}],
                                                   "segment_reuse": "yes"})
    assert res.status_code == 400 and res.json()["error"]["param"] == "segment_reuse"


def test_server_default_segment_reuse(tiny_engine):
    import orjson

    with serve(tiny_engine, segment_reuse=True) as server:
        handler = server.server.config.app.state.handler
        messages = [{"role": "user", "content": DOC_A}]
        on = handler._prepare(orjson.dumps({"messages": messages}), "chat").fanout.requests[0]
        off = handler._prepare(orjson.dumps({"messages": messages, "segment_reuse": False}), "chat")
        assert on.segmented is not None and off.fanout.requests[0].segmented is None


HOSTILE = [
    ("<schema name='s'>" + "<module name='m'>" * 40 + "x" + "</module>" * 40 + "</schema>", "nested"),
    ('<schema name="s"><module name="a"><param name="p" len="1000000000"/></module></schema>', "param len"),
    ("<schema name='s'>" + "".join(f"<module name='m{i}'>x</module>" for i in range(10_000)) + "</schema>",
     "more than"),
    ('<schema name="s"><module name="a"><marquee/></module></schema>', "unknown tag"),
    ('<schema name="s"><module name="a">x<a/></module></schema>', "refers to itself"),
    ('<!DOCTYPE l [<!ENTITY l "ll">]><schema name="s"><module name="a">&l;</module></schema>', "not allowed"),
]


@pytest.mark.parametrize("pml, fragment", HOSTILE)
def test_hostile_schemas_get_400_naming_line_and_column(http, pml, fragment):
    res = _post_schema(http, pml)
    assert res.status_code == 400, res.text
    error = res.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["code"] == "invalid_pml" and error["param"] == "pml" and error["type"] == "invalid_request_error"
    assert fragment in error["message"] and "line 1, column" in error["message"]


@pytest.mark.parametrize("extra, param", [
    ({"prompt_format": "xml"}, "prompt_format"),
    ({"prompt_format": "pml", "recovery": {"mode": "magic"}}, "recovery"),
    ({"prompt_format": "pml", "recovery": {"mode": "epic", "first_tokens": -1}}, "recovery.first_tokens"),
    ({"prompt_format": "pml", "recovery": {"mode": "epic", "last_tokens": 1.5}}, "recovery.last_tokens"),
    ({"prompt_format": "pml", "recovery": [1]}, "recovery"),
    ({"recovery": {"mode": "none"}}, "recovery"),
    ({"prompt_format": "pml", "prompt": [1, 2, 3]}, "prompt"),
    ({"prompt_format": "pml", "prompt": "<prompt schema='rag'><a/><a/></prompt>"}, "prompt"),
    ({"prompt_format": "pml", "prompt": "<prompt schema='rag'><ask q='" + "word " * 40 + "'/></prompt>"}, "prompt"),
    ({"prompt_format": "pml", "prompt": "not pml"}, "prompt"),
])
def test_bad_pml_requests_get_400(http, extra, param):
    assert _post_schema(http).status_code == 200
    res = http.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 1, **extra})
    assert res.status_code == 400, res.text
    assert res.json()["error"]["param"] == param


@pytest.mark.parametrize("body, status, code", [
    ({}, 400, "invalid_value"),
    ({"pml": 3}, 400, "invalid_value"),
    ({"pml": SCHEMA, "cache_salt": 7}, 400, "invalid_value"),
    ([], 400, "invalid_json"),
])
def test_bad_schema_bodies(http, body, status, code):
    res = http.post("/v1/prompt_schemas", json=body)
    assert res.status_code == status and res.json()["error"]["code"] == code


def test_registry_full_is_a_4xx(live, http):
    registry = live.server.config.app.state.handler.prompt_modules.registry
    registry.max_schemas = 1
    assert _post_schema(http).status_code == 200
    res = _post_schema(http, SCHEMA.replace('name="rag"', 'name="rag2"'))
    assert res.status_code == 400 and res.json()["error"]["code"] == "schema_limit"
    registry.max_salts = 1
    res = _post_schema(http, cache_salt="another")
    assert res.status_code == 429 and res.json()["error"]["code"] == "schema_store_full"
    registry.check_integrity()
