"""The SSE relay on its own: split events, strip injected usage, attach warnings."""

from __future__ import annotations

import orjson
import pytest

from gateway.errors import GatewayError, UpstreamError
from gateway.proxy.sse_relay import SseRelay
from gateway.request_record import RequestRecord

WARNINGS = [{"code": "PS101", "message": "m", "location": "messages[0]"}]


def event(obj) -> bytes:
    return b"data: " + orjson.dumps(obj) + b"\n\n"


def chunk(content=None, finish=None, usage="absent"):
    c = {"object": "chat.completion.chunk", "choices": [{"index": 0, "delta": {"content": content} if content else {},
                                                         "finish_reason": finish}]}
    if usage != "absent":
        c["usage"] = usage
    return c


USAGE = {"prompt_tokens": 40, "completion_tokens": 2, "prompt_tokens_details": {"cached_tokens": 32}}


def relay_all(relay, pieces):
    out = []
    for piece in pieces:
        out.extend(relay.feed(piece))
    out.extend(relay.finish())
    return [orjson.loads(e[6:]) if b"[DONE]" not in e else "DONE" for e in out]


def test_events_split_across_arbitrary_byte_boundaries():
    stream = event(chunk("a")) + event(chunk("b", "stop")) + b"data: [DONE]\n\n"
    for size in (1, 3, 7, len(stream)):
        record = RequestRecord("chat.completions", "u")
        relay = SseRelay(record, strip_usage=False, warnings=None)
        pieces = [stream[i:i + size] for i in range(0, len(stream), size)]
        out = []
        for piece in pieces:
            out.extend(relay.feed(piece))
        assert b"".join(out) == stream  # forwarded byte for byte
        assert relay.saw_done and record.ttft_ms is not None


def test_injected_usage_is_stripped_and_recorded_and_warnings_go_on_the_finish_chunk():
    record = RequestRecord("chat.completions", "u")
    relay = SseRelay(record, strip_usage=True, warnings=WARNINGS)
    stream = [event(chunk("a", usage=None)), event(chunk(None, "stop", usage=None)),
              event({"object": "chat.completion.chunk", "choices": [], "usage": USAGE}), b"data: [DONE]\n\n"]
    out = relay_all(relay, stream)
    assert out[-1] == "DONE" and len(out) == 3
    assert all("usage" not in c for c in out[:-1])
    assert out[1]["prefix_warnings"] == WARNINGS and "prefix_warnings" not in out[0]
    assert (record.prompt_tokens, record.cached_tokens, record.completion_tokens) == (40, 32, 2)


def test_client_asked_usage_gets_it_with_warnings_on_it():
    record = RequestRecord("chat.completions", "u")
    relay = SseRelay(record, strip_usage=False, warnings=WARNINGS)
    out = relay_all(relay, [event(chunk("a", "stop", usage=None)),
                            event({"choices": [], "usage": USAGE}), b"data: [DONE]\n\n"])
    assert out[0]["usage"] is None and "prefix_warnings" not in out[0]
    assert out[1]["usage"] == USAGE and out[1]["prefix_warnings"] == WARNINGS


def test_warnings_without_a_final_chunk_get_their_own_before_done():
    relay = SseRelay(RequestRecord("completions", "u"), strip_usage=True, warnings=WARNINGS)
    out = relay_all(relay, [event({"choices": [{"text": "x", "finish_reason": None}]}), b"data: [DONE]\n\n"])
    assert out[1] == {"object": "chat.completion.chunk", "choices": [], "prefix_warnings": WARNINGS}
    assert out[2] == "DONE"


