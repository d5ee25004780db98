"""Regenerates the labelled request logs in examples/corpora/logs/ (deterministic).

Each line is a log record shaped like what an application logs around an OpenAI
chat-completions call: ``ts``, ``request_id``, the request body under
``request`` (multi-turn chats, tools and tool results, parallel tool calls,
image parts (a photo chat whose image URL is re-signed every turn: PS207), ``user``, ``metadata``, ``prompt_cache_key``, ``response_format``)
and the response's ``usage``, plus ``expect``: the codes ``prefixgate lint``
must report on that line with its default rules (the label, set where a break
was planted). ``clean.jsonl`` and ``clean_trailing_space.jsonl`` (each linted on
its own) have no break at all; ``breaks.jsonl`` uses the same applications with
planted breaks. Run from the repository root:

    python examples/corpora/generate_logs.py
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent / "logs"

SUPPORT = (
    "You are Nimbus, the support assistant of Larkspur Outdoor Gear. Help customers with orders, "
    "returns and product questions. Look orders up with the tools before answering, never guess an "
    "order status, and keep answers under 120 words. Refunds above 200 EUR need a human agent: offer "
    "to hand over instead of promising anything. Knowledge cutoff: 2024-06-01."
)
EXTRACT = (
    "Extract the fields of the receipt in the image or text the user sends. Use ISO dates, amounts "
    "as numbers with a dot as the decimal separator, and null for anything you cannot read. "
    "Example date format: 2024-01-31."
)
CODER = (
    "You are a careful pair programmer.\n"
    "- Read files with the tools before proposing changes.\n"
    "- Keep diffs minimal and explain the reason for each change in one sentence.\n"
    "- Run the tests after editing and report the result.\n"
    "- Never change public function signatures without asking first."
)
GENERAL = "You are a friendly general assistant. Answer clearly and briefly. "

# Tool schemas as real SDK code writes them: keys in declaration order, not sorted, but the same every time.
GET_ORDER = {"type": "function", "function": {"name": "get_order", "description": "Look up an order by its number.", "parameters": {"type": "object", "properties": {"order_id": {"type": "string", "description": "Order number, e.g. LK-10042"}}, "required": ["order_id"], "additionalProperties": False}, "strict": True}}
SEARCH_KB = {"type": "function", "function": {"name": "search_kb", "description": "Search the help-center articles.", "parameters": {"type": "object", "properties": {"query": {"type": "string"}, "limit": {"type": "integer", "minimum": 1, "maximum": 5}}, "required": ["query"]}}}
START_RETURN = {"type": "function", "function": {"name": "start_return", "description": "Open a return for items of an order.", "parameters": {"type": "object", "properties": {"order_id": {"type": "string"}, "items": {"type": "array", "items": {"type": "string"}}, "reason": {"type": "string", "enum": ["damaged", "wrong_size", "other"]}}, "required": ["order_id", "items", "reason"]}}}
READ_FILE = {"type": "function", "function": {"name": "read_file", "description": "Read a file of the repository.", "parameters": {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]}}}
RUN_TESTS = {"type": "function", "function": {"name": "run_tests", "description": "Run the test suite, optionally one path.", "parameters": {"type": "object", "properties": {"path": {"type": "string"}}, "required": []}}}
SUPPORT_TOOLS = [GET_ORDER, SEARCH_KB, START_RETURN]
CODER_TOOLS = [READ_FILE, RUN_TESTS]
RECEIPT_FORMAT = {"type": "json_schema", "json_schema": {"name": "receipt", "strict": True, "schema": {"type": "object", "properties": {"merchant": {"type": ["string", "null"]}, "date": {"type": ["string", "null"]}, "total": {"type": ["number", "null"]}, "currency": {"type": ["string", "null"]}}, "required": ["merchant", "date", "total", "currency"], "additionalProperties": False}}}

QUESTIONS = [
    "Where is my order LK-10{n}?", "Can I return the tent I bought last week?", "Do the Ridge boots run small?",
    "My jacket arrived with a broken zip, what now?", "How long do refunds take?", "Is the 2-person tent waterproof?",
]
ANSWERS = ["Let me check that for you.", "Sure, here is what I found.", "Thanks for waiting.", "Happy to help with that."]
HI = ["hi", "Hi", "hello"]


class Log:
    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)
        self.lines: list[str] = []
        self.clock = 1_763_700_000
        self.count = 0

    def add(self, body: dict[str, Any], expect: list[str] | None = None) -> None:
        self.clock += self.rng.randint(1, 40)
        self.count += 1
        prompt_tokens = sum(len(json.dumps(m)) // 4 for m in body["messages"])
        record: dict[str, Any] = {
            "ts": self.clock,
            "request_id": f"req_{self.count:06d}",
            "request": body,
            "response": {"usage": {"prompt_tokens": prompt_tokens, "completion_tokens": self.rng.randint(8, 90)}},
        }
        if expect:
            record["expect"] = expect
        self.lines.append(json.dumps(record, ensure_ascii=False) + "\n")


def _call(call_id: str, name: str, arguments: dict[str, Any]) -> dict[str, Any]:
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": json.dumps(arguments)}}


def support_chat(log: Log, n: int, *, system: str = SUPPORT, ids: str = "metadata", breaks: dict[str, Any] | None = None) -> None:
    """A multi-turn support chat with one and then two parallel tool calls; ``breaks`` plants failures."""
    b = breaks or {}
    rng = log.rng
    explicit = ids != "none"
    # Without an id, a turn is tied to the one before by extension, or (from the third turn,
    # once the turn before holds a model output) by repeating that output: linter/conversation.py.
    def linked(turn: int) -> bool:
        return explicit or turn >= 2
    user = f"cust_{4100 + n}"
    extra: dict[str, Any] = {"user": user}
    if ids == "metadata":
        extra["metadata"] = {"conversation_id": f"conv_{n:04d}", "channel": "web"}
    elif ids == "cache_key":
        extra["prompt_cache_key"] = f"support-chat-{n:04d}"
    history: list[dict[str, Any]] = []
    question = rng.choice(QUESTIONS).format(n=n)
    turns = [
        [{"role": "user", "content": question}],
        [{"role": "assistant", "content": None, "tool_calls": [_call(f"call_{n}a", "get_order", {"order_id": f"LK-10{n}"})]},
         {"role": "tool", "tool_call_id": f"call_{n}a", "content": json.dumps({"status": "shipped", "carrier": "DHL"})},
         {"role": "assistant", "content": "It shipped with DHL yesterday."},
         {"role": "user", "content": "And can I still return one item from it?"}],
        [{"role": "assistant", "content": None, "tool_calls": [_call(f"call_{n}b", "search_kb", {"query": "return window"}),
                                                              _call(f"call_{n}c", "get_order", {"order_id": f"LK-10{n}"})]},
         {"role": "tool", "tool_call_id": f"call_{n}b", "content": "Returns are accepted within 30 days."},
         {"role": "tool", "tool_call_id": f"call_{n}c", "content": json.dumps({"status": "shipped", "items": ["tent", "stakes"]})},
         {"role": "assistant", "content": rng.choice(ANSWERS) + " Yes, within 30 days."},
         {"role": "user", "content": "Great, please start a return for the stakes."}],
    ]
    for t, new in enumerate(turns):
        history.extend(new)
        sys_text = system
        expect: list[str] = []
        if b.get("timestamp"):
            sys_text = f"Current date and time: 2026-11-21T{9 + t:02d}:{rng.randint(0, 59):02d}:{rng.randint(0, 59):02d}Z. " + system
            expect.append("PS101")
        if b.get("counter") and t > 0:
            sys_text = system + f" You have answered {t} question(s) in this chat."
            expect.append("PS206")
        tools = list(SUPPORT_TOOLS)
        if b.get("shuffle_tools") and t == b["shuffle_tools"]:
            tools = [START_RETURN, GET_ORDER, SEARCH_KB]
            expect.append("PS202")
        if b.get("shuffle_tools") and t == b["shuffle_tools"] + 1 and linked(t):
            expect.append("PS202")  # back to the usual order: it no longer extends the turn before
        if b.get("reordered_schema") and t == b["reordered_schema"] + 1 and linked(t):
            expect.append("PS203")
        if b.get("reordered_schema") and t == b["reordered_schema"]:
            tools = [GET_ORDER, {"type": "function", "function": {"name": "search_kb", "description": "Search the help-center articles.", "parameters": {"properties": {"query": {"type": "string"}, "limit": {"type": "integer", "minimum": 1, "maximum": 5}}, "type": "object", "required": ["query"]}}}, START_RETURN]
            expect.append("PS203")
        sent = history
        if b.get("window") and t == 2:
            sent = history[3:]  # prefixgate: noqa: PS305 (the planted sliding window of this corpus)
            if linked(t):  # the window still repeats the model's reply to the turn before
                expect.append("PS204")
        if b.get("reserialize") and t == 2:
            sent = [dict(m) for m in history]
            sent[1] = {**sent[1], "tool_calls": [{**sent[1]["tool_calls"][0], "function": {"name": "get_order", "arguments": json.dumps({"order_id": f"LK-10{n}"}, indent=1)}}]}
            if linked(t):
                expect.append("PS203")
        if b.get("reorder_results") and t == 2:
            sent = [*history[:-5], history[-4], history[-5], *history[-3:]]
        body: dict[str, Any] = {"model": "gpt-4o-mini", "messages": [{"role": "system", "content": sys_text}, *sent], "tools": tools, "tool_choice": "auto", **extra}
        if b.get("tool_choice") and t == b["tool_choice"]:
            body["tool_choice"] = {"type": "function", "function": {"name": "start_return"}}
            expect.append("PS205")
        if b.get("tool_choice") and t == b["tool_choice"] + 1 and linked(t):
            expect.append("PS205")
        if b.get("request_id_in_tools"):
            body["tools"] = [*tools[:2], {"type": "function", "function": {**START_RETURN["function"], "description": f"Open a return (trace {rng.getrandbits(64):016x})."}}]
            # The first turn differs from the application's usual tool in more than the value: a changed definition.
            expect.append("PS201" if t and linked(t) else "PS202")
        log.add(body, expect)
        if b.get("retry") and t == 1:
            log.add(body)  # the SDK retried after a timeout: the same request again


def extraction(log: Log, n: int, *, image: bool, breaks: dict[str, Any] | None = None) -> None:
    b = breaks or {}
    system = EXTRACT
    expect: list[str] = []
    if b.get("email"):
        system = f"Receipts of {b['email']}. " + EXTRACT
        if not b.get("first"):
            expect.append("PS206")
    content: Any = f"Receipt: Alpine Cafe, 2026-11-{10 + n % 18:02d}, total 23.{n % 90:02d} EUR"
    if image:
        content = [{"type": "text", "text": "Extract this receipt."},
                   {"type": "image_url", "image_url": {"url": f"https://files.example.com/receipts/{9000 + n}.jpg", "detail": "high"}}]
    body = {"model": "gpt-4o", "messages": [{"role": "system", "content": system}, {"role": "user", "content": content}],
            "response_format": RECEIPT_FORMAT, "temperature": 0, "user": f"acct_{700 + n % 5}"}
    log.add(body, expect)


def coding_session(log: Log, n: int, *, breaks: dict[str, Any] | None = None) -> None:
    """A developer-message agent loop without any conversation id: turns continue by extending the messages."""
    b = breaks or {}
    history: list[dict[str, Any]] = [{"role": "user", "content": f"The test test_parse_{n} fails with a KeyError, can you fix it?"}]
    for t in range(4):
        dev = CODER
        expect: list[str] = []
        if b.get("crlf") and t == 2:  # this turn's prompt file was read with Windows line endings
            dev = CODER.replace("\n", "\r\n")
            expect.append("PS206")
        if b.get("crlf") and t == 3:  # back to "\n": tied to the CRLF turn by its tool call, no longer its extension
            expect.append("PS206")
        log.add({"model": "gpt-4.1", "messages": [{"role": "developer", "content": dev}, *history], "tools": CODER_TOOLS, "parallel_tool_calls": True}, expect)
        history.append({"role": "assistant", "content": None, "tool_calls": [_call(f"call_{n}_{t}", "read_file", {"path": f"src/parse_{n}.py"})]})
        history.append({"role": "tool", "tool_call_id": f"call_{n}_{t}", "content": f"def parse(row):\n    return row['id_{t}']\n"})


def photo_chat(log: Log, n: int, *, resign: bool = False) -> None:
    """A conversation about a photo; with ``resign`` the app re-signs the photo's URL each turn
    (a fresh ``sig``/``exp``), so the same picture arrives as another image: PS207."""

    def photo(turn: int) -> dict[str, Any]:
        query = f"?exp={1_763_700_000 + 3600 * turn}&sig={log.rng.getrandbits(40):010x}" if resign else ""
        return {"type": "image_url", "image_url": {"url": f"https://cdn.example.com/p/{5000 + n}.jpg{query}"}}

    extra = {"metadata": {"conversation_id": f"photo_{n:04d}"}}
    first = [{"type": "text", "text": "What plant is this, and is it safe for cats?"}, photo(0)]
    later = [{"role": "assistant", "content": "It looks like a peace lily; it is toxic to cats."},
             {"role": "user", "content": "How often should I water it?"},
             {"role": "assistant", "content": "About once a week, when the top soil is dry."},
             {"role": "user", "content": "And does it need direct sun?"}]
    for t in range(3):
        content = first if t == 0 or not resign else [first[0], photo(t)]
        messages = [{"role": "user", "content": content}, *later[: 2 * t]]
        log.add({"model": "gpt-4o", "messages": messages, **extra}, ["PS207"] if resign and t else None)


def hi_chat(log: Log, n: int, extra: dict[str, Any] | None = None) -> None:
    """Unrelated chats that all open with a greeting, no ids: never one conversation."""
    opener = HI[n % len(HI)]
    first = [{"role": "system", "content": GENERAL}, {"role": "user", "content": opener}]
    log.add({"model": "gpt-4o-mini", "messages": first, **(extra or {})})
    reply = ["Hello! How can I help?", "Hi there, what do you need?", "Hey! What can I do for you?"][n % 3]
    follow = ["What is a good 3-day itinerary for Lisbon?", "Translate 'good morning' into Dutch.", "Explain what a mortgage is.", "Write a haiku about rain."][n % 4]
    log.add({"model": "gpt-4o-mini", "messages": [*first, {"role": "assistant", "content": reply}, {"role": "user", "content": follow}], **(extra or {})})


RECIPE_REPLY = ("A simple tomato soup: soften an onion and two garlic cloves in olive oil, add 800 g of "
                "tomatoes and 500 ml of stock, simmer 20 minutes, then blend and season.")


def edited_opener(log: Log, n: int, *, edit: bool) -> None:
    """A chat logged without any id whose app lets the user edit their first message after the
    model answered: the later turns repeat the model's reply verbatim (PS204 when edited)."""
    first = ["How do I make tomato soup?", "What is a quick tomato soup recipe?"][n % 2]
    opener = [{"role": "system", "content": GENERAL}, {"role": "user", "content": first}]
    log.add({"model": "gpt-4o-mini", "messages": opener, "temperature": 0})
    turn2 = [*opener, {"role": "assistant", "content": RECIPE_REPLY}, {"role": "user", "content": "Can I use canned tomatoes?"}]
    log.add({"model": "gpt-4o-mini", "messages": turn2, "temperature": 0})
    sent = [dict(m) for m in turn2]
    if edit:
        sent[1] = {"role": "user", "content": first + " It should be vegan."}
    turn3 = [*sent, {"role": "assistant", "content": "Yes: two 400 g cans work well."}, {"role": "user", "content": "And how long does it keep?"}]
    log.add({"model": "gpt-4o-mini", "messages": turn3, "temperature": 0}, ["PS204"] if edit else None)


