"""engine.server.responses: Responses requests become chat requests; stateful features are 400."""

import orjson
import pytest

from engine.contract.errors import APIError
from engine.contract.responses_request import responses_param, to_chat_body, translate
from engine.server.response_builder import Usage
from engine.server.responses import ResponsesBuilder


def test_items_become_messages_tools_and_formats():
    chat = to_chat_body({
        "model": "m", "instructions": "Be brief.", "max_output_tokens": 9, "stream": True,
        "input": [
            {"role": "user", "content": [{"type": "input_text", "text": "weather?"}]},
            {"type": "function_call", "call_id": "c1", "name": "w", "arguments": '{"c": "X"}'},
            {"type": "function_call", "call_id": "c2", "name": "w", "arguments": "{}"},
            {"type": "function_call_output", "call_id": "c1", "output": "sunny"},
        ],
        "tools": [{"type": "function", "name": "w", "parameters": {"type": "object"}}],
        "tool_choice": {"type": "function", "name": "w"},
        "text": {"format": {"type": "json_schema", "name": "o", "schema": {"type": "object"}}},
    })
    roles = [m["role"] for m in chat["messages"]]
    assert roles == ["system", "user", "assistant", "tool"]
    assert [c["id"] for c in chat["messages"][2]["tool_calls"]] == ["c1", "c2"]
    assert chat["messages"][3] == {"role": "tool", "tool_call_id": "c1", "content": "sunny"}
    assert chat["tools"][0]["function"]["name"] == "w"
    assert chat["tool_choice"] == {"type": "function", "function": {"name": "w"}}
    assert chat["response_format"]["json_schema"]["schema"] == {"type": "object"}
    assert chat["max_completion_tokens"] == 9 and chat["stream_options"] == {"include_usage": True}


@pytest.mark.parametrize(("body", "param"), [
    ({"input": "x", "store": True}, "store"),
    ({"input": "x", "previous_response_id": "resp_1"}, "previous_response_id"),
    ({"input": []}, "input"),
    ({"input": [{"type": "reasoning"}]}, "input[0].type"),
    ({"input": "x", "tools": [{"type": "web_search"}]}, "tools[0].type"),
    ({"input": [{"role": "user", "content": [{"type": "input_image"}]}]}, "input[0].content[0].image_url"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "file_id": "f"}]}]},
     "input[0].content[0].file_id"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "data:,", "detail": "x"}]}]},
     "input[0].content[0].detail"),
    ({"input": [{"role": "user", "content": [{"type": "input_file"}]}]}, "input[0].content[0]"),
    ({"input": [{"role": "user", "content": [{"type": "input_text", "text": 7}]}]}, "input[0].content[0].text"),
])
def test_refusals_name_the_param(body, param):
    with pytest.raises(APIError) as info:
        to_chat_body(body)
    assert info.value.status_code == 400 and info.value.param == param


def events(raw):
    return [orjson.loads(e.split(b"data: ", 1)[1]) for e in raw]


def test_stream_event_sequence_and_usage():
    builder = ResponsesBuilder("m", {"input": "x"})
    call = {"id": "call_1", "type": "function", "function": {"name": "w", "arguments": "{}"}}
    seq = events(builder.start() + builder.text("Hel") + builder.text("lo") + builder.calls([call])
                 + builder.finish("stop", Usage(10, 3, 8)))
    assert [e["type"] for e in seq] == [
        "response.created", "response.in_progress", "response.output_item.added",
        "response.content_part.added", "response.output_text.delta", "response.output_text.delta",
        "response.output_text.done", "response.content_part.done", "response.output_item.done",
        "response.output_item.added", "response.function_call_arguments.delta",
        "response.function_call_arguments.done", "response.output_item.done", "response.completed"]
    assert [e["sequence_number"] for e in seq] == list(range(len(seq)))
    final = seq[-1]["response"]
    assert [o["type"] for o in final["output"]] == ["message", "function_call"]
    assert final["output"][0]["content"][0]["text"] == "Hello"
    assert final["usage"]["input_tokens_details"] == {"cached_tokens": 8}
    assert final["usage"]["total_tokens"] == 13


def test_length_is_incomplete():
    body = ResponsesBuilder("m", {"input": "x"}).full("abc", [], "length", Usage(1, 3, 0))
    assert body["status"] == "incomplete"
    assert body["incomplete_details"] == {"reason": "max_output_tokens"}


def test_chat_params_in_errors_get_their_responses_names():
    assert responses_param("messages[2].role") == "input"
    assert responses_param("max_completion_tokens") == "max_output_tokens"
    assert responses_param("response_format.json_schema.schema") == "text.format.schema"
    assert responses_param("temperature") == "temperature" and responses_param(None) is None


def test_input_image_parts_become_chat_image_url_parts_in_place():
    url = "data:image/png;base64,AAAA"
    chat = to_chat_body({"input": [{"role": "user", "content": [
        {"type": "input_text", "text": "what is it?"},
        {"type": "input_image", "image_url": url, "detail": "low"},
        {"type": "input_image", "image_url": "https://img.example/a.png"},
    ]}]})
    assert chat["messages"][0]["content"] == [
        {"type": "text", "text": "what is it?"},
        {"type": "image_url", "image_url": {"url": url, "detail": "low"}},
        {"type": "image_url", "image_url": {"url": "https://img.example/a.png"}},
    ]


def test_each_chat_message_knows_the_input_item_it_came_from():
    _, origins = translate({"instructions": "x", "input": [
        {"role": "user", "content": "a"},
        {"type": "function_call", "call_id": "c1", "name": "w", "arguments": "{}"},
        {"type": "function_call", "call_id": "c2", "name": "w", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1", "output": "ok"},
        {"role": "user", "content": [{"type": "input_image", "image_url": "data:,"}]},
    ]})
    assert origins == ["instructions", "input[0]", "input[1]", "input[3]", "input[4]"]
    assert responses_param("messages[4].content[0].image_url", origins) == "input[4].content[0].image_url"
    assert responses_param("messages[0].content", origins) == "instructions"
    assert responses_param("messages[9].role", origins) == "input"
    _, origins = translate({"input": "just text"})
    assert responses_param("messages[0].content", origins) == "input"


def test_text_deltas_stay_in_one_message_item_between_empty_call_batches():
    builder = ResponsesBuilder("m", {"input": "x", "text": {"format": {
        "type": "json_schema", "name": "s", "schema": {"type": "object"}}}})
    seq = events(builder.start() + builder.text("Hel") + builder.calls([]) + builder.text("lo")
                 + builder.calls([]) + builder.finish("stop", Usage(1, 2, 0)))
    final = seq[-1]["response"]
    assert [o["type"] for o in final["output"]] == ["message"]
    assert final["output"][0]["content"][0]["text"] == "Hello"
    assert [e["type"] for e in seq].count("response.output_item.added") == 1
    assert seq[0]["response"]["text"]["format"] == {"type": "json_schema", "name": "s"}
    assert final["text"]["format"]["schema"] == {"type": "object"}


def test_top_logprobs_turns_logprobs_on():
    assert to_chat_body({"input": "x", "top_logprobs": 2})["logprobs"] is True
    assert to_chat_body({"input": "x", "include": ["message.output_text.logprobs"]})["logprobs"] is True
    assert "logprobs" not in to_chat_body({"input": "x"})
    assert responses_param("tools[3].function.parameters") == "tools[3].parameters"
