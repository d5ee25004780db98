"""Canonicalization: deterministic, idempotent and semantics-preserving (property tests),
plus the exact behaviour of each step."""

from __future__ import annotations

import copy

import orjson
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.config.config_file import CanonicalizeSwitches
from gateway.policy.canonicalizer import STEP_NAMES, canonicalize

ALL = CanonicalizeSwitches(tool_order=True, tool_result_order=True)  # every step (both order steps are opt-in)
NONE = CanonicalizeSwitches(*(False,) * len(CanonicalizeSwitches.__dataclass_fields__))

keys = st.text(alphabet="abcxyz_", min_size=1, max_size=4)
scalars = st.none() | st.booleans() | st.integers(-1000, 1000) | st.text(max_size=5)
json_values = st.recursive(
    scalars,
    lambda children: st.lists(children, max_size=3) | st.dictionaries(keys, children, max_size=4),
    max_leaves=12,
)
tools = st.lists(
    st.builds(
        lambda name, params, swap: (
            {"function": {"parameters": params, "name": name}, "type": "function"}
            if swap else {"type": "function", "function": {"name": name, "parameters": params}}
        ),
        keys, st.dictionaries(keys | st.sampled_from(["properties", "enum", "const"]), json_values, max_size=3),
        st.booleans(),
    ),
    max_size=4,
)
arguments = json_values.map(lambda v: orjson.dumps(v).decode()) | st.text(max_size=8)
image_urls = st.sampled_from(["data:image/png;base64,iVBORw0KGgo=", "https://img.example/a.png"])
image_parts = (
    st.builds(lambda u: {"type": "image_url", "image_url": u}, image_urls)
    | st.builds(lambda u, d: {"type": "image_url", "image_url": {"url": u} if d is None else {"detail": d, "url": u}},
                image_urls, st.sampled_from([None, "auto", "low", "high"]))
)


@st.composite
def conversations(draw):
    messages = [{"role": "system", "content": draw(st.text(max_size=10))}]
    for turn in range(draw(st.integers(0, 3))):
        messages.append({"role": "user", "content": draw(
            st.text(max_size=8) | st.builds(lambda t: [{"type": "text", "text": t}], st.text(max_size=8))
            | st.lists(st.builds(lambda t: {"type": "text", "text": t}, st.text(max_size=4)) | image_parts,
                       min_size=1, max_size=3)
        )})
        ids = [f"call_{turn}_{i}" for i in range(draw(st.integers(0, 3)))]
        if ids:
            messages.append({"role": "assistant", "content": None, "tool_calls": [
                {"id": i, "type": "function", "function": {"name": "f", "arguments": draw(arguments)}} for i in ids
            ]})
            for i in draw(st.permutations(ids)):
                messages.append({"role": "tool", "tool_call_id": i, "content": draw(st.text(max_size=5))})
        else:
            messages.append({"role": "assistant", "content": draw(st.text(max_size=8))})
    body = {"model": "m", "messages": messages, "tools": draw(tools)}
    if draw(st.booleans()):
        body["response_format"] = {"type": "json_schema", "json_schema": draw(st.dictionaries(keys, json_values))}
    return body


def semantic_view(body):
    """What must not change: values with keys order-free, tools as a name-keyed set,
    tool-call arguments as parsed JSON, tool results per id, single text parts as text."""
    def args(a):
        try:
            return ("json", orjson.loads(a))
        except orjson.JSONDecodeError:
            return ("raw", a)

    def image(part):
        if part.get("type") != "image_url":
            return part
        spec = part["image_url"] if isinstance(part["image_url"], dict) else {"url": part["image_url"]}
        return {**part, "image_url": {k: v for k, v in spec.items() if (k, v) != ("detail", "auto")}}

    messages = []
    for m in body["messages"]:
        m = dict(m)
        if isinstance(m.get("content"), list):
            m["content"] = [image(p) for p in m["content"]]
        if isinstance(m.get("content"), list) and len(m["content"]) == 1 and set(m["content"][0]) == {"type", "text"}:
            m["content"] = m["content"][0]["text"]
        if m.get("tool_calls"):
            m["tool_calls"] = [{**c, "function": {**c["function"], "arguments": args(c["function"]["arguments"])}}
                               for c in m["tool_calls"]]
        messages.append(m)
    non_tool = [m for m in messages if m["role"] != "tool"]
    tool_results = sorted(orjson.dumps(m, option=orjson.OPT_SORT_KEYS) for m in messages if m["role"] == "tool")
    tool_set = sorted(orjson.dumps(t, option=orjson.OPT_SORT_KEYS) for t in body.get("tools", []))
    return non_tool, tool_results, tool_set, body.get("response_format")


