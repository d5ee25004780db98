"""Conversation identity (linter/conversation.py) as the linter's log pass uses it."""

import json

from linter.config import LintConfig
from linter.conversation import conversation_keys
from linter.runner import lint_paths
from linter.tokenizer import ApproxTokenizer

SYSTEM = {"role": "system", "content": "You are the assistant of a bicycle repair shop. Answer in one or two sentences. " * 3}


def chat(*contents, **extra):
    messages = [SYSTEM]
    for i, content in enumerate(contents):
        messages.append({"role": "user" if i % 2 == 0 else "assistant", "content": content})
    return {"model": "m", "messages": messages, **extra}


def lint(tmp_path, bodies):
    path = tmp_path / "log.jsonl"
    path.write_text("".join(json.dumps(b) + "\n" for b in bodies))
    return lint_paths([path], LintConfig(), ApproxTokenizer(), with_estimate=False).findings


def test_unrelated_chats_opening_with_the_same_message_are_not_compared_as_one(tmp_path):
    bodies = [
        chat("hi"),
        chat("hi", "Hello! How can I help?", "Do you fix cargo bikes?"),
        chat("hi", "Hi there.", "When are you open on Sunday?"),
        chat("hi", "Hey!", "How much is a new chain?", "About 30 euros.", "Thanks"),
    ]
    assert lint(tmp_path, bodies) == []


def test_an_explicit_id_ties_a_rewritten_history_to_its_conversation(tmp_path):
    first = chat("hi", "Hello!", "Fix my brakes?", conversation_id=None)
    first.pop("conversation_id")
    edited = chat("hi", "Hello, welcome!", "Fix my brakes?", "Yes.", "When?")
    for body in (first, edited):
        body["metadata"] = {"conversation_id": "thread-1"}
    (finding,) = lint(tmp_path, [first, edited])
    assert finding.code == "PS204" and finding.tokens_lost > 0
    first_key, edited_key = dict(first, metadata={}), dict(edited, metadata={})
    assert lint(tmp_path, [first_key, edited_key]) == []  # without the id: two conversations


def test_keys_prefer_header_then_metadata_then_prompt_cache_key():
    body = chat("a", metadata={"conversation_id": "m-1"}, prompt_cache_key="k-1")
    assert conversation_keys(body, "h-1").remember == "id:h-1"
    assert conversation_keys(body).remember == "id:m-1"
    assert conversation_keys(chat("a", prompt_cache_key="k-1")).remember == "id:k-1"


def test_implicit_keys_follow_extensions_only_with_the_same_settings():
    turn1, turn2 = conversation_keys(chat("a")), conversation_keys(chat("a", "b", "c"))
    assert turn1.remember in turn2.lookup and turn2.lookup[0] == turn2.remember
    retry = conversation_keys(chat("a"))
    assert retry.remember == turn1.remember
    with_tools = conversation_keys(chat("a", "b", "c", tools=[{"type": "function", "function": {"name": "f"}}]))
    assert turn1.remember not in with_tools.lookup
    assert conversation_keys(chat("a", user="u1")).remember != turn1.remember


def test_a_shared_prompt_cache_key_reports_truncation_but_not_other_conversations(tmp_path):
    key = {"prompt_cache_key": "support-app"}
    hello = "Hello! We fix brakes, gears, wheels and e-bike motors. Tell me what is wrong with your bicycle today."
    hey = "Hey there. Ask me about repairs, spare parts, opening hours or prices and I will answer right away."
    chats = [chat("hi", hello, "Fix my brakes?", **key), chat("hi", hey, "New tyres?", **key)]
    assert lint(tmp_path, chats) == []  # two conversations under one application-wide key
    named = [{**body, "metadata": {"conversation_id": "one"}} for body in chats]
    assert [f.code for f in lint(tmp_path, named)] == ["PS204"]  # the same bodies under one explicit id
    long = chat("q1", "a1", "q2", "a2", "q3", "a3", "q4", **key)
    window = {**long, "messages": [SYSTEM, *long["messages"][3:], {"role": "assistant", "content": "a4"}, {"role": "user", "content": "q5"}]}
    (finding,) = lint(tmp_path, [long, window])
    assert finding.code == "PS204" and "truncated" in finding.message
    assert conversation_keys(long).shared and not conversation_keys(chat("x", metadata={"conversation_id": "c"})).shared


REPLY = "We repair brakes the same day when you bring the bike before noon; the usual price is 25 euros."


def test_a_repeated_model_output_ties_an_edited_first_message_to_its_conversation(tmp_path):
    """No id: the later turn repeats the model's reply (and what followed it) verbatim."""
    turn1 = chat("Can you fix my brakes?")
    turn2 = chat("Can you fix my brakes?", REPLY, "And the gears?")
    edited = chat("Can you fix my brakes today?", REPLY, "And the gears?", "Yes, gears too.", "Thanks!")
    (finding,) = lint(tmp_path, [turn1, turn2, edited])
    assert finding.code == "PS204" and finding.tokens_lost > 0
    assert finding.location.startswith("messages[1]")
    assert conversation_keys(turn2).also[0] in conversation_keys(edited).lookup


def test_re_serialized_tool_call_arguments_in_a_replayed_history_are_found(tmp_path):
    call = {"id": "call_8f2k", "type": "function", "function": {"name": "book", "arguments": '{"day": "Monday", "bike": "cargo"}'}}
    tools = [{"type": "function", "function": {"name": "book", "parameters": {"type": "object", "properties": {
        "day": {"type": "string"}, "bike": {"type": "string"}}}}}]
    head = [SYSTEM, {"role": "user", "content": "Book a repair for my cargo bike on Monday."}]
    turn2 = {"model": "m", "tools": tools, "messages": [*head, {"role": "assistant", "content": None, "tool_calls": [call]},
                                                          {"role": "tool", "tool_call_id": "call_8f2k", "content": "Booked, slot 9:00."}]}
    replayed_call = {**call, "function": {"name": "book", "arguments": json.dumps({"bike": "cargo", "day": "Monday"})}}
    turn3 = {**turn2, "messages": [*head, {"role": "assistant", "content": None, "tool_calls": [replayed_call]},
                                   turn2["messages"][3], {"role": "assistant", "content": "Booked for Monday at 9:00."},
                                   {"role": "user", "content": "Thanks"}]}
    (finding,) = lint(tmp_path, [turn2, turn3])
    assert finding.code == "PS203" and "arguments" in finding.message


def test_one_reply_to_the_same_greeting_does_not_tie_unrelated_chats(tmp_path):
    """At temperature 0 the model greets every "hi" alike; what follows differs, so no link."""
    hello = "Hello! How can I help you with your bicycle today? We repair all kinds of bikes."
    bodies = [chat("hi", hello, "Do you fix cargo bikes?"), chat("hi", hello, "When are you open on Sunday?"),
              chat("hi", hello, "How much is a chain?", "About 30 euros.", "Thanks")]
    assert lint(tmp_path, bodies) == []
    assert not {conversation_keys(bodies[0]).remember, *conversation_keys(bodies[0]).also} & set(conversation_keys(bodies[1]).lookup)
