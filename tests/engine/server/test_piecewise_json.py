"""piecewise_json.loads is orjson.loads: the same value, or the same error, for every input."""

from __future__ import annotations

import json

import orjson
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine.contract import piecewise_json


@pytest.fixture
def small_pieces(monkeypatch):
    """Pieces of 16 bytes past 32: every corpus body below is split, many times over."""
    monkeypatch.setattr(piecewise_json, "PIECED_ABOVE_BYTES", 32)
    monkeypatch.setattr(piecewise_json, "PIECE_BYTES", 16)


def outcome(load, raw: bytes):
    try:
        value = load(raw)
    except orjson.JSONDecodeError as exc:
        return ("error", str(exc), exc.pos)
    return ("value", value, list(value) if isinstance(value, dict) else None)  # keys in order too


def same_as_orjson(raw: bytes) -> None:
    assert outcome(piecewise_json.loads, raw) == outcome(orjson.loads, raw)


MESSAGES = [{"role": "user", "content": f"note {i}"} for i in range(20)]
CORPUS = [
    json.dumps({"model": "m", "messages": MESSAGES}),
    json.dumps({"model": "m", "messages": MESSAGES, "tools": MESSAGES, "input": MESSAGES}),
    '{"messages": [' + ",".join(['"a \\" ] } [ { , b"', '"\\\\"', '"\\u005d\\u0022"'] * 8) + "]}",
    '{"messages": [' + ",".join(['{"c": "]]]}}},,,"}'] * 8) + '], "x": "[["}',
    json.dumps({"messages": ["héllo ✓ 😀 " * 3, "\u2028", {"k": "日本"}] * 6}, ensure_ascii=False),
    json.dumps({"messages": [[[1, [2, {"a": [3]}]], []], {}, [], 0.5, -1e10, True, None] * 6}),
    ' \n\t{ "messages" \n:\t [ ' + " ,\n ".join(['{ "a" : [ 1 , 2 ] }'] * 10) + " ] \r\n , \"m\" : 1 } \n",
    json.dumps({"messages": [1, 2, 3, 12345678901234567890, 1.5e300, -0.0] * 10}),
    json.dumps({"messages": [{"a": 1}] * 10, "messages2": [{"a": 1}] * 10}),
    # duplicate keys: the last value wins, in the first key's place
    '{"messages": [' + ",".join(['{"a": 1}'] * 10) + '], "m": 2, "messages": [' + ",".join(['{"b": 2}'] * 10) + "]}",
    '{"messages": [' + ",".join(['{"a": 1}'] * 10) + '], "messages": 3}',
    '{"messages": 3, "messages": [' + ",".join(['{"a": 1}'] * 10) + "]}",
    json.dumps({"a": {"messages": [{"x": 1}] * 10}, "b": [[{"y": 2}] * 10]}),
    json.dumps([{"messages": [{"x": 1}] * 10}]),
    '"' + "x" * 100 + '"',
    json.dumps({"deep": [[[[[[[[[[{"x": [1]}]]]]]]]]]] * 5}),
    "[" * 300 + "]" * 300,
    '{"o": {"k": "[", "m": 1}, "messages": [' + ",".join(["{}", '{"a": "}{"}', "[]", '{"b": {}}'] * 5) + '], "p": {}}',
    '{"messages": [' + ",".join(['{"a": "\\\\"}', '{"a": "\\"}"}'] * 8) + "]}",
    '{"messages": ' + "[" * 300 + "]" * 300 + "}",
]
# Malformed: each must give orjson's own error (message and position).
BROKEN = [
    '{"messages": [' + ",".join(['{"a": 1}'] * 10) + ",]}",  # trailing comma
    '{"messages": [' + ",".join(['{"a": 1}'] * 10) + ",,{}]}",  # stray comma
    '{"messages": [' + " ".join(['{"a": 1}'] * 10) + "]}",  # no commas
    '{"messages": [' + ",".join(['{"a": 1}'] * 10) + "]",  # unclosed object
    '{"messages": [' + ",".join(['{"a": 1}'] * 10) + "}}",  # mismatched bracket
    '{"messages": [' + ",".join(['{"a": 1}'] * 10) + "]} trailing",
    '{"messages": [' + ",".join(['{"a": 1}'] * 10) + "]}{}",
    '{"messages": [' + ",".join(['{"a": "\\x"}'] * 10) + "]}",  # bad escape
    '{"messages": [' + ",".join(['{"a": "unterminated}'] * 10) + "]}",
    '{"messages" [' + ",".join(['{"a": 1}'] * 10) + "]}",  # no colon
    '{"messages": [' + ",".join(['{"a": 1}'] * 10) + '], "x": tru}',
    '{"mess\\qages": [' + ",".join(['{"a": 1}'] * 10) + "]}",  # bad escape in the key
    '{"messages": [' + ",".join(['{"a": 01}'] * 10) + "]}",
    '{"messages": [' + ",".join(['{"a": NaN}'] * 10) + "]}",
    '{"messages": [' + ",".join(['{"a": 1}'] * 10) + "\x00]}",
    "[" * 2000 + "]" * 2000,  # deeper than orjson allows
    '{"messages": ' + "[" * 2000 + "]" * 2000 + "}",
    "",
    "{",
]