def greeting_twins(log: Log, n: int) -> None:
    """Unrelated chats at temperature 0: the same system prompt, the same "hi", hence the same
    reply, then different questions and a third turn each. Never one conversation."""
    reply = "Hello! How can I help you today?"
    follow = ["Which is the longest river in Europe?", "Suggest a name for a grey cat.", "How many grams in a cup of flour?"][n % 3]
    turn2 = [{"role": "system", "content": GENERAL}, {"role": "user", "content": "hi"},
             {"role": "assistant", "content": reply}, {"role": "user", "content": follow}]
    log.add({"model": "gpt-4o-mini", "messages": turn2, "temperature": 0})
    log.add({"model": "gpt-4o-mini", "messages": [*turn2, {"role": "assistant", "content": f"Answer {n}."},
                                                  {"role": "user", "content": "Thanks!"}], "temperature": 0})


def clean() -> Log:
    log = Log(11)
    for n in range(12):
        support_chat(log, n, ids=("metadata", "cache_key", "none")[n % 3], breaks={"retry": n == 4})
        extraction(log, n, image=n % 2 == 0)
        if n % 2 == 0:
            coding_session(log, n)
        hi_chat(log, n)
    for n in range(16, 20):
        support_chat(log, n, ids="none", breaks={"reorder_results": True})  # consistent within each chat
    # One prompt_cache_key for the whole application, as OpenAI's cache routing suggests: not a conversation.
    for n in range(20, 28):
        hi_chat(log, n, {"prompt_cache_key": "general-assistant-v2"})
    for n in range(3):
        photo_chat(log, n)
    for n in range(6):  # interleaved: every chat's first two turns, then every chat's third
        greeting_twins(log, n)
    for n in range(4):
        edited_opener(log, n, edit=False)
    return log


