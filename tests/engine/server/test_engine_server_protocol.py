"""engine.server.protocol: every sampling field's type and range, and the context-length rule."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.contract.errors import APIError
from engine.server.protocol import parse_chat_body, parse_completion_body

VOCAB = 1000
MSGS = [{"role": "user", "content": "hi"}]
TOOLS = [{"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}]


def chat(**fields):
    return parse_chat_body({"messages": MSGS, **fields}, VOCAB)


def refused(fn, body, param, status=400, code=None):
    with pytest.raises(APIError) as info:
        fn(body, VOCAB)
    err = info.value
    assert (err.status_code, err.param) == (status, param), err
    if code is not None:
        assert err.code == code
    shape = err.to_dict()
    assert set(shape["error"]) == {"message", "type", "param", "code"}
    assert shape["error"]["type"] == "invalid_request_error" and shape["error"]["message"]
    return err


def test_defaults():
    body = chat()
    assert (body.kind, body.model, body.stream, body.include_usage) == ("chat", None, False, False)
    assert (body.temperature, body.top_p, body.top_k, body.seed) == (1.0, 1.0, None, None)
    assert body.stop == () and body.stop_token_ids == () and body.cache_salt is None
    params = body.sampling_params(num_prompt_tokens=10, max_model_len=100)
    assert params.max_tokens == 90  # chat fills the context by default


def test_all_fields_reach_the_sampling_params():
    body = chat(
        model="m", temperature=0, top_p=0.5, top_k=7, seed=3, max_tokens=5, stop="END",
        stop_token_ids=[1, 2], ignore_eos=True, stream=True, stream_options={"include_usage": True},
        cache_salt="tenant-a", n=1, logprobs=False, presence_penalty=0, frequency_penalty=0.0,
    )
    p = body.sampling_params(10, 100)
    assert (p.max_tokens, p.temperature, p.top_p, p.top_k, p.seed) == (5, 0.0, 0.5, 7, 3)
    assert p.stop == ("END",) and p.stop_token_ids == (1, 2) and p.ignore_eos
    assert body.stream and body.include_usage and body.cache_salt == "tenant-a" and body.model == "m"


def test_max_completion_tokens_wins_over_max_tokens():
    assert chat(max_tokens=9, max_completion_tokens=4).sampling_params(1, 100).max_tokens == 4


@pytest.mark.parametrize("top_k", [0, -1, None])
def test_top_k_zero_or_minus_one_means_no_limit(top_k):
    assert chat(top_k=top_k).top_k is None


def test_stop_list_and_integral_float_ints():
    assert chat(stop=["a", "b"]).stop == ("a", "b")
    assert chat(max_tokens=3.0).max_tokens == 3


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"temperature": "hot"}, "temperature"),
        ({"temperature": True}, "temperature"),
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": 2.5}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_p": "1"}, "top_p"),
        ({"top_k": 2.5}, "top_k"),
        ({"top_k": -2}, "top_k"),
        ({"seed": "7"}, "seed"),
        ({"seed": 2**70}, "seed"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": "10"}, "max_tokens"),
        ({"max_completion_tokens": -1}, "max_completion_tokens"),
        ({"stop": 3}, "stop"),
        ({"stop": ["ok", ""]}, "stop"),
        ({"stop": [str(i) for i in range(17)]}, "stop"),
        ({"stop_token_ids": [1, VOCAB]}, "stop_token_ids"),
        ({"stop_token_ids": [True]}, "stop_token_ids"),
        ({"stop_token_ids": 3}, "stop_token_ids"),
        ({"stream": "yes"}, "stream"),
        ({"stream_options": {"include_usage": True}}, "stream_options"),
        ({"stream": True, "stream_options": []}, "stream_options"),
        ({"stream": True, "stream_options": {"include_usage": 1}}, "include_usage"),
        ({"model": 5}, "model"),
        ({"ignore_eos": "no"}, "ignore_eos"),
        ({"n": 0}, "n"),
        ({"messages": []}, "messages"),
        ({"messages": "hi"}, "messages"),
        ({"messages": ["hi"]}, "messages"),
        ({"tools": {"a": 1}}, "tools"),
        ({"response_format": "json"}, "response_format"),
        ({"response_format": {"type": "xml"}}, "response_format.type"),
        ({"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
        ({"response_format": {"type": "json_schema", "json_schema": {"schema": {}}}},
         "response_format.json_schema.name"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": []}}},
         "response_format.json_schema.schema"),
        ({"n": 17}, "n"),
        ({"top_logprobs": 3}, "top_logprobs"),
        ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        ({"logprobs": 1}, "logprobs"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tool_choice": "sometimes", "tools": TOOLS}, "tool_choice"),
        ({"tool_choice": {"type": "function", "function": {"name": "nope"}}, "tools": TOOLS},
         "tool_choice"),
        ({"tools": TOOLS, "parallel_tool_calls": "yes"}, "parallel_tool_calls"),
        ({"tools": [{"type": "code_interpreter"}]}, "tools[0].type"),
        ({"tools": [{"type": "function", "function": {"description": "x"}}]}, "tools[0].function.name"),
    ],
)
def test_bad_types_and_ranges_are_400_naming_the_field(fields, param):
    refused(parse_chat_body, {"messages": MSGS, **fields}, param)


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"presence_penalty": 0.5}, "presence_penalty"),
        ({"frequency_penalty": -1}, "frequency_penalty"),
        ({"repetition_penalty": 1.2}, "repetition_penalty"),
        ({"logit_bias": {"5": 1}}, "logit_bias"),
    ],
)
def test_unimplemented_features_are_refused_clearly(fields, param):
    err = refused(parse_chat_body, {"messages": MSGS, **fields}, param, code="unsupported_parameter")
    assert "not supported" in err.message or "Only" in err.message


def test_openai_features_reach_the_body_and_params():
    body = chat(n=3, logprobs=True, top_logprobs=2, tools=TOOLS, parallel_tool_calls=False,
                tool_choice={"type": "function", "function": {"name": "get_time"}},
                response_format={"type": "json_schema",
                                 "json_schema": {"name": "t", "schema": {"type": "object"}, "strict": True}})
    assert body.n == 3 and body.logprobs == 2
    assert body.sampling_params(10, 100).logprobs == 2
    assert (body.tool_choice.mode, body.tool_choice.name, body.tool_choice.parallel) == ("named", "get_time", False)
    assert body.response_format is not None and body.response_format.schema == {"type": "object"}
    assert chat(logprobs=True).logprobs == 0 and chat().logprobs is None
    assert chat(tools=TOOLS).tool_choice.mode == "auto" and chat().tool_choice.mode == "none"
    assert parse_completion_body({"prompt": "x", "logprobs": 3, "n": 2}, VOCAB).logprobs == 3


@pytest.mark.parametrize("salt", ["", "x" * 1025, 5, ["a"], True])
def test_bad_cache_salt(salt):
    refused(parse_chat_body, {"messages": MSGS, "cache_salt": salt}, "cache_salt")


def test_cache_salt_limits_are_inclusive():
    assert chat(cache_salt="x" * 1024).cache_salt == "x" * 1024
    assert chat(cache_salt="é").cache_salt == "é"


@pytest.mark.parametrize("body", [[], "x", 3, None])
def test_body_must_be_an_object(body):
    refused(parse_chat_body, body, None, code="invalid_json")


def test_context_length_rules():
    with pytest.raises(APIError) as info:
        chat().sampling_params(num_prompt_tokens=100, max_model_len=100)
    assert info.value.code == "context_length_exceeded" and info.value.param == "messages"
    with pytest.raises(APIError) as info:
        chat(max_tokens=11).sampling_params(num_prompt_tokens=90, max_model_len=100)
    assert info.value.code == "context_length_exceeded" and info.value.param == "max_tokens"
    assert chat(max_tokens=10).sampling_params(90, 100).max_tokens == 10
    assert chat().sampling_params(99, 100).max_tokens == 1


# ---------------------------------------------------------------- completions
def test_completion_prompt_forms():
    assert parse_completion_body({"prompt": "abc"}, VOCAB).prompt == "abc"
    assert parse_completion_body({"prompt": [1, 2, 3]}, VOCAB).prompt == [1, 2, 3]
    assert parse_completion_body({"prompt": ["abc"]}, VOCAB).prompt == "abc"
    assert parse_completion_body({"prompt": [[4, 5]]}, VOCAB).prompt == [4, 5]


def test_completion_default_max_tokens_is_16_within_the_context():
    body = parse_completion_body({"prompt": "abc"}, VOCAB)
    assert body.sampling_params(10, 100).max_tokens == 16
    assert body.sampling_params(95, 100).max_tokens == 5


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({}, "prompt"),
        ({"prompt": ""}, "prompt"),
        ({"prompt": []}, "prompt"),
        ({"prompt": [1, VOCAB]}, "prompt"),
        ({"prompt": [1, -1]}, "prompt"),
        ({"prompt": [1.5]}, "prompt"),
        ({"prompt": {"text": "x"}}, "prompt"),
        ({"prompt": ["a", "b"]}, "prompt"),
        ({"prompt": "x", "echo": True}, "echo"),
        ({"prompt": "x", "logprobs": 21}, "logprobs"),
        ({"prompt": "x", "logprobs": True}, "logprobs"),
        ({"prompt": "x", "best_of": 3}, "best_of"),
        ({"prompt": "x", "suffix": "y"}, "suffix"),
        ({"prompt": "x", "n": 17}, "n"),
        ({"prompt": "x", "max_tokens": 0}, "max_tokens"),
    ],
)
def test_bad_completion_bodies(fields, param):
    refused(parse_completion_body, fields, param)


# ---------------------------------------------------------------- robustness

JSON = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats(allow_nan=False) | st.text(max_size=5),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3),
    max_leaves=8,
)
FIELDS = ["model", "messages", "prompt", "temperature", "top_p", "top_k", "seed", "max_tokens",
          "max_completion_tokens", "stop", "stop_token_ids", "n", "stream", "stream_options", "logprobs",
          "top_logprobs", "cache_salt", "tools", "tool_choice", "response_format", "presence_penalty",
          "logit_bias", "ignore_eos", "echo", "best_of", "suffix", "min_tokens", "parallel_tool_calls"]


@settings(max_examples=300, deadline=None)
@given(st.dictionaries(st.sampled_from(FIELDS), JSON, max_size=6), st.booleans())
def test_any_json_body_is_accepted_or_refused_with_an_api_error(fields, completion):
    body = dict(fields)
    if completion:
        body.setdefault("prompt", "x")
        parse = parse_completion_body
    else:
        body.setdefault("messages", MSGS)
        parse = parse_chat_body
    try:
        parsed = parse(body, VOCAB)
    except APIError as err:
        assert 400 <= err.status_code < 500 and err.message
        return
    try:
        parsed.sampling_params(num_prompt_tokens=5, max_model_len=64)
    except APIError as err:
        assert err.code == "context_length_exceeded"
