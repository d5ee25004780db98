"""engine.server.response_builder: OpenAI body and chunk shapes; cached_tokens always present."""

import orjson

from engine.server.response_builder import SSE_DONE, ResponseBuilder, Usage, sse_event


def test_chat_body_has_usage_with_cached_tokens_even_when_zero():
    body = ResponseBuilder("chat", "m").full("hi", "stop", Usage(10, 2, 0))
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
    body = builder.full("abc", "length", Usage(3, 4, 0))
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
