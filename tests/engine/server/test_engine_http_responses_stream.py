"""Streamed Responses hold the output items of the non-streamed answer, in OpenAI's event
order, for the openai SDK, the Agents SDK and LangChain; tool calls cut by max_tokens
leave no markup; top_logprobs on Responses; the schema is echoed once.

Tiny random Llama over real loopback HTTP; greedy decoding, so a streamed and a
non-streamed request produce the same tokens and their answers can be compared."""

import asyncio
import json
from typing import Literal

import openai
import pydantic
import pytest
from support.sse import sse_data
from test_engine_http_fixtures import wait_until

PROMPT = "Tell me a short story about a lighthouse keeper."
TOOL = {"type": "function", "name": "book_repair",
        "parameters": {"type": "object", "properties": {"item": {"type": "string", "maxLength": 12},
                                                        "day": {"enum": ["mon", "tue"]}},
                       "required": ["item", "day"]}}
CHAT_TOOL = {"type": "function", "function": {k: TOOL[k] for k in ("name", "parameters")}}
class Story(pydantic.BaseModel):
    title: str = pydantic.Field(min_length=4, max_length=12)
    mood: Literal["calm", "wild"]


MARKUP = ("<tool_call", "tool_call>", "<tool", "</")


def all_blocks_free(engine) -> bool:
    kv = engine.kv_cache_manager
    return kv.num_free_blocks == kv.num_blocks


def items(output) -> list[tuple]:
    """The output items without their ids: type, status, text or the call."""
    out = []
    for item in output:
        if item.type == "message":
            out.append(("message", item.status, [part.text for part in item.content]))
        else:
            out.append((item.type, item.name, json.loads(item.arguments)))
    return out


def expected_order(events) -> list[str]:
    """OpenAI's order for the items of ``response.completed``'s output."""
    order = ["response.created", "response.in_progress"]
    final = events[-1].response
    for item in final.output:
        order.append("response.output_item.added")
        if item.type == "message":
            deltas = [e for e in events if e.type == "response.output_text.delta"
                      and e.item_id == item.id]
            order += ["response.content_part.added", *["response.output_text.delta"] * len(deltas),
                      "response.output_text.done", "response.content_part.done"]
        else:
            order += ["response.function_call_arguments.delta",
                      "response.function_call_arguments.done"]
        order.append("response.output_item.done")
    return [*order, events[-1].type]


@pytest.mark.parametrize("kwargs", [
    {"max_output_tokens": 24},
    {"max_output_tokens": 40, "tools": [TOOL], "tool_choice": "required"},
    {"max_output_tokens": 40, "tools": [TOOL], "tool_choice": "required", "parallel_tool_calls": False},
], ids=["text", "tool-call", "one-call"])
def test_streamed_responses_have_the_non_streamed_items_in_openai_order(client, tiny_engine, kwargs):
    args = {"model": tiny_engine.model_id, "input": PROMPT, "temperature": 0, **kwargs}
    whole = client.responses.create(**args)
    events = list(client.responses.create(**args, stream=True))
    final = events[-1].response
    assert events[-1].type in ("response.completed", "response.incomplete")
    assert items(final.output) == items(whole.output)
    assert final.status == whole.status and final.usage.output_tokens == whole.usage.output_tokens
    if "tools" not in kwargs:
        assert [o.type for o in final.output] == ["message"]  # one item, not one per token
        deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
        assert len(deltas) > 1 and "".join(deltas) == whole.output_text
    assert [e.type for e in events] == expected_order(events)
    assert [e.sequence_number for e in events] == list(range(len(events)))
    added = [e.item.id for e in events if e.type == "response.output_item.added"]
    assert added == [o.id for o in final.output]  # the final items are the streamed ones
    wait_until(lambda: all_blocks_free(tiny_engine), 10, "all blocks free")


def test_agents_sdk_run_streamed_returns_the_whole_final_output(live, tiny_engine):
    agents = pytest.importorskip("agents")
    agents.set_tracing_disabled(True)
    model = agents.OpenAIResponsesModel(
        model=tiny_engine.model_id,
        openai_client=openai.AsyncOpenAI(base_url=live.api_url, api_key="x", max_retries=0))
    # A structured output makes the random model's answer end (status "completed"); a
    # final_output built from the last streamed item alone would not even parse.
    agent = agents.Agent(name="storyteller", instructions="Be brief.", model=model,
                         output_type=Story,
                         model_settings=agents.ModelSettings(temperature=0, max_tokens=80))

    async def both():
        whole = await agents.Runner.run(agent, PROMPT)
        streamed = agents.Runner.run_streamed(agent, PROMPT)
        kinds = [event.type async for event in streamed.stream_events()]
        return whole, streamed, kinds

    whole, streamed, kinds = asyncio.run(both())
    assert isinstance(whole.final_output, Story) and whole.final_output.title
    assert streamed.final_output == whole.final_output
    assert "raw_response_event" in kinds
    messages = [i for i in streamed.new_items if i.type == "message_output_item"]
    assert len(messages) == 1


