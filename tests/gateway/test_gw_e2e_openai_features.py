"""End to end with clients nobody here wrote: the official openai SDK and instructor against
`prefixgate serve` (real bundled model, real engine child process, real HTTP on loopback).

Covers what agent frameworks send: structured outputs (``parse`` with a pydantic
model), forced and streamed tool calls, ``n=2``, logprobs, the Responses API
streamed and not, and instructor's TOOLS and JSON_SCHEMA modes. One server for
the module, with two tenants and an admin key."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from typing import Literal

import httpx
import openai
import pytest
from gw_fakes import rows, wait_healthy
from pydantic import BaseModel
from support.net import free_port

from gateway.policy.api_key import hash_key
from gateway.stats.database import default_db_url

pytestmark = pytest.mark.real_model

MODEL = "SmolLM2-135M-Instruct"
KEYS = {"features": "features-key-0123456789", "responses": "responses-key-0123456789"}
ADMIN = "admin-key-0123456789"
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"},
                                                    "unit": {"enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"]}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "The local time in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
ASK = [{"role": "user", "content": "What is the weather in Oslo?"}]
PARIS = ("Paris is the capital of France. Describe Paris as a JSON object with name, country "
         "and population.")
# Greedy decoding makes this 135M model repeat a digit until max_tokens inside a JSON
# integer (the grammar allows any length), so JSON outputs are sampled with a fixed seed.
SAMPLED = {"temperature": 1.0, "seed": 3}


class City(BaseModel):
    name: str
    country: str
    population: int


class Weather(BaseModel):
    city: str
    unit: Literal["celsius", "fahrenheit"]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    data = tmp_path_factory.mktemp("serve-features")
    config = data / "gateway.toml"
    config.write_text(f'[server]\nadmin_keys = ["{hash_key(ADMIN)}"]\n' + "".join(
        f'[tenants.{name}]\nkeys = ["{hash_key(key)}"]\n' for name, key in KEYS.items()))
    port, engine_port = free_port(), free_port()
    process = subprocess.Popen(
        [sys.executable, "-m", "gateway.cli", "serve", "--port", str(port), "--engine-port", str(engine_port),
         "--data-dir", str(data), "--config", str(config), "--log-level", "warning"],
        env={**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"},
    )
    url = f"http://127.0.0.1:{port}"
    wait_healthy(url, process, name="prefixgate serve", timeout=900, interval=0.5)
    yield url, data
    process.send_signal(signal.SIGINT)
    try:
        assert process.wait(120) == 0
    finally:
        if process.poll() is None:
            process.kill()


def sdk(server, tenant="features"):
    return openai.OpenAI(base_url=server[0] + "/v1", api_key=KEYS[tenant], max_retries=0, timeout=300)


def test_parse_with_a_pydantic_model(server):
    completion = sdk(server).chat.completions.parse(
        model=MODEL, messages=[{"role": "user", "content": PARIS}],
        response_format=City, max_tokens=80, **SAMPLED,
    )
    choice = completion.choices[0]
    assert choice.finish_reason == "stop"
    assert isinstance(choice.message.parsed, City)
    assert City.model_validate_json(choice.message.content) == choice.message.parsed


def test_json_object_mode_returns_one_object(server):
    completion = sdk(server).chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Give me a JSON object about cats."}],
        response_format={"type": "json_object"}, max_tokens=60, temperature=0,
    )
    if completion.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(completion.choices[0].message.content), dict)
    else:  # cut by max_tokens: still a JSON object's beginning
        assert completion.choices[0].message.content.startswith("{")


def test_forced_named_tool_call(server):
    completion = sdk(server).chat.completions.create(
        model=MODEL, messages=ASK, tools=[TIME, WEATHER], temperature=0, max_tokens=80,
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
    )
    choice = completion.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    [call] = choice.message.tool_calls
    assert call.function.name == "get_weather" and call.id.startswith("call_")
    Weather.model_validate_json(call.function.arguments)


def test_required_tool_call_streamed_and_the_conversation_continues(server):
    client = sdk(server)
    stream = client.chat.completions.create(
        model=MODEL, messages=ASK, tools=[WEATHER, TIME], tool_choice="required",
        parallel_tool_calls=False, temperature=0, max_tokens=80, stream=True,
    )
    calls, reasons = [], []
    for chunk in stream:
        for choice in chunk.choices:
            calls += choice.delta.tool_calls or []
            reasons += [choice.finish_reason] if choice.finish_reason else []
    assert reasons == ["tool_calls"] and len(calls) == 1
    call = calls[0]
    assert call.index == 0 and call.function.name in ("get_weather", "get_time")
    json.loads(call.function.arguments)
    # the tool's result goes back in; with tool_choice none the model answers in text
    answer = client.chat.completions.create(
        model=MODEL, tools=[WEATHER, TIME], tool_choice="none", temperature=0, max_tokens=20,
        messages=[*ASK, {"role": "assistant", "content": None, "tool_calls": [
            {"id": call.id, "type": "function",
             "function": {"name": call.function.name, "arguments": call.function.arguments}}]},
            {"role": "tool", "tool_call_id": call.id, "content": "Sunny, 21 degrees."}],
    )
    assert answer.choices[0].message.tool_calls == [] and answer.choices[0].message.content


def test_n_2_counts_the_prompt_once_and_streams_each_index(server):
    client = sdk(server)
    messages = [{"role": "user", "content": "Name a colour."}]
    single = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=6, seed=1)
    double = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=6, n=2, seed=1)
    assert [c.index for c in double.choices] == [0, 1]
    assert double.usage.prompt_tokens == single.usage.prompt_tokens
    assert single.usage.completion_tokens < double.usage.completion_tokens <= 12
    assert double.choices[0].message.content == single.choices[0].message.content  # seed + 0
    stream = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=6, n=2,
                                            stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    finished = sorted(c.choices[0].index for c in chunks if c.choices and c.choices[0].finish_reason)
    assert finished == [0, 1]
    assert chunks[-1].usage.prompt_tokens == single.usage.prompt_tokens


def test_chat_logprobs_whole_and_streamed(server):
    client = sdk(server)
    messages = [{"role": "user", "content": "Say hello."}]
    completion = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=5,
                                                temperature=0, logprobs=True, top_logprobs=3)
    entries = completion.choices[0].logprobs.content
    assert len(entries) == completion.usage.completion_tokens
    for entry in entries:
        assert len(entry.top_logprobs) == 3 and entry.logprob <= 0
        # greedy picks a most likely token (bfloat16 logits may tie with the listed top one)
        assert entry.logprob == pytest.approx(entry.top_logprobs[0].logprob)
    stream = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=5,
                                            temperature=0, logprobs=True, top_logprobs=3, stream=True)
    streamed = [e for c in stream if c.choices and c.choices[0].logprobs
                for e in c.choices[0].logprobs.content]
    assert [e.token for e in streamed] == [e.token for e in entries]


def test_completion_logprobs(server):
    completion = sdk(server).completions.create(model=MODEL, prompt="The capital of France is",
                                                max_tokens=3, temperature=0, logprobs=2)
    logprobs = completion.choices[0].logprobs
    assert len(logprobs.tokens) == len(logprobs.token_logprobs) == 3
    assert all(len(top) <= 2 for top in logprobs.top_logprobs)
    assert "".join(logprobs.tokens) == completion.choices[0].text
    assert logprobs.text_offset[0] == 0


def test_responses_create_and_stream(server):
    client = sdk(server, "responses")
    instructions = "You are a terse assistant of a bicycle shop. " * 12
    response = client.responses.create(model=MODEL, instructions=instructions, input="Say hello.",
                                       max_output_tokens=40, store=False, temperature=0)
    assert response.output_text and response.usage.input_tokens > 144
    assert response.usage.input_tokens_details.cached_tokens == 0
    events = []
    with client.responses.stream(model=MODEL, instructions=instructions, input="Say goodbye.",
                                 max_output_tokens=40, store=False, temperature=0) as stream:
        for event in stream:
            events.append(event.type)
        final = stream.get_final_response() if events[-1] == "response.completed" else None
    assert events[:3] == ["response.created", "response.in_progress", "response.output_item.added"]
    assert "response.output_text.delta" in events
    assert events[-1] in ("response.completed", "response.incomplete")
    if final is not None:
        assert final.usage.input_tokens_details.cached_tokens >= 128  # the instructions' blocks
    # the gateway wrote one stats row per Responses request, with token counts
    flushed = httpx.get(server[0] + "/v1/cache/stats", headers={"authorization": f"Bearer {ADMIN}"},
                        timeout=60)  # the admin endpoint flushes the stats writer first
    assert flushed.status_code == 200
    logged = [r for r in rows(default_db_url(server[1])) if r.endpoint == "responses"]
    assert len(logged) == 2 and all(r.prompt_tokens and r.completion_tokens for r in logged)
    assert logged[1].cached_tokens >= 128


def test_responses_function_call_round_trip(server):
    client = sdk(server)
    tool = {"type": "function", **WEATHER["function"]}
    first = client.responses.create(model=MODEL, input="Weather in Oslo?", tools=[tool],
                                    tool_choice={"type": "function", "name": "get_weather"},
                                    store=False, max_output_tokens=200, temperature=SAMPLED["temperature"],
                                    extra_body={"seed": SAMPLED["seed"]})  # unseeded, the call could run past the limit
    [call] = [item for item in first.output if item.type == "function_call"]
    Weather.model_validate_json(call.arguments)
    second = client.responses.create(
        model=MODEL, tools=[tool], store=False, max_output_tokens=10, tool_choice="none",
        input=[{"role": "user", "content": "Weather in Oslo?"},
               {"type": "function_call", "call_id": call.call_id, "name": call.name, "arguments": call.arguments},
               {"type": "function_call_output", "call_id": call.call_id, "output": "Rain."}])
    assert second.output[0].type == "message"


def test_responses_json_schema_format(server):
    response = sdk(server).responses.create(
        model=MODEL, input=PARIS, store=False, max_output_tokens=80, temperature=1.0,
        extra_body={"seed": SAMPLED["seed"]},
        text={"format": {"type": "json_schema", "name": "city", "strict": True,
                         "schema": City.model_json_schema()}})
    City.model_validate_json(response.output_text)


def test_a_schema_the_library_cannot_compile_is_a_400_naming_it(server):
    response = httpx.post(server[0] + "/v1/chat/completions", timeout=60,
                          headers={"authorization": f"Bearer {KEYS['features']}"},
                          json={"model": MODEL, "messages": ASK, "response_format": {
                              "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "strang"}}}})
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["param"] == "response_format.json_schema.schema" and "strang" in error["message"]


def test_instructor_tools_and_json_schema_modes(server):
    import instructor
    for mode in (instructor.Mode.TOOLS, instructor.Mode.JSON_SCHEMA):
        client = instructor.from_openai(sdk(server), mode=mode)
        weather = client.chat.completions.create(
            model=MODEL, response_model=Weather, messages=ASK, max_tokens=80, max_retries=0, **SAMPLED)
        assert isinstance(weather, Weather), mode
