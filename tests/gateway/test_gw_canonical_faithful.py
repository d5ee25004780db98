"""Canonicalization never changes an answer: the real bundled model, its constrained decoding,
with and without each step, through `prefixgate gateway` and straight to `prefixgate engine`.

One engine (real SmolLM2-135M, an API key of its own so this test can also call it
directly) and one gateway in front of it, for the module. Tenants: ``off`` (no
canonicalization), ``canon`` (every step) and ``only_<switch>`` (one switch on). Each
step is checked by a request it rewrites (the ``x-prefixgate-canonicalized`` header
says it applied) answered identically, at temperature 0, with and without it.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import httpx
import openai
import pytest
from gw_fakes import wait_healthy
from pydantic import BaseModel
from support.net import free_port

from gateway.config.config_file import CanonicalizeSwitches
from gateway.policy.api_key import hash_key

pytestmark = pytest.mark.real_model

MODEL = "SmolLM2-135M-Instruct"
ENGINE_KEY = "engine-key-0123456789"
SWITCHES = list(CanonicalizeSwitches.__dataclass_fields__)
TENANTS = ["off", "canon", *(f"only_{s}" for s in SWITCHES)]


def key(tenant: str) -> str:
    return f"{tenant}-key-0123456789"


def _config(tenant: str) -> str:
    head = f'[tenants.{tenant}]\nkeys = ["{hash_key(key(tenant))}"]\n'
    if tenant == "off":
        return head + "canonicalize = false\n"
    if tenant.startswith("only_"):
        on = tenant.removeprefix("only_")
        return head + f"[tenants.{tenant}.canonicalize]\n" + "".join(
            f"{s} = {'true' if s == on else 'false'}\n" for s in SWITCHES)
    return head


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    data = tmp_path_factory.mktemp("faithful")
    (data / "gateway.toml").write_text("".join(_config(t) for t in TENANTS))
    engine_port, port = free_port(), free_port()
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    engine = subprocess.Popen(
        [sys.executable, "-m", "gateway.cli", "engine", "--port", str(engine_port), "--api-key", ENGINE_KEY,
         "--log-level", "warning"], env=env)
    gateway = None
    try:
        engine_url = f"http://127.0.0.1:{engine_port}"
        wait_healthy(engine_url, engine, name="prefixgate engine", timeout=900, interval=0.5)
        gateway = subprocess.Popen(
            [sys.executable, "-m", "gateway.cli", "gateway", "--upstream", engine_url, "--workers", "1",
             "--port", str(port), "--data-dir", str(data), "--config", str(data / "gateway.toml"),
             "--log-level", "warning"],
            env={**env, "PREFIXGATE_UPSTREAM_API_KEY": ENGINE_KEY})
        url = f"http://127.0.0.1:{port}"
        wait_healthy(url, gateway, name="prefixgate gateway", timeout=300, interval=0.5)
        yield url, engine_url
    finally:
        for process in (gateway, engine):
            if process is not None:
                process.send_signal(signal.SIGINT)
                try:
                    process.wait(120)
                finally:
                    if process.poll() is None:
                        process.kill()


def via(servers, tenant: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=servers[0] + "/v1", api_key=key(tenant), max_retries=0, timeout=600)


def direct(servers) -> openai.OpenAI:
    return openai.OpenAI(base_url=servers[1] + "/v1", api_key=ENGINE_KEY, max_retries=0, timeout=600)


class Pet(BaseModel):
    name: str
    species: str
    age: int


PET_MESSAGES = [{"role": "system", "content": "You extract facts as JSON."},
                {"role": "user", "content": "Rex is a 3 year old dog. Give his name, species and age."}]


def test_parse_through_the_gateway_equals_the_engine_and_keeps_field_order(servers):
    kwargs = {"model": MODEL, "messages": PET_MESSAGES, "response_format": Pet, "temperature": 0,
              "max_tokens": 60}
    raw = via(servers, "canon").chat.completions.with_raw_response.parse(**kwargs)
    assert "response_format.keys_sorted" in raw.headers["x-prefixgate-canonicalized"]
    through = raw.parse().choices[0].message
    straight = direct(servers).chat.completions.parse(**kwargs).choices[0].message
    assert through.content == straight.content
    assert through.parsed == straight.parsed and through.parsed is not None
    assert list(json.loads(through.content)) == ["name", "species", "age"]


def test_chain_of_thought_schema_reasons_before_it_answers(servers):
    schema = {"type": "object", "additionalProperties": False, "required": ["reasoning", "answer"],
              "properties": {"reasoning": {"type": "string", "maxLength": 120}, "answer": {"type": "integer"}}}
    kwargs = {"model": MODEL, "temperature": 0, "max_tokens": 80,
              "messages": [{"role": "user", "content": "What is 7 + 5? Think first."}],
              "response_format": {"type": "json_schema", "json_schema": {"name": "cot", "schema": schema}}}
    through = via(servers, "canon").chat.completions.create(**kwargs).choices[0].message.content
    straight = direct(servers).chat.completions.create(**kwargs).choices[0].message.content
    assert through == straight
    assert through is not None and through.lstrip().startswith('{"reasoning"')


BOOK = {"type": "function", "function": {
    "name": "book_hotel", "description": "Book a hotel room.",
    "parameters": {"type": "object", "required": ["city", "nights", "breakfast"],
                   "properties": {"city": {"type": "string"}, "nights": {"type": "integer"},
                                  "breakfast": {"type": "boolean"}}}}}
WEATHER = {"function": {"parameters": {"properties": {"city": {"type": "string"}}, "type": "object"},
                        "name": "a_weather", "description": "Weather in a city."}, "type": "function"}


def test_forced_tool_call_keeps_field_order(servers):
    kwargs = {"model": MODEL, "temperature": 0, "max_tokens": 60, "tools": [BOOK, WEATHER],
              "messages": [{"role": "user", "content": "Book two nights in Paris with breakfast."}],
              "tool_choice": {"type": "function", "function": {"name": "book_hotel"}}}
    raw = via(servers, "canon").chat.completions.with_raw_response.create(**kwargs)
    assert "tools.keys_sorted" in raw.headers["x-prefixgate-canonicalized"].split(",")
    through = raw.parse().choices[0].message.tool_calls
    straight = direct(servers).chat.completions.create(**kwargs).choices[0].message.tool_calls
    assert through and straight
    assert [(c.function.name, c.function.arguments) for c in through] == \
        [(c.function.name, c.function.arguments) for c in straight]
    assert list(json.loads(through[0].function.arguments)) == ["city", "nights", "breakfast"]


PET_SCHEMA = {"type": "object", "required": ["name", "species", "age"],
              "properties": {"name": {"type": "string"}, "species": {"type": "string"}, "age": {"type": "integer"}}}
CALL_HISTORY = [
    {"role": "user", "content": "Book two nights in Paris with breakfast."},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_b", "type": "function",
         "function": {"name": "book_hotel", "arguments": '{"city": "Paris",  "nights": 2, "breakfast": true}'}},
        {"id": "call_a", "type": "function", "function": {"name": "a_weather", "arguments": '{"city":"Paris"}'}}]},
    {"role": "tool", "tool_call_id": "call_a", "content": "Sunny, 21 C."},
    {"role": "tool", "tool_call_id": "call_b", "content": "Booked: confirmation HX-204."},
]
# One request per switch that the switch rewrites, and the step(s) it must report.
STEP_CASES = {
    "tools": ({"tools": [BOOK, WEATHER], "tool_choice": "required",
               "messages": [{"role": "user", "content": "Book two nights in Paris with breakfast."}]},
              {"tools.keys_sorted"}),
    "response_format": ({"messages": PET_MESSAGES,
                         "response_format": {"type": "json_schema",
                                             "json_schema": {"schema": PET_SCHEMA, "name": "Pet"}}},
                        {"response_format.keys_sorted"}),
    "tool_call_arguments": ({"tools": [BOOK, WEATHER], "messages": [*CALL_HISTORY[:2], *reversed(CALL_HISTORY[2:])]},
                            {"tool_calls.arguments_canonical"}),
    "single_text_part": ({"messages": [{"role": "system", "content": [{"type": "text", "text": "Answer in one line."}]},
                                       {"role": "user", "content": [{"type": "text", "text": "Name a red fruit."}]}]},
                         {"content.single_text_part"}),
}


@pytest.mark.parametrize("switch", list(STEP_CASES))
def test_each_step_leaves_the_answer_unchanged(servers, switch):
    body, steps = STEP_CASES[switch]
    kwargs = {"model": MODEL, "temperature": 0, "max_tokens": 40, **body}
    raw = via(servers, f"only_{switch}").chat.completions.with_raw_response.create(**kwargs)
    assert steps <= set(raw.headers.get("x-prefixgate-canonicalized", "").split(","))
    with_step = raw.parse().choices[0]
    without = via(servers, "off").chat.completions.create(**kwargs).choices[0]
    def answer(choice):
        calls = [(c.function.name, c.function.arguments) for c in choice.message.tool_calls or []]
        return choice.message.content, calls, choice.finish_reason
    assert answer(with_step) == answer(without)
    assert answer(with_step) == answer(direct(servers).chat.completions.create(**kwargs).choices[0])


def test_tools_and_tool_results_keep_their_order_by_default(servers):
    """Reordering tools or tool results reorders what the model reads in order: on this model
    each changed a temperature-0 answer to this history, so both steps are opt-in and the
    default tenant leaves the order alone."""
    kwargs = {"model": MODEL, "temperature": 0, "max_tokens": 40, "tools": [BOOK, WEATHER], "messages": CALL_HISTORY}
    raw = via(servers, "canon").chat.completions.with_raw_response.create(**kwargs)
    applied = raw.headers.get("x-prefixgate-canonicalized", "")
    assert "tool_results.reordered" not in applied and "tools.ordered_by_name" not in applied
    assert raw.parse().choices[0].message.content == \
        direct(servers).chat.completions.create(**kwargs).choices[0].message.content


@pytest.mark.parametrize(("switch", "step"), [("tool_order", "tools.ordered_by_name"),
                                              ("tool_result_order", "tool_results.reordered")])
def test_the_opt_in_order_steps_can_change_the_answer(servers, switch, step):
    """Why they are opt-in: with the step on, the same history gets another answer."""
    kwargs = {"model": MODEL, "temperature": 0, "max_tokens": 40, "tools": [BOOK, WEATHER],
              "messages": CALL_HISTORY}
    raw = via(servers, f"only_{switch}").chat.completions.with_raw_response.create(**kwargs)
    assert step in raw.headers.get("x-prefixgate-canonicalized", "")
    without = via(servers, "off").chat.completions.create(**kwargs).choices[0].message.content
    assert raw.parse().choices[0].message.content != without


def test_one_tool_through_responses_then_chat_is_no_ps203(servers):
    """The same tool sent through /v1/responses and then /v1/chat/completions has one canonical
    form, so the chat turn that repeats the Responses turn is no 'different JSON key order'
    (it was PS203 with ~190 tokens lost while the engine reported the prompt cached)."""
    headers = {"x-prefixgate-conversation": "cross-endpoint-1"}
    description = "Book a hotel room for the guest. " + "Rooms are booked per night, breakfast optional. " * 12
    function = {**BOOK["function"], "description": description}
    flat = {"type": "function", **function}
    first = httpx.post(servers[0] + "/v1/responses", timeout=600,
                       headers={**headers, "authorization": f"Bearer {key('canon')}"},
                       json={"model": MODEL, "instructions": "You book hotels.", "tools": [flat],
                             "input": "Book two nights in Paris.", "max_output_tokens": 4, "temperature": 0})
    assert first.status_code == 200, first.text
    raw = via(servers, "canon").chat.completions.with_raw_response.create(
        model=MODEL, max_tokens=4, temperature=0, tools=[{"type": "function", "function": function}],
        extra_headers=headers, messages=[{"role": "system", "content": "You book hotels."},
                                         {"role": "user", "content": "Book two nights in Paris."}])
    assert "PS203" not in raw.headers.get("x-prefixgate-warnings", "")
    usage = raw.parse().usage
    assert usage.prompt_tokens > 150 and usage.prompt_tokens_details.cached_tokens >= usage.prompt_tokens - 16
