"""engine.server.tool_calls: tool_choice rules and parsing calls out of text, whole and streamed."""

import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from engine.contract.errors import APIError
from engine.contract.tool_call_format import CALL_CLOSE, CALL_OPEN, render_call
from engine.server.tool_calls import ToolCallStream, extract_tool_calls, parse_tool_choice

TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}},
         {"type": "function", "function": {"name": "get_time"}}]
AUTO = parse_tool_choice(None, TOOLS, None)


def call(name, **args):
    return CALL_OPEN + json.dumps({"name": name, "arguments": args}) + CALL_CLOSE


def test_tool_choice_modes():
    assert AUTO.mode == "auto" and AUTO.parallel
    assert parse_tool_choice(None, None, None).mode == "none"
    assert parse_tool_choice("required", TOOLS, False).forced
    named = parse_tool_choice({"type": "function", "function": {"name": "get_time"}}, TOOLS, None)
    assert (named.mode, named.name) == ("named", "get_time")
    for bad in ("sometimes", {"type": "function", "function": {"name": "nope"}}, {"type": "x"}):
        with pytest.raises(APIError) as info:
            parse_tool_choice(bad, TOOLS, None)
        assert info.value.param == "tool_choice"


def test_calls_are_parsed_and_text_outside_them_kept():
    text = "Let me check. " + call("get_weather", city="Paris") + "\n" + call("get_time")
    content, calls = extract_tool_calls(text, AUTO, TOOLS)
    assert content == "Let me check."
    assert [c["function"]["name"] for c in calls] == ["get_weather", "get_time"]
    assert json.loads(calls[0]["function"]["arguments"]) == {"city": "Paris"}
    assert calls[0]["id"].startswith("call_") and calls[0]["id"] != calls[1]["id"]


def test_unknown_names_bad_json_and_none_mode_stay_text():
    for text in (call("rm_rf"), CALL_OPEN + "{not json" + CALL_CLOSE, "plain"):
        assert extract_tool_calls(text, AUTO, TOOLS) == (text, [])
    none = parse_tool_choice("none", TOOLS, None)
    assert extract_tool_calls(call("get_time"), none, TOOLS) == (call("get_time"), [])


def test_parallel_false_keeps_only_the_first_call():
    single = parse_tool_choice("auto", TOOLS, False)
    _, calls = extract_tool_calls(call("get_time") + call("get_weather"), single, TOOLS)
    assert [c["function"]["name"] for c in calls] == ["get_time"]


def test_render_call_round_trips_through_the_parser():
    rendered = render_call({"id": "c1", "type": "function",
                            "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}})
    _, calls = extract_tool_calls(rendered, AUTO, TOOLS)
    assert json.loads(calls[0]["function"]["arguments"]) == {"city": "Oslo"}


@given(st.lists(st.integers(1, 7), min_size=1, max_size=40))
def test_streamed_split_matches_the_whole_text_parse(cuts):
    text = "Hi <tool " + call("get_weather", city="Rome") + " and " + call("get_time") + " bye"
    stream = ToolCallStream(AUTO, TOOLS)
    content, calls, pos = "", [], 0
    for size in cuts * 20:
        if pos >= len(text):
            break
        piece, pos = text[pos:pos + size], pos + size
        out, new = stream.feed(piece)
        content, calls = content + out, calls + new
    out, new = stream.feed(text[pos:])
    rest, last = stream.finish()
    content, calls = content + out + rest, calls + new + last
    whole_content, whole_calls = extract_tool_calls(text, AUTO, TOOLS)
    assert [c["function"] for c in calls] == [c["function"] for c in whole_calls]
    assert content.replace(" ", "") == whole_content.replace(" ", "")


FULL = "Checking. " + call("get_time") + "\n" + call("get_weather", city="Rome", days=3)


def stream_split(text, truncated, size=3):
    stream = ToolCallStream(AUTO, TOOLS)
    content, calls = "", []
    for pos in range(0, len(text), size):
        out, new = stream.feed(text[pos:pos + size])
        content, calls = content + out, calls + new
    rest, last = stream.finish(truncated=truncated)
    return content + rest, calls + last


@pytest.mark.parametrize("cut", range(1, len(FULL)))
def test_a_call_cut_by_max_tokens_leaves_no_markup_whole_or_streamed(cut):
    """Any prefix of an output with calls, as max_tokens leaves it: complete calls are
    kept, the cut one is dropped, and nothing of the tags or its JSON is content."""
    text = FULL[:cut]
    whole_content, whole_calls = extract_tool_calls(text, AUTO, TOOLS, truncated=True)
    content, calls = stream_split(text, truncated=True)
    for out in (whole_content, content):
        assert "<" not in out and "{" not in out and "tool_call" not in out
        assert FULL.startswith(out.strip()) or out.strip() == ""
    complete = text.count(CALL_CLOSE)
    assert len(whole_calls) == complete and [c["function"] for c in calls] == [
        c["function"] for c in whole_calls]


def test_a_call_left_open_by_a_stop_is_still_a_call():
    text = "Sure. " + call("get_weather", city="Oslo")[: -len(CALL_CLOSE)]
    content, calls = extract_tool_calls(text, AUTO, TOOLS)
    assert content == "Sure." and json.loads(calls[0]["function"]["arguments"]) == {"city": "Oslo"}
    streamed_content, streamed_calls = stream_split(text, truncated=False)
    assert streamed_content.strip() == "Sure." and len(streamed_calls) == 1
    broken = "Sure. " + CALL_OPEN + '{"name": "get_weather", "argu'
    assert extract_tool_calls(broken, AUTO, TOOLS) == (broken, [])  # not a call: no text lost
