"""How prefix checks run: off the event loop, within a budget, with bounded output, and
with a conversation history shared between processes."""

from __future__ import annotations

import asyncio
import time

from gateway.prefix_warner import BUDGET_CODE, PrefixWarner, PrefixWarning, bound_warnings
from gateway.shared_history import HistoryClient, HistoryServer

DATES = "Meeting on 2026-11-23 at 10:42:17, next on 2026-11-24. "


def dated_body(size: int) -> dict:
    return {"model": "m", "messages": [{"role": "system", "content": DATES * (size // len(DATES))},
                                       {"role": "user", "content": "hi"}]}


def test_bound_warnings_keeps_the_first_and_summarises_the_rest_per_code():
    many = [PrefixWarning("PS101", "warning", f"date {i}", f"messages[0].content[{i}]") for i in range(500)]
    many += [PrefixWarning("PS104", "info", "keys", "tools[0]")] * 3
    bounded = bound_warnings(many, max_warnings=10, max_bytes=1 << 20)
    assert bounded[:10] == many[:10]
    assert [(w.code, w.message.split()[0]) for w in bounded[10:]] == [("PS101", "490"), ("PS104", "3")]
    small = bound_warnings(many, max_warnings=1000, max_bytes=2000)
    assert sum(len(w.message) + len(w.location) + 64 for w in small[:-2]) <= 2000
    assert bound_warnings(many[:3], 10, 1 << 20) == many[:3]


def test_a_dense_request_gets_bounded_warnings():
    warner = PrefixWarner(max_warnings=8, inline_max_bytes=1 << 30, budget_s=60)
    body = dated_body(8 * 1024)
    warnings = warner.check("t", body, body, body_size=8 * 1024)
    listed = [w for w in warnings if "more" not in w.message]
    assert len(listed) == 8 and {w.code for w in listed} == {"PS101"}
    assert any(w.code == "PS101" and "more PS101 findings not listed" in w.message for w in warnings)


def test_large_bodies_are_checked_in_a_helper_process_stopped_at_the_budget():
    async def go() -> None:
        warner = PrefixWarner(inline_max_bytes=16 * 1024, budget_s=60.0)
        quick = dated_body(20 * 1024)
        found = await warner.check_within_budget("t", quick, quick, body_size=20 * 1024)
        assert found and found[0].code == "PS101"  # checked in the helper process
        process = warner._lint_process
        assert process is not None and process.cut_short == 0
        pid = process._process.pid

        warner.budget_s = 0.5
        big = dated_body(4 * 1024 * 1024)  # seconds of linter work
        ticks = 0

        async def ticker() -> None:  # the event loop keeps running meanwhile
            nonlocal ticks
            while True:
                await asyncio.sleep(0.01)
                ticks += 1

        task = asyncio.ensure_future(ticker())
        started = time.monotonic()
        warnings = await warner.check_within_budget("t", big, big, body_size=4 * 1024 * 1024)
        elapsed = time.monotonic() - started
        task.cancel()
        assert [w.code for w in warnings] == [BUDGET_CODE]
        assert elapsed < 5.0 and ticks >= 10
        # the check was stopped, not the process: it answers the next large body
        again = process.check(quick, None, quick, 60.0)  # waits for the big check's lock
        assert process.cut_short == 1
        assert again and again[0]["code"] == "PS101"
        assert process._process.pid == pid
        warner.close()
    asyncio.run(go())


def test_history_shared_through_the_server_compares_turns_across_clients():
    server = HistoryServer(PrefixWarner()).start()
    try:
        first, second = PrefixWarner(history=HistoryClient(server.path)), PrefixWarner(history=HistoryClient(server.path))
        system = {"role": "system", "content": "You answer questions about invoices."}
        turn1 = {"model": "m", "messages": [system, {"role": "user", "content": "My balance?"}]}
        turn2 = {"model": "m", "messages": [
            {"role": "system", "content": "You answer questions about invoices!"},
            {"role": "user", "content": "My balance?"}, {"role": "assistant", "content": "12"},
            {"role": "user", "content": "And last month?"}]}
        # an edited system prompt only shows as a break within an explicitly named conversation
        thread = "invoices-1"
        assert not [w for w in first.check("t", turn1, turn1, body_size=100, conversation_header=thread)
                    if w.code.startswith("PS2")]
        codes = [w.code for w in second.check("t", turn2, turn2, body_size=100, conversation_header=thread)]
        assert any(code.startswith("PS2") for code in codes), codes
        # another tenant never sees this conversation
        other = [w.code for w in second.check("u", turn2, turn2, body_size=100, conversation_header=thread)]
        assert not any(code.startswith("PS2") for code in other)
    finally:
        server.close()
    lonely = PrefixWarner(history=HistoryClient(server.path))  # server gone: checked alone, no failure
    assert not [w for w in lonely.check("t", turn2, turn2, body_size=100) if w.code.startswith("PS2")]
