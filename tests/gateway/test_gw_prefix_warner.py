"""PrefixWarner: conversation identity, bounded history, and tolerance of linter failures."""

from __future__ import annotations

import linter.api
from gateway.policy import lint_check
from gateway.policy.prefix_warner import PrefixWarner
from linter.api import conversation_keys

SYSTEM = {"role": "system", "content": "You answer questions about the billing system of the shop."}


def turn(*contents):
    messages = [SYSTEM]
    for i, content in enumerate(contents):
        messages.append({"role": "user" if i % 2 == 0 else "assistant", "content": content})
    return {"model": "m", "messages": messages}


def test_conversation_identity_is_an_explicit_id_or_an_extension_never_the_first_message():
    first, later = conversation_keys(turn("a")), conversation_keys(turn("a", "b", "c"))
    assert first.remember in later.lookup  # a later turn extends the earlier one
    other = conversation_keys(turn("a", "different answer", "c"))
    assert conversation_keys(turn("a", "b")).remember not in other.lookup  # same first message, not an extension
    header = conversation_keys(turn("x"), "thread-1")
    assert header.explicit and header.lookup == (header.remember,) == conversation_keys(turn("y"), "thread-1").lookup
    by_metadata = conversation_keys({**turn("x"), "metadata": {"conversation_id": "thread-1"}})
    by_cache_key = conversation_keys({**turn("y"), "prompt_cache_key": "thread-1"})
    assert by_metadata.remember == by_cache_key.remember == header.remember
    assert conversation_keys({"model": "m", "messages": [SYSTEM]}) is None


def test_rewritten_history_is_reported_and_appending_is_not():
    warner = PrefixWarner()

    def ps2(body, header=None):
        return [w.code for w in warner.check("t", body, body, body_size=10, conversation_header=header) if w.code.startswith("PS2")]

    first = turn("What is my balance?", "12 euros.", "And last month?")
    assert ps2(first, "c1") == []
    appended = turn("What is my balance?", "12 euros.", "And last month?", "8 euros.", "Thanks")
    assert ps2(appended, "c1") == []
    edited = turn("What is my balance?", "Balance: 12 EUR.", "And last month?", "8 euros.", "Thanks!")
    assert ps2(edited, "c1") == ["PS204"]
    # Without an id, an edited history is not an extension: another conversation, no comparison.
    assert ps2(turn("What is my balance?", "12 euros.", "And last month?")) == []
    assert ps2(turn("What is my balance?", "Balance: 12 EUR.", "And last month?", "8 euros.")) == []


def test_unrelated_requests_that_both_start_with_hi_get_no_cross_request_warning():
    warner = PrefixWarner()
    tools_a = {"tools": [{"type": "function", "function": {"name": "weather", "parameters": {"type": "object"}}}]}
    bodies = [
        {**turn("hi"), "tool_choice": "auto", **tools_a},
        {**turn("hi", "Hello! How can I help?", "What is the weather in Paris?"), **tools_a},
        {**turn("hi", "Hey there.", "Cancel my order 1234, please."), "response_format": {"type": "json_object"}},
        turn("hi", "Hi! What do you need?", "Reset my password"),
    ]
    for body in bodies:
        codes = [w.code for w in warner.check("tenant", body, body, body_size=10)]
        assert not [c for c in codes if c.startswith("PS2")], codes


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

    monkeypatch.setattr(lint_check, "check_request", boom)  # the check itself lives there
    monkeypatch.setattr(lint_check, "compare_requests", boom)
    warner = PrefixWarner()
    body = turn("a")
    assert warner.check("t", body, body, body_size=1) == []
    assert warner.check("t", body, body, body_size=1) == []
    assert linter.api.check_request is not boom


def test_a_shared_prompt_cache_key_does_not_tie_unrelated_chats():
    hello = "Hello! I can help with invoices, refunds, payment methods and plan changes. What do you need today?"
    hey = "Hey. Ask me anything about your bill, your plan or a refund and I will look it up for you right away."
    bodies = [turn("hi", hello, "Balance?"), turn("hi", hey, "Refund?")]
    for header, expected in ((None, []), ("thread-9", ["PS204"])):  # the same two bodies under one explicit id
        warner = PrefixWarner()
        codes = []
        for body in bodies:
            body = {**body, "prompt_cache_key": "billing-app"}
            codes += [w.code for w in warner.check("t", body, body, body_size=10, conversation_header=header) if w.code.startswith("PS2")]
        assert codes == expected


def test_each_execution_path_gives_the_same_findings_in_the_same_order():
    """On the loop (per-request rules before the history's reply), on a thread and all at
    once: one body with both per-request findings (a date) and a broken prefix."""
    import asyncio

    dated = {"role": "system", "content": "Today is 2026-11-23 10:42:17. " + SYSTEM["content"] * 4}
    first = {"model": "m", "messages": [dated, {"role": "user", "content": "My balance?"}]}
    second = {"model": "m", "messages": [{**dated, "content": dated["content"] + "!"},
                                         {"role": "user", "content": "My balance?"},
                                         {"role": "assistant", "content": "12"},
                                         {"role": "user", "content": "And last month?"}]}
    found = []
    for warner in (PrefixWarner(), PrefixWarner(loop_max_bytes=0)):
        async def go(warner: PrefixWarner = warner) -> list:
            await warner.check_within_budget("t", first, first, body_size=500, conversation_header="c")
            return await warner.check_within_budget("t", second, second, body_size=500, conversation_header="c")
        found.append(asyncio.run(go()))
        warner.close()
    reference = PrefixWarner()
    reference.check("t", first, first, body_size=500, conversation_header="c")
    found.append(reference.check("t", second, second, body_size=500, conversation_header="c"))
    codes = [w.code for w in found[0]]
    assert "PS101" in codes and any(code.startswith("PS2") for code in codes), codes
    assert codes.index("PS101") < min(i for i, code in enumerate(codes) if code.startswith("PS2"))
    assert found[0] == found[1] == found[2]


def test_without_an_id_a_repeated_model_reply_ties_an_edited_first_message_to_its_conversation():
    """The gateway and the linter share linter/conversation.py: the later turn repeats the
    model's reply verbatim, so editing the first message is a rewritten history (PS204)."""
    warner = PrefixWarner()

    def ps2(body):
        return [w.code for w in warner.check("t", body, body, body_size=10) if w.code.startswith("PS2")]

    reply = "Your balance is 12 euros; the last payment arrived on the 3rd and nothing is overdue."
    assert ps2(turn("What is my balance?")) == []
    assert ps2(turn("What is my balance?", reply, "And last month?")) == []
    assert ps2(turn("What is my balance in euros?", reply, "And last month?", "8 euros.", "Thanks")) == ["PS204"]
    # another chat that got the same reply but then asked something else is not tied to it
    assert ps2(turn("Balance please", reply, "Can I pay by card?", "Yes.", "Good")) == []
