"""The gateway's Responses support on its own: canonicalization, chat view, the SSE end, usage names."""

from __future__ import annotations

import orjson

from gateway.config.config_file import CanonicalizeSwitches
from gateway.policy.canonicalizer import canonicalize
from gateway.proxy.sse_relay import SseRelay
from gateway.request_record import RequestRecord
from gateway.responses.body import canonical_chat_view, canonicalize_responses, chat_view
from linter.api import compare_requests

TOOLS = [{"type": "function", "name": "zeta", "parameters": {"type": "object", "properties": {}}},
         {"parameters": {"type": "object"}, "name": "alpha", "type": "function"}]
BODY = {"model": "m", "instructions": "Be brief.", "tools": TOOLS,
        "text": {"format": {"type": "json_schema", "schema": {"type": "object"}, "name": "x"}},
        "input": [{"role": "user", "content": "hi"},
                  {"type": "function_call", "call_id": "c", "name": "zeta", "arguments": '{"b": 1,  "a": 2}'}]}


def test_canonical_tools_format_and_arguments_without_touching_the_input_body():
    before = orjson.dumps(BODY)
    body, applied = canonicalize_responses(BODY, CanonicalizeSwitches(tool_order=True))
    assert orjson.dumps(BODY) == before
    assert applied == ["tools.keys_sorted", "tools.ordered_by_name", "response_format.keys_sorted",
                       "tool_calls.arguments_canonical"]
    assert [t["name"] for t in body["tools"]] == ["alpha", "zeta"]
    assert list(body["text"]["format"]) == ["name", "schema", "type"]
    assert body["input"][1]["arguments"] == '{"b":1,"a":2}'  # compact, member order kept
    assert canonicalize_responses(body, CanonicalizeSwitches()) == (body, [])  # idempotent
    assert canonicalize_responses(BODY, CanonicalizeSwitches(*(False,) * 5)) == (BODY, [])


def test_chat_view_puts_instructions_first_and_refuses_nothing_loudly():
    view = chat_view(BODY)
    assert view is not None
    assert view["messages"][0] == {"role": "system", "content": "Be brief."}
    assert view["messages"][2]["tool_calls"][0]["function"]["name"] == "zeta"
    assert chat_view({"model": "m", "input": "x", "store": True}) is None


def test_a_responses_stream_ends_at_response_completed_and_its_usage_is_recorded():
    record = RequestRecord("responses", "u")
    relay = SseRelay(record, strip_usage=False, warnings=None)
    usage = {"input_tokens": 40, "input_tokens_details": {"cached_tokens": 32}, "output_tokens": 3}
    events = [b'event: response.output_text.delta\ndata: {"type":"response.output_text.delta","delta":"a"}\n\n',
              b"event: response.completed\ndata: " + orjson.dumps(
                  {"type": "response.completed", "response": {"usage": usage}}) + b"\n\n"]
    out = [e for piece in events for e in relay.feed(piece)]
    assert out == events  # relayed byte for byte, event lines included
    assert relay.saw_done
    assert (record.prompt_tokens, record.cached_tokens, record.completion_tokens) == (40, 32, 3)


def test_one_tool_has_one_canonical_form_whichever_endpoint_carried_it():
    """A tool sent through /v1/responses, then through chat: the Responses turn's chat view in
    the chat canonical form equals the chat turn's tools, so no false PS203 (the raw chat view
    nests the flat tool in the engine's translation order and is reported)."""
    switches = CanonicalizeSwitches()
    params = {"type": "object", "required": ["city", "nights"],
              "properties": {"city": {"type": "string"}, "nights": {"type": "integer"}}}
    description = "Book a hotel room. " * 20
    responses = {"model": "m", "instructions": "You book hotels.", "input": "Book two nights in Paris.",
                 "tools": [{"type": "function", "name": "book", "description": description, "parameters": params}]}
    chat = {"model": "m", "messages": [{"role": "system", "content": "You book hotels."},
                                       {"role": "user", "content": "Book two nights in Paris."}],
            "tools": [{"type": "function", "function": {"name": "book", "description": description, "parameters": params}}]}
    canonical_responses, _ = canonicalize_responses(responses, switches)
    canonical, _ = canonicalize(chat, switches)
    view = canonical_chat_view(canonical_responses, switches)
    assert view is not None and view["tools"] == canonical["tools"]
    assert orjson.dumps(view["tools"]) == orjson.dumps(canonical["tools"])  # key order included
    assert compare_requests(view, canonical, same_conversation=True) == []
    raw_view = chat_view(canonical_responses)
    assert [f.code for f in compare_requests(raw_view, canonical, same_conversation=True)] == ["PS203"]
