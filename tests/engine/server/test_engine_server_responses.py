"""engine.server.response_builder: OpenAI body and chunk shapes; cached_tokens always present."""

import orjson

from engine.contract.sse import SSE_DONE, sse_event
from engine.core.output_stream import TokenLogprobs
from engine.server.response_builder import Choice, ResponseBuilder, Usage


def test_chat_body_has_usage_with_cached_tokens_even_when_zero():
    body = ResponseBuilder("chat", "m").full([Choice(0, "hi", "stop")], Usage(10, 2, 0))
    assert body["object"] == "chat.completion" and body["model"] == "m"
    assert body["id"].startswith("chatcmpl-")
    assert body["choices"][0]["message"] == {"role": "assistant", "content": "hi", "tool_calls": []}
    assert body["choices"][0]["finish_reason"] == "stop"
    assert body["usage"] == {
        "prompt_tokens": 10, "completion_tokens": 2, "total_tokens": 12,
        "prompt_tokens_details": {"cached_tokens": 0},
    }


def test_completion_body_and_chunks():
    builder = ResponseBuilder("completion", "m")
    body = builder.full([Choice(0, "abc", "length")], Usage(3, 4, 0))
    assert body["object"] == "text_completion" and body["choices"][0]["text"] == "abc"
    chunk = builder.delta("x")
    assert chunk["choices"][0]["text"] == "x" and chunk["id"] == body["id"]
    assert "usage" not in chunk


def test_chat_stream_role_first_then_content_then_finish_then_usage():
    builder = ResponseBuilder("chat", "m", include_usage=True)
    first, second = builder.delta("a"), builder.delta("b")
    final = builder.finish("stop")
    usage = builder.usage_chunk(Usage(5, 2, 4))
    assert first["choices"][0]["delta"] == {"role": "assistant", "content": "a"}
    assert second["choices"][0]["delta"] == {"content": "b"}
    assert final["choices"][0]["finish_reason"] == "stop"
    assert first["usage"] is None and final["usage"] is None
    assert usage["choices"] == [] and usage["usage"]["prompt_tokens_details"] == {"cached_tokens": 4}
    assert {c["id"] for c in (first, second, final, usage)} == {builder.id}
    assert {c["object"] for c in (first, final, usage)} == {"chat.completion.chunk"}


def test_finish_without_any_text_still_carries_the_role():
    final = ResponseBuilder("chat", "m").finish("length")
    assert final["choices"][0]["delta"]["role"] == "assistant"


def test_sse_framing():
    event = sse_event({"a": 1})
    assert event == b'data: {"a":1}\n\n'
    assert orjson.loads(event[len(b"data: "):]) == {"a": 1}
    assert SSE_DONE == b"data: [DONE]\n\n"


CALL = {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
LP = [TokenLogprobs(7, -0.5, [(7, -0.5), (8, -1.5)])]


def test_chat_tool_calls_null_content_and_tool_calls_reason():
    body = ResponseBuilder("chat", "m").full([Choice(0, "", "stop", [CALL])], Usage(1, 1, 0))
    choice = body["choices"][0]
    assert choice["message"]["content"] is None and choice["message"]["tool_calls"] == [CALL]
    assert choice["finish_reason"] == "tool_calls"
    cut = ResponseBuilder("chat", "m").full([Choice(0, "x", "length", [CALL])], Usage(1, 1, 0))
    assert cut["choices"][0]["finish_reason"] == "length"


def test_streamed_tool_calls_are_numbered_per_choice_and_finish_as_tool_calls():
    builder = ResponseBuilder("chat", "m")
    first = builder.tool_calls([CALL], index=1)
    second = builder.tool_calls([CALL, CALL], index=1)
    assert first["choices"][0]["index"] == 1
    assert [c["index"] for c in second["choices"][0]["delta"]["tool_calls"]] == [1, 2]
    assert builder.finish("stop", index=1)["choices"][0]["finish_reason"] == "tool_calls"
    assert builder.finish("stop", index=0)["choices"][0]["finish_reason"] == "stop"


def test_logprob_shapes_for_chat_and_completions():
    text = {7: "a", 8: "é"}.__getitem__
    chat = ResponseBuilder("chat", "m", token_text=text).delta("a", 0, LP)["choices"][0]["logprobs"]
    entry = chat["content"][0]
    assert entry == {"token": "a", "logprob": -0.5, "bytes": [97],
                     "top_logprobs": [{"token": "a", "logprob": -0.5, "bytes": [97]},
                                      {"token": "é", "logprob": -1.5, "bytes": [195, 169]}]}
    builder = ResponseBuilder("completion", "m", token_text=text)
    one = builder.delta("a", 0, LP)["choices"][0]["logprobs"]
    two = builder.delta("a", 0, LP)["choices"][0]["logprobs"]
    assert one == {"tokens": ["a"], "token_logprobs": [-0.5], "top_logprobs": [{"a": -0.5, "é": -1.5}],
                   "text_offset": [0]}
    assert two["text_offset"] == [1]


def test_n_choices_each_get_their_role_once():
    builder = ResponseBuilder("chat", "m")
    a, b, a2 = builder.delta("x", 0), builder.delta("y", 1), builder.delta("z", 0)
    assert "role" in a["choices"][0]["delta"] and "role" in b["choices"][0]["delta"]
    assert "role" not in a2["choices"][0]["delta"] and b["choices"][0]["index"] == 1
