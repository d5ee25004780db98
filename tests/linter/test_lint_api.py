"""The Python API the gateway uses (linter/api.py): contract shape and robustness on odd input."""

import json

from hypothesis import given, settings
from hypothesis import strategies as st

from linter.api import check_request, compare_requests, conversation_keys, explain, rule_codes
from linter.finding import Finding
from linter.registry import all_rules

BODY = {
    "model": "m",
    "messages": [{"role": "system", "content": "Now 2026-11-21T10:00:00Z."}, {"role": "user", "content": "hi"}],
}


def test_check_request_returns_findings_with_the_contract_fields():
    (finding,) = check_request(BODY)
    assert isinstance(finding, Finding)
    assert finding.to_dict() == {
        "code": "PS101",
        "severity": "error",
        "message": finding.message,
        "path": "<request>",
        "line": None,
        "column": None,
        "location": "messages[0].content[4:24]",
        "tokens_lost": None,
    }
    json.dumps(finding.to_dict())


def test_select_ignore_and_allowlist():
    assert check_request(BODY, select=["PS103"]) == []
    assert check_request(BODY, ignore=["PS101"]) == []
    assert check_request(BODY, allowlist=[r"^2026-11-21T"]) == []
    assert [f.code for f in check_request(BODY, select=["ps101"])] == ["PS101"]


def test_compare_requests_reports_the_cause_and_tokens_lost():
    later = {
        "model": "m",
        "messages": [{"role": "system", "content": "Now 2026-11-21T10:05:00Z."}, {"role": "user", "content": "hi"},
                     {"role": "assistant", "content": "hello"}, {"role": "user", "content": "more"}],
    }
    (finding,) = compare_requests(BODY, later, same_conversation=True)
    assert finding.code == "PS201" and finding.tokens_lost > 0
    assert compare_requests(BODY, {**later, "messages": [*BODY["messages"], *later["messages"][2:]]}) == []


def test_rule_codes_and_explain():
    codes = rule_codes()
    assert codes == sorted(all_rules()) and len(codes) == 18
    for code in codes:
        doc = explain(code)
        assert doc.startswith(code) and "Why it matters" in doc and "Anti-pattern" in doc and "Better" in doc


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=30),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.sampled_from(["role", "content", "tool_calls", "function", "arguments", "id", "tool_call_id", "name", "type", "text", "parameters"]) | st.text(max_size=5), children, max_size=4),
    max_leaves=20,
)
bodies = st.fixed_dictionaries(
    {},
    optional={
        "model": json_values,
        "messages": st.lists(json_values, max_size=5),
        "tools": json_values,
        "tool_choice": json_values,
        "response_format": json_values,
        "user": json_values,
        "metadata": json_values,
    },
)


@settings(max_examples=150, deadline=None)
@given(bodies, bodies)
def test_odd_input_never_raises(a, b):
    for finding in check_request(a):
        assert finding.code in all_rules()
    compare_requests(a, b)
    for header in (None, "thread-1"):
        keys = conversation_keys(a, header)
        assert keys is None or keys.remember in keys.lookup


def test_non_mapping_input_yields_nothing():
    assert check_request([1, 2]) == []
    assert compare_requests("x", BODY) == []


scalars = st.none() | st.booleans() | st.integers() | st.text(max_size=20) | st.lists(st.integers(), max_size=2)
calls = st.lists(
    st.fixed_dictionaries({}, optional={"id": scalars, "type": scalars, "function": st.fixed_dictionaries({}, optional={"name": scalars, "arguments": scalars | st.just('{"b":1,"a":2}')}) | scalars}) | scalars,
    max_size=3,
)
messages = st.fixed_dictionaries(
    {},
    optional={
        "role": st.sampled_from(["system", "developer", "user", "assistant", "tool"]) | scalars,
        "content": scalars | st.lists(st.fixed_dictionaries({}, optional={"type": scalars, "text": scalars}) | scalars, max_size=3),
        "tool_calls": calls | scalars,
        "tool_call_id": scalars,
    },
)
tools = st.lists(
    st.fixed_dictionaries({}, optional={"type": scalars, "function": st.fixed_dictionaries({}, optional={"name": scalars, "description": scalars, "parameters": json_values}) | scalars}) | scalars,
    max_size=3,
)
chat_bodies = st.fixed_dictionaries(
    {"messages": st.lists(messages | scalars, max_size=6)},
    optional={"tools": tools | scalars, "tool_choice": json_values, "response_format": json_values, "user": scalars, "metadata": json_values},
)


@settings(max_examples=300, deadline=None)
@given(chat_bodies, chat_bodies)
def test_structured_odd_input_never_raises_in_rules_fixes_or_comparisons(a, b):
    from linter.render import render

    check_request(a)
    compare_requests(a, b)
    compare_requests(a, {**a, "messages": [*a["messages"], *b["messages"]]})
    extended = conversation_keys({**a, "messages": [*a["messages"], *b["messages"]]})
    if conversation_keys(a) is not None and extended is not None:
        assert conversation_keys(a).remember in extended.lookup  # a longer list always extends its prefix
    for rule in all_rules().values():
        if rule.fix is not None:
            render(rule.fix(a))


def test_caller_can_assert_the_same_conversation():
    sys_msg = {"role": "system", "content": "Be brief."}
    turns = [{"role": "user", "content": f"q{i}"} if i % 2 == 0 else {"role": "assistant", "content": f"a{i}"} for i in range(6)]
    previous = {"model": "m", "messages": [sys_msg, *turns]}
    window = {"model": "m", "messages": [sys_msg, *turns[2:], {"role": "assistant", "content": "a6"}, {"role": "user", "content": "q7"}]}
    (inferred,) = compare_requests(previous, window)  # it repeats the model's latest output a5 (and all after it)
    assert inferred.code == "PS204" and "truncated" in inferred.message
    rewritten = {**window, "messages": [m if m.get("content") != "a5" else {**m, "content": "a5, reworded"}
                                        for m in window["messages"]]}
    assert compare_requests(previous, rewritten) == []  # no output repeated: compared as a family only
    (finding,) = compare_requests(previous, rewritten, same_conversation=True)
    assert finding.code == "PS204" and "truncated" in finding.message