def test_missing_cached_tokens_stays_unknown_and_crlf_is_handled():
    record = RequestRecord("chat.completions", "u")
    relay = SseRelay(record, strip_usage=False, warnings=None)
    raw = b"data: " + orjson.dumps({"choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 1}}) + b"\r\n\r\n"
    out = relay.feed(raw) + relay.feed(b": keep-alive\r\n\r\ndata: [DONE]\r\n\r\n") + relay.finish()
    assert out[1:] == [b": keep-alive\n\n", b"data: [DONE]\n\n"]  # comments pass through
    assert record.prompt_tokens == 5 and record.cached_tokens is None and relay.saw_done


def test_spaced_json_from_other_upstreams_is_understood():
    relay = SseRelay(RequestRecord("chat.completions", "u"), strip_usage=True, warnings=WARNINGS)
    content = b'data: {"choices": [{"index": 0, "delta": {"content": "a"}, "finish_reason": null}]}\n\n'
    final = b'data: {"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]}\n\n'
    assert relay.feed(content) == [content]  # untouched, not even parsed
    (out,) = relay.feed(final)
    assert orjson.loads(out[6:])["prefix_warnings"] == WARNINGS


def test_a_malformed_event_stops_the_relay_after_the_events_before_it():
    relay = SseRelay(RequestRecord("chat.completions", "u"), strip_usage=False, warnings=None)
    good = event(chunk("a"))
    assert relay.feed(good + b"data: {oops\n\n" + good) == [good]
    assert relay.feed(good) == [] and relay.finish() == []
    with pytest.raises(UpstreamError, match="not JSON"):
        relay.raise_failure()


def test_comments_and_events_without_data_are_forwarded():
    relay = SseRelay(RequestRecord("chat.completions", "u"), strip_usage=False, warnings=None)
    stream = b": ping\n\nevent: keepalive\n\n" + event(chunk("a")) + b"data: [DONE]\n\n"
    assert b"".join(relay.feed(stream)) == stream
    relay.raise_failure()


def responses_event(kind, seq, **fields) -> bytes:
    return b"event: " + kind.encode() + b"\ndata: " + orjson.dumps({"type": kind, "sequence_number": seq,
                                                                    **fields}) + b"\n\n"


@pytest.mark.parametrize(("code", "status"), [("invalid_schema", 400), ("engine_error", 502)])
def test_a_responses_error_event_ends_the_stream_as_sent(code, status):
    relay = SseRelay(RequestRecord("responses", "u"), strip_usage=False, warnings=None)
    created = responses_event("response.created", 0, response={"id": "r"})
    error = responses_event("error", 1, code=code, message="grammar failed", param="text.format.schema")
    late = responses_event("response.output_text.delta", 2, delta="x")
    assert relay.feed(created + error + late) == [created, error]  # relayed byte for byte, then nothing
    assert relay.finish() == []
    relay.raise_failure()  # not a failure of the relay: nothing gets appended
    assert relay.saw_done and relay.ended_by is not None and relay.ended_by.status == status


def test_failure_events_take_the_streams_shape():
    chat = SseRelay(RequestRecord("chat.completions", "u"), strip_usage=False, warnings=None)
    first, done = chat.error_events(UpstreamError("boom"))
    assert orjson.loads(first[6:])["error"]["code"] == "upstream_error" and done == b"data: [DONE]\n\n"
    responses = SseRelay(RequestRecord("responses", "u"), strip_usage=False, warnings=None)
    responses.feed(responses_event("response.created", 0) + responses_event("response.in_progress", 1))
    (only,) = responses.error_events(UpstreamError("boom"))
    name, data = only.split(b"\n", 1)
    assert name == b"event: error" and b"[DONE]" not in only
    payload = orjson.loads(data[6:])
    assert payload["type"] == "error" and payload["sequence_number"] == 2
    assert payload["code"] == "upstream_error" and "boom" in payload["message"]


def test_an_upstream_client_error_mid_stream_stays_a_client_error():
    relay = SseRelay(RequestRecord("chat.completions", "u"), strip_usage=False, warnings=None)
    error = {"message": "bad schema", "type": "invalid_request_error", "param": "response_format", "code": "x"}
    assert relay.feed(event(chunk("a")) + event({"error": error}) + b"data: [DONE]\n\n") == [event(chunk("a"))]
    with pytest.raises(GatewayError) as info:
        relay.raise_failure()
    assert info.value.status == 400 and info.value.to_dict()["error"] == error
