"""Structured outputs, tool calls, n > 1, logprobs and /v1/responses on the engine server
(tiny random Llama over real loopback HTTP, the official openai SDK).

A randomly initialised model writes gibberish, so whatever it returns under a
grammar is the grammar's doing: these tests show the constraint is applied on
every token, not that the model is clever."""

import json

import httpx
import jsonschema
import openai
import pytest
from test_engine_http_fixtures import wait_until

SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                           "size": {"enum": ["S", "M", "L"]}},
          "required": ["name", "size"]}
TOOL = {"type": "function", "function": {"name": "lookup", "parameters": SCHEMA}}
MSGS = [{"role": "user", "content": "Fill in the form please."}]
PREFIX = " ".join(f"Rule {i}: be helpful and concise." for i in range(12))


def all_blocks_free(engine) -> bool:
    kv = engine.kv_cache_manager
    return kv.num_free_blocks == kv.num_blocks


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_a_random_model_still_writes_schema_valid_json(client, tiny_engine, seed):
    completion = client.chat.completions.create(
        model=tiny_engine.model_id, messages=MSGS, max_tokens=60, seed=seed,
        response_format={"type": "json_schema", "json_schema": {"name": "form", "schema": SCHEMA}})
    choice = completion.choices[0]
    if choice.finish_reason == "stop":
        value = json.loads(choice.message.content)
        jsonschema.validate(value, SCHEMA)
        assert set(value) == {"name", "size"}  # closed: no invented keys
    else:
        assert choice.message.content.startswith("{")


def test_forced_tool_call_from_a_random_model(client, tiny_engine):
    completion = client.chat.completions.create(
        model=tiny_engine.model_id, messages=MSGS, max_tokens=60, seed=4, tools=[TOOL],
        tool_choice={"type": "function", "function": {"name": "lookup"}})
    choice = completion.choices[0]
    if choice.finish_reason == "length":
        pytest.skip("the random model filled max_tokens inside the arguments")
    assert choice.finish_reason == "tool_calls"
    [call] = choice.message.tool_calls
    jsonschema.validate(json.loads(call.function.arguments), SCHEMA)


def test_the_grammar_leaves_the_prompt_and_its_cache_alone(client, tiny_engine):
    messages = [{"role": "system", "content": PREFIX}, *MSGS]
    plain = client.chat.completions.create(model=tiny_engine.model_id, messages=messages, max_tokens=2)
    shaped = client.chat.completions.create(
        model=tiny_engine.model_id, messages=messages, max_tokens=2, response_format={"type": "json_object"})
    assert shaped.usage.prompt_tokens == plain.usage.prompt_tokens
    assert shaped.usage.prompt_tokens_details.cached_tokens >= plain.usage.prompt_tokens - 16
    assert shaped.choices[0].message.content.startswith("{")


def test_n_choices_share_the_prompt_blocks_and_count_it_once(client, tiny_engine):
    messages = [{"role": "system", "content": PREFIX + " n test"}, *MSGS]
    before = tiny_engine.stats()
    completion = client.chat.completions.create(model=tiny_engine.model_id, messages=messages,
                                                max_tokens=3, n=3, temperature=1.0, seed=7)
    after = tiny_engine.stats()
    assert [c.index for c in completion.choices] == [0, 1, 2]
    prompt = completion.usage.prompt_tokens
    assert completion.usage.prompt_tokens_details.cached_tokens == 0  # choice 0 was a cold prefill
    assert completion.usage.completion_tokens == sum(3 for _ in completion.choices)
    # choices 1 and 2 took every full block of the prompt from the prefix cache
    full_blocks = (prompt - 1) // tiny_engine.block_size
    assert after.prefix_cache_hits - before.prefix_cache_hits >= 2 * full_blocks * tiny_engine.block_size
    wait_until(lambda: all_blocks_free(tiny_engine), 10, "all blocks free after n=3")


def test_n_choices_stream_with_their_index(client, tiny_engine):
    stream = client.chat.completions.create(model=tiny_engine.model_id, messages=MSGS, max_tokens=3,
                                            n=2, stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    text = {0: "", 1: ""}
    for chunk in chunks:
        for choice in chunk.choices:
            text[choice.index] += choice.delta.content or ""
    finishes = [c.choices[0].index for c in chunks if c.choices and c.choices[0].finish_reason]
    assert sorted(finishes) == [0, 1] and chunks[-1].usage.completion_tokens == 6


def test_logprobs_are_the_models_distribution(client, tiny_engine):
    completion = client.chat.completions.create(model=tiny_engine.model_id, messages=MSGS, max_tokens=4,
                                                temperature=0, logprobs=True, top_logprobs=5)
    entries = completion.choices[0].logprobs.content
    assert len(entries) == 4
    for entry in entries:
        tops = [t.logprob for t in entry.top_logprobs]
        assert tops == sorted(tops, reverse=True) and len(tops) == 5
        assert entry.logprob == pytest.approx(tops[0])  # greedy took a most likely token
        assert sum(2.718281828 ** lp for lp in tops) <= 1.0 + 1e-4
    plain = client.chat.completions.create(model=tiny_engine.model_id, messages=MSGS, max_tokens=4,
                                           temperature=0)
    assert plain.choices[0].logprobs is None


def test_responses_endpoint_on_the_engine(client, tiny_engine):
    response = client.responses.create(model=tiny_engine.model_id, input="hi", instructions=PREFIX,
                                       max_output_tokens=3)
    assert response.status == "incomplete" and response.usage.output_tokens == 3
    assert response.output[0].type == "message"
    again = client.responses.create(model=tiny_engine.model_id, input="hello", instructions=PREFIX,
                                    max_output_tokens=3)
    assert again.usage.input_tokens_details.cached_tokens >= 64
    with pytest.raises(openai.BadRequestError) as info:
        client.responses.create(model=tiny_engine.model_id, input="hi", store=True)
    assert info.value.body["param"] == "store"
    with pytest.raises(openai.BadRequestError) as info:
        client.responses.create(model=tiny_engine.model_id, input="hi", max_output_tokens=0)
    assert info.value.body["param"] == "max_output_tokens"
    with pytest.raises(openai.BadRequestError) as info:
        client.responses.create(model=tiny_engine.model_id, input="hi", text={"format": {
            "type": "json_schema", "name": "x", "schema": {"type": "strang"}}})
    assert info.value.body["param"] == "text.format.schema"
    wait_until(lambda: all_blocks_free(tiny_engine), 10, "all blocks free after responses")


def test_ignore_eos_with_a_grammar_is_a_400(client, tiny_engine):
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=tiny_engine.model_id, messages=MSGS, max_tokens=2,
                                       response_format={"type": "json_object"},
                                       extra_body={"ignore_eos": True})
    assert info.value.body["param"] == "ignore_eos"


def test_disconnect_mid_stream_with_n_choices_frees_every_choices_blocks(live, tiny_engine):
    body = {"model": tiny_engine.model_id, "messages": [{"role": "user", "content": "go on"}],
            "ignore_eos": True, "n": 3, "stream": True}
    with httpx.stream("POST", live.api_url + "/chat/completions", json=body, timeout=60) as resp:
        assert resp.status_code == 200
        seen: set[int] = set()
        for line in resp.iter_lines():
            if line.startswith("data: {"):
                seen.update(c["index"] for c in json.loads(line[6:])["choices"])
            if len(seen) == 3:  # every choice runs
                break
        assert not all_blocks_free(tiny_engine)
    wait_until(lambda: all_blocks_free(tiny_engine), 60, "every choice's blocks to be freed")
    tiny_engine.kv_cache_manager.check_integrity()
