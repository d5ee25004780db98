"""Every class of bad input gets OpenAI's error shape and the right 4xx status, over HTTP.

The official SDK raises typed errors whose ``body`` is the server's error object;
raw httpx covers what the SDK cannot send (malformed JSON, oversized bodies).
"""

import base64
import json

import httpx
import openai
import pytest
from test_engine_http_fixtures import serve, wait_until

from engine.contract.errors import APIError

JSON = {"content-type": "application/json"}


@pytest.fixture
def live(tiny_engine):
    with serve(tiny_engine, max_body_bytes=64 * 1024) as server:
        yield server


@pytest.fixture
def client(live):
    return openai.OpenAI(base_url=live.api_url, api_key="x", max_retries=0, timeout=60)


def assert_error_shape(body: dict, *, param=..., code=...):
    assert set(body) == {"error"}
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert isinstance(error["message"], str) and error["message"]
    assert error["type"] == "invalid_request_error"
    if param is not ...:
        assert error["param"] == param
    if code is not ...:
        assert error["code"] == code
    return error


def sdk_error(fn, status, **kwargs):
    with pytest.raises(openai.APIStatusError) as info:
        fn(**kwargs)
    assert info.value.status_code == status
    return info.value.response.json()


MSG = [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize(
    ("kwargs", "param"),
    [
        ({"temperature": 3}, "temperature"),
        ({"temperature": -1}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_completion_tokens": -5}, "max_completion_tokens"),
        ({"seed": "abc"}, "seed"),
        ({"stop": ["a", ""]}, "stop"),
        ({"extra_body": {"top_k": "ten"}}, "top_k"),
        ({"extra_body": {"stop_token_ids": [-1]}}, "stop_token_ids"),
        ({"n": 17}, "n"),
        ({"top_logprobs": 3}, "top_logprobs"),
        ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "strang"}}}},
         "response_format.json_schema.schema"),
        ({"extra_body": {"cache_salt": ""}}, "cache_salt"),
        ({"extra_body": {"cache_salt": "s" * 1025}}, "cache_salt"),
        ({"extra_body": {"cache_salt": 42}}, "cache_salt"),
        ({"messages": [{"role": "robot", "content": "x"}]}, "messages[0].role"),
        ({"messages": []}, "messages"),
    ],
)
def test_bad_chat_parameters_are_400(client, tiny_engine, kwargs, param):
    kwargs = {"model": tiny_engine.model_id, "messages": MSG, "max_tokens": 2, **kwargs}
    body = sdk_error(client.chat.completions.create, 400, **kwargs)
    assert_error_shape(body, param=param)


def test_unknown_model_is_404_model_not_found(client):
    body = sdk_error(client.chat.completions.create, 404, model="gpt-17", messages=MSG)
    assert_error_shape(body, param="model", code="model_not_found")
    body = sdk_error(client.completions.create, 404, model="gpt-17", prompt="x")
    assert_error_shape(body, code="model_not_found")


def test_context_length_exceeded(client, tiny_engine):
    huge = "word " * (tiny_engine.max_model_len + 10)
    body = sdk_error(client.chat.completions.create, 400, model=tiny_engine.model_id,
                     messages=[{"role": "user", "content": huge}])
    assert_error_shape(body, code="context_length_exceeded", param="messages")
    body = sdk_error(client.chat.completions.create, 400, model=tiny_engine.model_id, messages=MSG,
                     max_tokens=tiny_engine.max_model_len)
    assert_error_shape(body, code="context_length_exceeded", param="max_tokens")
    body = sdk_error(client.completions.create, 400, model=tiny_engine.model_id,
                     prompt=[1] * tiny_engine.max_model_len)
    assert_error_shape(body, code="context_length_exceeded", param="prompt")


def test_completion_token_ids_outside_the_vocabulary(client, tiny_engine):
    body = sdk_error(client.completions.create, 400, model=tiny_engine.model_id, prompt=[1, 10**9])
    assert_error_shape(body, param="prompt")


def test_images_on_a_text_only_model(client, tiny_engine):
    png = "data:image/png;base64," + base64.b64encode(b"\x89PNG fake").decode()
    for url in (png, "https://example.com/cat.png"):
        content = [{"type": "text", "text": "what is this"}, {"type": "image_url", "image_url": {"url": url}}]
        body = sdk_error(client.chat.completions.create, 400, model=tiny_engine.model_id,
                         messages=[{"role": "user", "content": content}])
        error = assert_error_shape(body, param="messages[0].content[1]")
        assert "model does not accept images" in error["message"]


