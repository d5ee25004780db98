"""The PS202/PS203 estimate fixes (linter/first_seen.py): only deviating requests change."""

from linter.first_seen import FirstJsonSpelling, FirstToolOrder


def tool(name, **parameters):
    return {"type": "function", "function": {"name": name, "parameters": {"type": "object", **parameters}}}


def test_tool_order_follows_the_first_request_with_that_set():
    fix = FirstToolOrder()
    first = {"tools": [tool("b"), tool("a")]}
    assert fix(first) is first  # unsorted but first: left alone
    again = {"tools": [tool("b"), tool("a")]}
    assert fix(again) is again
    shuffled = {"tools": [tool("a"), tool("b")]}
    assert [t["function"]["name"] for t in fix(shuffled)["tools"]] == ["b", "a"]
    other_set = {"tools": [tool("c"), tool("a")]}
    assert fix(other_set) is other_set
    assert fix.fresh()(shuffled) is shuffled  # a fresh fixer has seen nothing


def test_json_spelling_follows_the_first_spelling_of_equal_data():
    fix = FirstJsonSpelling()
    unsorted = tool("f", properties={"q": {"type": "string"}}, required=["q"])
    first = {"tools": [unsorted], "messages": [{"role": "assistant", "tool_calls": [{"id": "1", "function": {"name": "f", "arguments": '{"b": 1, "a": 2}'}}]}]}
    assert fix(first) is first
    reordered = {"type": "function", "function": {"parameters": {"required": ["q"], "properties": {"q": {"type": "string"}}, "type": "object"}, "name": "f"}}
    respelled = {"tools": [reordered], "messages": [{"role": "assistant", "tool_calls": [{"id": "1", "function": {"name": "f", "arguments": '{"a":2,"b":1}'}}]}]}
    fixed = fix(respelled)
    assert fixed["tools"][0] is unsorted
    assert fixed["messages"][0]["tool_calls"][0]["function"]["arguments"] == '{"b": 1, "a": 2}'