@settings(max_examples=150, deadline=None)
@given(conversations())
def test_canonicalize_is_deterministic_idempotent_and_preserves_semantics(body):
    original = copy.deepcopy(body)
    once, steps = canonicalize(body, ALL)
    assert body == original and orjson.dumps(body) == orjson.dumps(original), "input must not be mutated"
    again, _ = canonicalize(copy.deepcopy(original), ALL)
    assert orjson.dumps(again) == orjson.dumps(once)  # deterministic, key order included
    twice, steps_twice = canonicalize(once, ALL)
    assert orjson.dumps(twice) == orjson.dumps(once) and steps_twice == []  # idempotent
    assert semantic_view(once) == semantic_view(original)
    assert set(steps) <= set(STEP_NAMES)
    # user and assistant turns keep their order
    roles = [m["role"] for m in once["messages"] if m["role"] != "tool"]
    assert roles == [m["role"] for m in original["messages"] if m["role"] != "tool"]


@settings(max_examples=60, deadline=None)
@given(conversations(), st.permutations(range(4)))
def test_equal_requests_in_any_tool_or_key_order_become_identical(body, order):
    shuffled = copy.deepcopy(body)
    shuffled["tools"] = [shuffled["tools"][i] for i in order if i < len(shuffled["tools"])]
    shuffled["tools"] = [{k: t[k] for k in reversed(list(t))} for t in shuffled["tools"]]
    names = [t["function"]["name"] for t in body["tools"]]
    if len(set(names)) == len(names):  # duplicate names keep their sent order (stable sort)
        assert orjson.dumps(canonicalize(shuffled, ALL)[0]) == orjson.dumps(canonicalize(body, ALL)[0])


def ordered_parts(value, inside=None):
    """What canonicalization must keep in order: the member names of every ``properties``
    object, and ``const``/``enum``/``default``/``examples`` values byte for byte."""
    found = []
    if isinstance(value, dict):
        for key, child in value.items():
            if key in ("const", "enum", "default", "examples"):
                found.append((key, orjson.dumps(child)))
                continue
            if key in ("properties", "patternProperties") and isinstance(child, dict):
                found.append((key, tuple(child)))
                for member in child.values():
                    found.extend(ordered_parts(member))
                continue
            found.extend(ordered_parts(child))
    elif isinstance(value, list):
        for child in value:
            found.extend(ordered_parts(child))
    return sorted(found)


def argument_orders(body):
    orders = []
    for m in body["messages"]:
        for c in m.get("tool_calls") or []:
            try:
                value = orjson.loads(c["function"]["arguments"])
            except orjson.JSONDecodeError:
                continue
            orders.append(orjson.dumps(value))  # orjson keeps member order
    return orders


@settings(max_examples=150, deadline=None)
@given(conversations())
def test_order_significant_parts_are_kept(body):
    """Field order (``properties``), data values and the model's argument order survive every step."""
    once, _ = canonicalize(body, ALL)
    assert sorted(map(ordered_parts, once["tools"])) == sorted(map(ordered_parts, body["tools"]))
    assert ordered_parts(once.get("response_format")) == ordered_parts(body.get("response_format"))
    assert argument_orders(once) == argument_orders(body)


def test_schema_field_order_is_kept_and_keywords_sorted():
    schema = {"type": "object", "required": ["name", "species", "age"], "additionalProperties": False,
              "properties": {"name": {"type": "string"}, "species": {"type": "string", "enum": ["dog", "cat"]},
                             "age": {"type": "integer"},
                             "tag": {"const": {"z": 1, "a": 2}, "type": "object"}}}
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}],
            "response_format": {"type": "json_schema", "json_schema": {"name": "Pet", "schema": schema}}}
    result, steps = canonicalize(body, ALL)
    assert steps == ["response_format.keys_sorted"]
    out = result["response_format"]["json_schema"]["schema"]
    assert list(out) == ["additionalProperties", "properties", "required", "type"]
    assert list(out["properties"]) == ["name", "species", "age", "tag"]
    assert out["required"] == ["name", "species", "age"]
    assert list(out["properties"]["tag"]["const"]) == ["z", "a"]  # data, kept as sent
    assert list(out["properties"]["tag"]) == ["const", "type"]