def test_more_images_than_the_policy_allows_are_refused_before_any_is_decoded(client, tiny_engine):
    never_decoded = {"type": "image_url", "image_url": {"url": "data:image/png;base64,@@not-base64@@"}}
    content = [{"type": "text", "text": "compare"}, *[never_decoded] * 9]
    body = sdk_error(client.chat.completions.create, 400, model=tiny_engine.model_id,
                     messages=[{"role": "user", "content": content}])
    error = assert_error_shape(body, code="too_many_images", param="messages[0].content[9]")
    assert "At most 8 images" in error["message"]
    parts = [{"type": "input_image", "image_url": "data:image/png;base64,@@", "detail": "low"}] * 9
    body = sdk_error(client.responses.create, 400, model=tiny_engine.model_id, store=False,
                     input=[{"role": "user", "content": parts}])
    assert_error_shape(body, code="too_many_images", param="input[0].content[8]")


def test_responses_input_image_errors_name_the_input_item_and_part(client, tiny_engine):
    png = "data:image/png;base64," + base64.b64encode(b"\x89PNG fake").decode()
    content = [{"type": "input_text", "text": "what is this"},
               {"type": "input_image", "image_url": png, "detail": "auto"}]
    body = sdk_error(client.responses.create, 400, model=tiny_engine.model_id, store=False,
                     instructions="Be brief.", input=[{"role": "user", "content": content}])
    error = assert_error_shape(body, param="input[0].content[1]")
    assert "model does not accept images" in error["message"]
    bad_detail = [{"type": "input_image", "image_url": png, "detail": "huge"}]
    body = sdk_error(client.responses.create, 400, model=tiny_engine.model_id, store=False,
                     input=[{"role": "user", "content": "hi"}, {"role": "user", "content": bad_detail}])
    assert_error_shape(body, param="input[1].content[0].detail")


@pytest.mark.parametrize("raw", [b"{not json", b"", b'{"messages": [', b"\xff\xfe"])
def test_malformed_json_is_400(live, raw):
    resp = httpx.post(live.api_url + "/chat/completions", content=raw, headers=JSON)
    assert resp.status_code == 400
    assert_error_shape(resp.json(), code="invalid_json")


def test_non_object_json_is_400(live):
    resp = httpx.post(live.api_url + "/completions", json=[1, 2])
    assert resp.status_code == 400
    assert_error_shape(resp.json(), code="invalid_json")


def test_oversized_body_is_413(live, tiny_engine):
    big = {"model": tiny_engine.model_id, "messages": [{"role": "user", "content": "x" * 70_000}]}
    resp = httpx.post(live.api_url + "/chat/completions", json=big)
    assert resp.status_code == 413
    assert_error_shape(resp.json(), code="request_too_large")

    def chunks():
        yield b'{"model": "x", "prompt": "'
        for _ in range(20):
            yield b"y" * 8192
        yield b'"}'

    # Without a content-length (chunked), the bound is enforced while reading.
    resp = httpx.post(live.api_url + "/completions", content=chunks(), headers=JSON)
    assert resp.status_code == 413
    assert_error_shape(resp.json(), code="request_too_large")


def test_unknown_route_and_wrong_method(live):
    resp = httpx.get(live.api_url + "/nothing")
    assert resp.status_code == 404
    assert_error_shape(resp.json(), code="not_found")
    resp = httpx.get(live.api_url + "/chat/completions")
    assert resp.status_code == 405
    assert_error_shape(resp.json(), code="method_not_allowed")


def test_errors_leave_no_blocks_held_and_the_server_keeps_serving(client, tiny_engine):
    for _ in range(3):
        sdk_error(client.chat.completions.create, 400, model=tiny_engine.model_id, messages=MSG, temperature=9)
    ok = client.chat.completions.create(model=tiny_engine.model_id, messages=MSG, max_tokens=2)
    assert ok.usage.prompt_tokens_details.cached_tokens == 0
    kv = tiny_engine.kv_cache_manager
    wait_until(lambda: kv.num_free_blocks == kv.num_blocks, 30, "all blocks free")