def test_langchain_responses_streaming_yields_the_non_streamed_message(live, tiny_engine):
    langchain_openai = pytest.importorskip("langchain_openai")
    llm = langchain_openai.ChatOpenAI(model=tiny_engine.model_id, base_url=live.api_url,
                                      api_key="x", use_responses_api=True, temperature=0,
                                      max_tokens=24, max_retries=0)
    whole = llm.invoke(PROMPT)
    chunks = list(llm.stream(PROMPT))
    merged = chunks[0]
    for chunk in chunks[1:]:
        merged = merged + chunk
    assert merged.text == whole.text and len(whole.text) > 20
    text_blocks = [b for b in merged.content if isinstance(b, dict) and b.get("type") == "text"]
    assert len(text_blocks) == 1  # one block, not one per token
    ids = {b.get("id") for b in text_blocks}
    assert len(ids) == 1


def sweep_limits(client, model) -> range:
    """max_tokens from 1 to past the full length of a forced call."""
    full = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": PROMPT}], max_tokens=80, temperature=0,
        tools=[CHAT_TOOL], tool_choice="required", parallel_tool_calls=False)
    assert full.choices[0].finish_reason == "tool_calls"
    return range(1, full.usage.completion_tokens + 2)


def test_a_tool_call_cut_by_max_tokens_never_leaks_markup(client, tiny_engine):
    """Chat and Responses, streamed and not, for every max_tokens up to the call's length."""
    model = tiny_engine.model_id
    messages = [{"role": "user", "content": PROMPT}]
    forced = {"tools": [CHAT_TOOL], "tool_choice": "required", "parallel_tool_calls": False,
              "temperature": 0}
    limits = sweep_limits(client, model)
    for limit in limits:
        whole = client.chat.completions.create(model=model, messages=messages, max_tokens=limit,
                                               **forced).choices[0]
        chunks = list(client.chat.completions.create(model=model, messages=messages,
                                                     max_tokens=limit, stream=True, **forced))
        streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        streamed_calls = [t for c in chunks if c.choices for t in c.choices[0].delta.tool_calls or []]
        reasons = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
        for content in (whole.message.content or "", streamed):
            assert not any(tag in content for tag in MARKUP), (limit, content)
        calls = whole.message.tool_calls or []
        assert [(c.function.name, c.function.arguments) for c in calls] == [
            (c.function.name, c.function.arguments) for c in streamed_calls]
        assert reasons == [whole.finish_reason] and not whole.message.content
        if whole.finish_reason == "length":  # a call cut short is dropped, a whole one kept
            assert not calls or limit == limits[-1] - 2  # the call's tokens, without the EOS
        else:
            assert whole.finish_reason == "tool_calls" and len(calls) == 1
        args = {"model": model, "input": PROMPT, "max_output_tokens": limit, "temperature": 0,
                "tools": [TOOL], "tool_choice": "required", "parallel_tool_calls": False}
        response = client.responses.create(**args)
        final = list(client.responses.create(**args, stream=True))[-1].response
        for out in (response, final):
            texts = [p.text for o in out.output if o.type == "message" for p in o.content]
            assert not any(tag in t for t in texts for tag in MARKUP), (limit, texts)
            calls = [o for o in out.output if o.type == "function_call"]
            assert (out.status == "incomplete") == (whole.finish_reason == "length")
            assert [(c.name, c.arguments) for c in calls] == [
                (c.function.name, c.function.arguments) for c in whole.message.tool_calls or []]
    wait_until(lambda: all_blocks_free(tiny_engine), 10, "all blocks free")


@pytest.mark.parametrize("stream", [False, True])
def test_top_logprobs_on_responses(client, tiny_engine, stream):
    args = {"model": tiny_engine.model_id, "input": PROMPT, "max_output_tokens": 5,
            "temperature": 0, "top_logprobs": 3}
    if stream:
        events = list(client.responses.create(**args, stream=True))
        deltas = [e for e in events if e.type == "response.output_text.delta"]
        assert sum(len(e.logprobs) for e in deltas) == 5
        assert all(len(lp.top_logprobs) == 3 for e in deltas for lp in e.logprobs)
        final = events[-1].response
    else:
        final = client.responses.create(**args)
    part = final.output[0].content[0]
    assert len(part.logprobs) == 5 and "".join(lp.token for lp in part.logprobs) == part.text
    for lp in part.logprobs:
        assert len(lp.top_logprobs) == 3 and lp.logprob <= 0
        assert lp.logprob == max(t.logprob for t in lp.top_logprobs)  # greedy: the best token
    plain = client.responses.create(**{k: v for k, v in args.items() if k != "top_logprobs"})
    assert plain.output[0].content[0].logprobs == []


def test_the_format_schema_travels_once_in_a_stream(live, tiny_engine):
    import httpx

    schema = {"type": "object", "properties": {f"field_{i}": {"type": "string", "maxLength": 3}
                                               for i in range(200)}}
    body = {"model": tiny_engine.model_id, "input": PROMPT, "max_output_tokens": 4, "stream": True,
            "text": {"format": {"type": "json_schema", "name": "big", "schema": schema}}}
    with httpx.stream("POST", live.api_url + "/responses", json=body, timeout=60) as resp:
        raw = resp.read().decode()
    assert raw.count('"field_199"') == 1
    events = sse_data(raw)
    assert events[0]["type"] == "response.created"
    assert events[0]["response"]["text"]["format"] == {"type": "json_schema", "name": "big"}
    assert events[-1]["response"]["text"]["format"]["schema"] == schema