def test_each_step_on_an_example():
    body = {
        "model": "m",
        "tools": [{"type": "function", "function": {"name": "b", "parameters": {"z": 1, "a": 2}}},
                  {"type": "function", "function": {"name": "a"}}],
        "response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "object", "properties": {}}}},
        "messages": [
            {"role": "user", "content": [{"type": "text", "text": "hi"}]},
            {"role": "assistant", "tool_calls": [
                {"id": "1", "type": "function", "function": {"name": "b", "arguments": '{"y": 1,  "x": [1, 2]}'}},
                {"id": "2", "type": "function", "function": {"name": "a", "arguments": "not json {"}},
            ]},
            {"role": "tool", "tool_call_id": "2", "content": "two"},
            {"role": "tool", "tool_call_id": "1", "content": "one"},
            {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
            {"role": "user", "content": [{"type": "image_url", "image_url": "https://img.example/a.png"},
                                         {"type": "image_url", "image_url": {"url": "data:,", "detail": "auto"}},
                                         {"type": "image_url", "image_url": {"url": "data:,", "detail": "low"}}]},
        ],
    }
    result, steps = canonicalize(body, ALL)
    assert steps == list(STEP_NAMES)
    assert [t["function"]["name"] for t in result["tools"]] == ["a", "b"]
    assert list(result["tools"][1]["function"]["parameters"]) == ["a", "z"]
    assert list(result["response_format"]) == ["json_schema", "type"]
    calls = result["messages"][1]["tool_calls"]
    assert calls[0]["function"]["arguments"] == '{"y":1,"x":[1,2]}'  # compact, the model's member order kept
    assert calls[1]["function"]["arguments"] == "not json {"
    assert [m.get("tool_call_id") for m in result["messages"][2:4]] == ["1", "2"]
    assert result["messages"][0]["content"] == "hi"
    assert isinstance(result["messages"][4]["content"], list)  # two parts stay a list
    assert [p["image_url"] for p in result["messages"][5]["content"]] == [
        {"url": "https://img.example/a.png"}, {"url": "data:,"}, {"url": "data:,", "detail": "low"}]
    assert canonicalize(body, NONE) == (body, [])


def test_tool_results_not_matching_the_calls_are_left_alone():
    messages = [
        {"role": "assistant", "tool_calls": [{"id": "1", "function": {"name": "f", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "9", "content": "stray"},
        {"role": "tool", "tool_call_id": "1", "content": "one"},
    ]
    result, steps = canonicalize({"model": "m", "messages": messages}, ALL)
    assert result["messages"] == messages and "tool_results.reordered" not in steps


def test_switches_are_independent():
    body = {"model": "m", "messages": [{"role": "user", "content": [{"type": "text", "text": "x"}]}],
            "tools": [{"function": {"name": "b"}, "type": "function"}, {"type": "function", "function": {"name": "a"}}]}
    only_parts = CanonicalizeSwitches(tools=False, response_format=False, tool_call_arguments=False,
                                      tool_result_order=False, single_text_part=True, image_parts=False)
    result, steps = canonicalize(body, only_parts)
    assert steps == ["content.single_text_part"]
    assert result["tools"] == body["tools"] and list(result["tools"][0]) == ["function", "type"]


def test_deeply_nested_values_raise_nothing():
    """Past orjson's 254 levels: a deep tool is still canonicalized, deep arguments (already compact) stay."""
    deep_arguments = "[" * 600 + "]" * 600  # parses (orjson reads 1,024 levels), cannot be re-encoded
    deep_tool: dict = {}
    node = deep_tool
    for _ in range(300):
        node["b"] = {}
        node = node["b"]
    body = {
        "model": "m",
        "tools": [{"function": {"parameters": deep_tool, "name": "f"}, "type": "function"}],
        "messages": [
            {"role": "assistant", "tool_calls": [{"id": "c", "function": {"name": "f", "arguments": deep_arguments}}]},
        ],
    }
    result, steps = canonicalize(body, ALL)
    assert steps == ["tools.keys_sorted"]
    assert list(result["tools"][0]) == ["function", "type"] and list(result["tools"][0]["function"]) == ["name", "parameters"]
    assert result["messages"][0]["tool_calls"][0]["function"]["arguments"] == deep_arguments


def test_image_steps_follow_their_switch_and_never_touch_the_url():
    url = "data:image/png;base64,iVBORw0KGgo="
    body = {"model": "m", "messages": [{"role": "user", "content": [
        {"type": "text", "text": "what is it?"}, {"type": "image_url", "image_url": {"url": url, "detail": "auto"}}]}]}
    off = CanonicalizeSwitches(image_parts=False)
    assert canonicalize(body, off) == (body, [])
    result, steps = canonicalize(body, ALL)
    assert steps == ["image_url.detail_auto_dropped"]
    assert result["messages"][0]["content"][1] == {"type": "image_url", "image_url": {"url": url}}