@pytest.mark.parametrize("text", CORPUS + BROKEN, ids=range(len(CORPUS + BROKEN)))
def test_corpus_gives_what_orjson_gives(small_pieces, text):
    same_as_orjson(text.encode())


def test_the_corpus_is_split_and_broken_bodies_are_refused(small_pieces):
    """The corpus exercises the pieces (not only the fallback), and the broken ones fail."""
    assert piecewise_json._plan(CORPUS[0].encode()) and piecewise_json._plan(CORPUS[2].encode())
    for text in BROKEN:
        with pytest.raises(orjson.JSONDecodeError):
            piecewise_json.loads(text.encode())


def test_invalid_utf8_gives_orjson_error(small_pieces):
    same_as_orjson(b'{"messages": [' + b",".join([b'{"a": "\xff"}'] * 10) + b"]}")


def test_a_large_chat_body_in_default_pieces():
    raw = orjson.dumps({"model": "m", "messages": [{"role": "user", "content": f"n {i} \"]"} for i in range(40_000)],
                        "tools": [{"type": "function", "function": {"name": f"f{i}"}} for i in range(5000)]})
    splits = piecewise_json._plan(raw)
    assert splits is not None and [key for key, *_ in splits] == ["messages", "tools"]
    assert max(end - start for *_, runs in splits for start, end in runs) < 2 * piecewise_json.PIECE_BYTES
    same_as_orjson(raw)


json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**63), 2**63 - 1) | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(alphabet=st.characters(codec="utf-8", exclude_categories=["Cs"]) | st.sampled_from('[]{},:"\\')),
    lambda children: st.lists(children, max_size=6) | st.dictionaries(st.text(max_size=5), children, max_size=5),
    max_leaves=40,
)
bodies = st.dictionaries(st.sampled_from(["messages", "tools", "input", "model", "x"]),
                         st.lists(json_values, max_size=12) | json_values, max_size=5)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(body=bodies, indent=st.booleans(), cut=st.integers(0, 10_000), byte=st.sampled_from(b',[]{}":\\ x0'))
def test_property_same_as_orjson_and_under_damage(small_pieces, body, indent, cut, byte):
    """Random bodies (and each with one byte replaced) give what orjson gives."""
    raw = json.dumps(body, indent=2 if indent else None, ensure_ascii=False).encode()
    same_as_orjson(raw)
    position = cut % len(raw)
    same_as_orjson(raw[:position] + bytes([byte]) + raw[position + 1:])
    same_as_orjson(raw[:position])
