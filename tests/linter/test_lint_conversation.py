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