def test_a_client_leaving_mid_body_is_counted_as_a_client_error(live):
    import socket

    from prometheus_client.parser import text_string_to_metric_families

    def client_errors() -> float:
        text = httpx.get(live.base_url + "/metrics").text
        return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples
                   if s.name == "prefixgate_engine_requests_total" and s.labels.get("outcome") == "client_error")

    port = int(live.base_url.rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", port)) as sock:
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 1000\r\n\r\n{\"messages\": ")
    wait_until(lambda: client_errors() == 1, 30, "the abandoned upload to be counted")
    assert httpx.get(live.base_url + "/health").status_code == 200


@pytest.mark.parametrize("depth", [130, 254, 1000])
def test_deeply_nested_tools_are_400_not_5xx(live, tiny_engine, depth):
    """Tool parameters nested 1,000 deep used to fail rendering with a RecursionError (a 503)."""
    parameters = b'{"a": ' * depth + b"1" + b"}" * depth  # raw: no Python encoder takes 1,000 levels
    raw = (b'{"model": "%s", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}], '
           b'"tools": [{"type": "function", "function": {"name": "f", "parameters": %s}}]}'
           % (tiny_engine.model_id.encode(), parameters))
    resp = httpx.post(live.api_url + "/chat/completions", content=raw, headers=JSON)
    assert resp.status_code == 400, resp.text
    assert_error_shape(resp.json(), param="tools", code="json_too_deep")


def test_deeply_nested_content_and_body_are_400(live, tiny_engine):
    deep = b"[" * 300 + b"]" * 300
    for path, raw in [
        ("/chat/completions", b'{"messages": [{"role": "user", "content": ' + deep + b"}]}"),
        ("/completions", b'{"prompt": "x", "metadata": ' + deep + b"}"),
        ("/completions", b'{"prompt": ' + b"[" * 1100 + b"]" * 1100 + b"}"),
    ]:
        resp = httpx.post(live.api_url + path, content=raw, headers=JSON)
        assert resp.status_code == 400, resp.text
        assert_error_shape(resp.json())


@pytest.mark.parametrize("temperature", [1e-45, 1e-300, 1e-320])
def test_temperatures_too_small_to_divide_by_are_served_greedily(client, tiny_engine, temperature):
    greedy = client.chat.completions.create(model=tiny_engine.model_id, messages=MSG, max_tokens=4, temperature=0)
    tiny = client.chat.completions.create(model=tiny_engine.model_id, messages=MSG, max_tokens=4,
                                          temperature=temperature)
    assert tiny.choices[0].message.content == greedy.choices[0].message.content
    assert tiny.choices[0].finish_reason in ("stop", "length")


def test_a_prompt_too_long_by_its_size_alone_is_refused_without_tokenizing(tiny_engine):
    """Each token covers at most `max_token_chars` characters: past that many per token of
    context the prompt cannot fit, so it is refused before the tokenizer (and its lock) is used."""
    from engine.contract.body_reader import BodyReader
    from engine.contract.images import MediaPolicy
    from engine.server.request_handler import RequestHandler

    handler = RequestHandler(tiny_engine, media=MediaPolicy(), bodies=BodyReader())
    per_token = handler.renderer.max_token_chars
    assert per_token is not None and per_token >= max(len(t) for t in tiny_engine.tokenizer.get_vocab())
    calls = []

    class Counting:
        def __getattr__(self, name):
            calls.append(name)
            return getattr(tiny_engine.tokenizer, name)

    handler.renderer.tokenizer = Counting()
    limit = (tiny_engine.max_model_len - 1) * per_token
    cases = [
        ("chat", {"messages": [{"role": "system", "content": "x" * (limit // 2)},
                               {"role": "user", "content": [{"type": "text", "text": "y" * (limit // 2 + 2)}]}]},
         "messages"),
        ("completion", {"prompt": "2024-01-01 " * (limit // 11 + 1)}, "prompt"),
    ]
    for kind, body, param in cases:
        with pytest.raises(APIError) as info:
            handler._prepare(json.dumps({"model": tiny_engine.model_id, **body}).encode(), kind)
        assert (info.value.status_code, info.value.code, info.value.param) == (400, "context_length_exceeded", param)
        assert "characters" in info.value.message
    assert calls == []  # the tokenizer was never touched
    # Just under the bound, the size alone does not decide: it is tokenized (then refused by count).
    with pytest.raises(APIError) as info:
        handler._prepare(json.dumps({"model": tiny_engine.model_id, "prompt": "x" * limit}).encode(), "completion")
    assert info.value.code == "context_length_exceeded" and "encode" in calls
