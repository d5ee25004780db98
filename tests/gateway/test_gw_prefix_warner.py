"""PrefixWarner: conversation identity, bounded history, and tolerance of linter failures."""

from __future__ import annotations

import linter.api
from gateway import prefix_warner
from gateway.prefix_warner import PrefixWarner, conversation_key

SYSTEM = {"role": "system", "content": "You answer questions about the billing system of the shop."}


def turn(*contents):
    messages = [SYSTEM]
    for i, content in enumerate(contents):
        messages.append({"role": "user" if i % 2 == 0 else "assistant", "content": content})
    return {"model": "m", "messages": messages}


def test_conversation_key_uses_the_header_or_the_first_user_message():
    assert conversation_key(turn("a"), None) == conversation_key(turn("a", "b", "c"), None)
    assert conversation_key(turn("a"), None) != conversation_key(turn("x"), None)
    assert conversation_key(turn("a"), "thread-1") == conversation_key(turn("x"), "thread-1") == "header:thread-1"
    assert conversation_key({"model": "m", "messages": [SYSTEM]}, None) is None


def test_rewritten_history_is_reported_and_appending_is_not():
    warner = PrefixWarner()
    first = turn("What is my balance?", "12 euros.", "And last month?")
    assert not [w for w in warner.check("t", first, first, body_size=10) if w.code.startswith("PS2")]
    appended = turn("What is my balance?", "12 euros.", "And last month?", "8 euros.", "Thanks")
    assert not [w for w in warner.check("t", appended, appended, body_size=10) if w.code.startswith("PS2")]
    edited = turn("What is my balance?", "Balance: 12 EUR.", "And last month?", "8 euros.", "Thanks!")
    codes = [w.code for w in warner.check("t", edited, edited, body_size=10)]
    assert any(code.startswith("PS2") for code in codes)


def test_history_is_bounded_per_tenant_and_in_tenants():
    warner = PrefixWarner(max_tenants=2, max_conversations=3, max_body_bytes=100)
    for i in range(5):
        body = turn(f"question {i}")
        warner.check("t1", body, body, body_size=10)
    assert len(warner._history["t1"]) == 3
    big = turn("huge")
    warner.check("t1", big, big, body_size=101)
    assert len(warner._history["t1"]) == 3 and all("huge" not in str(v) for v in warner._history["t1"].values())
    for tenant in ("t2", "t3"):
        warner.check(tenant, turn("q"), turn("q"), body_size=10)
    assert list(warner._history) == ["t2", "t3"]


def test_a_failing_linter_never_fails_the_request(monkeypatch):
    def boom(*args, **kwargs):
        raise RuntimeError("rule crashed")

    monkeypatch.setattr(prefix_warner, "check_request", boom)
    monkeypatch.setattr(prefix_warner, "compare_requests", boom)
    warner = PrefixWarner()
    body = turn("a")
    assert warner.check("t", body, body, body_size=1) == []
    assert warner.check("t", body, body, body_size=1) == []
    assert linter.api.check_request is not boom