def clean_trailing_space() -> Log:
    """Another application whose system prompt ends, identically in every request, with a trailing space."""
    log = Log(17)
    for n in range(12, 18):
        support_chat(log, n, system=SUPPORT + " ", ids=("metadata", "none")[n % 2])
    return log


def breaks() -> Log:
    log = Log(23)
    plans = [
        {"timestamp": True}, {"counter": True}, {"shuffle_tools": 1}, {"reordered_schema": 2}, {"window": True},
        {"tool_choice": 2}, {"reserialize": True}, {"request_id_in_tools": True}, {}, {"timestamp": True},
        {"shuffle_tools": 2}, {"window": True}, {"tool_choice": 1}, {}, {"reserialize": True},
    ]
    for n, plan in enumerate(plans * 2):
        support_chat(log, 100 + n, system=SUPPORT, ids=("metadata", "cache_key", "none")[n // len(plans) + n % 2], breaks=plan)
        hi_chat(log, n)
        extraction(log, n, image=n % 3 == 0, breaks={"email": f"billing+{n}@larkspur.example", "first": n == 1} if n % 4 == 1 else None)
        if n % 3 == 0:
            coding_session(log, 100 + n, breaks={"crlf": n in (3, 9)})
    for n in range(4):
        photo_chat(log, 10 + n, resign=n % 2 == 0)
    for n in range(4):
        edited_opener(log, 20 + n, edit=n % 2 == 0)
        greeting_twins(log, 20 + n)
    return log


def main() -> None:
    HERE.mkdir(parents=True, exist_ok=True)
    (HERE / "clean.jsonl").write_text("".join(clean().lines), encoding="utf-8")
    (HERE / "clean_trailing_space.jsonl").write_text("".join(clean_trailing_space().lines), encoding="utf-8")
    (HERE / "breaks.jsonl").write_text("".join(breaks().lines), encoding="utf-8")


if __name__ == "__main__":
    main()
