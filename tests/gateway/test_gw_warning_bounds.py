"""How prefix checks run: off the event loop, within a budget, with bounded output, and
with a conversation history shared between processes."""

from __future__ import annotations

import asyncio
import time

import orjson

from gateway.policy.lint_check import PrefixWarning, bound_warnings
from gateway.policy.prefix_warner import BUDGET_CODE, PrefixWarner
from gateway.policy.shared_history import HistoryClient, HistoryServer
from linter.api import conversation_keys

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


def ps2(warnings: list[PrefixWarning]) -> list[str]:
    return [w.code for w in warnings if w.code.startswith("PS2")]


def test_history_shared_through_the_server_compares_turns_across_clients():
    system = {"role": "system", "content": "You answer questions about invoices."}
    turn1 = {"model": "m", "messages": [system, {"role": "user", "content": "My balance?"}]}
    turn2 = {"model": "m", "messages": [
        {"role": "system", "content": "You answer questions about invoices!"},
        {"role": "user", "content": "My balance?"}, {"role": "assistant", "content": "12"},
        {"role": "user", "content": "And last month?"}]}
    thread = "invoices-1"  # an edited system prompt only shows as a break within a named conversation
    server = HistoryServer(PrefixWarner()).start()

    async def go() -> None:
        # two workers' warners (one checks on its event loop, one on its threads), one history
        first = PrefixWarner(history=HistoryClient(server.path))
        second = PrefixWarner(history=HistoryClient(server.path), loop_max_bytes=0)
        try:
            assert not ps2(await first.check_within_budget("t", turn1, turn1, body_size=100,
                                                           conversation_header=thread))
            assert ps2(await second.check_within_budget("t", turn2, turn2, body_size=100,
                                                        conversation_header=thread))
            # another tenant never sees this conversation
            assert not ps2(await second.check_within_budget("u", turn2, turn2, body_size=100,
                                                            conversation_header=thread))
            # back on the first worker: the second's turn is the one compared
            turn3 = {**turn2, "messages": [*turn2["messages"][:1], {"role": "user", "content": "Hm?"}]}
            assert ps2(await first.check_within_budget("t", turn3, turn3, body_size=100,
                                                       conversation_header=thread))
        finally:
            first.close()
            second.close()

    try:
        asyncio.run(go())
    finally:
        server.close()

    async def alone() -> None:  # server gone: checked alone, logged, no failure
        lonely = PrefixWarner(history=HistoryClient(server.path))
        assert not ps2(await lonely.check_within_budget("t", turn2, turn2, body_size=100,
                                                         conversation_header=thread))
        warnings = await lonely.check_within_budget("t", turn2, turn2, body_size=100)
        assert warnings == lonely.check("t", turn2, turn2, body_size=100)  # the same per-request findings
        lonely.close()
    asyncio.run(alone())


def test_pipelined_exchanges_get_their_own_replies_in_order():
    """Many checks of one worker in flight on one connection, some given up by their
    requests (their replies must still be read and dropped, not handed to the next)."""
    server = HistoryServer(PrefixWarner()).start()

    def turn(n: int) -> dict:
        return {"model": "m", "messages": [{"role": "user", "content": f"question {n}"}]}

    async def go() -> None:
        client = HistoryClient(server.path)
        keys = [conversation_keys(turn(n), f"c{n}") for n in range(40)]
        assert all(k is not None for k in keys)
        await asyncio.gather(*(client.exchange("t", k, turn(n), 100) for n, k in enumerate(keys) if k))
        abandoned = [asyncio.ensure_future(client.exchange("t", k, turn(n), 100))
                     for n, k in enumerate(keys) if k and n % 3 == 0]
        await asyncio.sleep(0)  # written to the socket
        for future in abandoned:
            future.cancel()
        replies = await asyncio.gather(*(client.exchange("t", k, turn(n + 100), 100)
                                         for n, k in enumerate(keys) if k and n % 3))
        assert replies == [turn(n) for n in range(40) if n % 3]
        # once connected, start() has handed the request to the socket when it returns
        # (the round trip runs while the proxy sends the request upstream)
        pending = client.start("t", keys[1], turn(200), 100)
        connection = client._connection
        assert connection is not None and connection.transport is not None
        assert connection.transport.get_write_buffer_size() == 0 and not pending.done()
        assert await pending == turn(101)
        assert await client.exchange("t", keys[1], turn(201), 100) == turn(200)
        client.close()

    try:
        asyncio.run(go())
    finally:
        server.close()


def test_a_stalled_history_server_costs_a_request_its_budget_not_more():
    """A server that accepts but never answers: the check gives up at its budget."""
    import socket
    import tempfile
    from pathlib import Path

    with tempfile.TemporaryDirectory() as directory:
        path = str(Path(directory) / "stalled.sock")
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        listener.bind(path)
        listener.listen(4)
        body = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}

        async def go() -> list[PrefixWarning]:
            warner = PrefixWarner(history=HistoryClient(path), budget_s=0.3)
            try:
                return await warner.check_within_budget("t", body, body, body_size=50, conversation_header="x")
            finally:
                warner.close()

        started = time.monotonic()
        try:
            warnings = asyncio.run(go())
        finally:
            listener.close()
        assert [w.code for w in warnings] == [BUDGET_CODE]
        assert time.monotonic() - started < 5.0


def test_the_budget_counts_from_the_send_not_from_the_history_exchange():
    """The proxy starts the check (history exchange) before the upstream call and lets the
    linter go once the request is on the wire: a slow send does not eat the budget."""
    body = dated_body(1024)

    async def go() -> list[PrefixWarning]:
        warner = PrefixWarner(budget_s=0.3)
        sent: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        asyncio.get_running_loop().call_later(0.5, sent.set_result, None)  # a slow connect upstream
        started = time.monotonic()
        found = await warner.check_within_budget("t", body, body, body_size=1024, lint_after=sent)
        assert time.monotonic() - started >= 0.5
        warner.close()
        return found

    warnings = asyncio.run(go())
    assert warnings and BUDGET_CODE not in [w.code for w in warnings] and warnings[0].code == "PS101"


def blank_png_url(side: int, seed: int) -> str:
    """A ``side``x``side`` 1-bit PNG of zeros but one pixel (~600 bytes for 2048x2048)."""
    import base64
    import io

    from PIL import Image

    image = Image.new("1", (side, side), 0)
    image.putpixel((seed % side, seed // side), 1)
    out = io.BytesIO()
    image.save(out, format="PNG", optimize=True)
    return "data:image/png;base64," + base64.b64encode(out.getvalue()).decode()


def nine_image_turns(count: int) -> list[dict]:
    """``count`` turns of one conversation whose first message carries nine 2048x2048 images."""
    parts = [{"type": "image_url", "image_url": {"url": blank_png_url(2048, seed)}} for seed in range(9)]
    messages: list[dict] = [{"role": "user", "content": [{"type": "text", "text": "Compare."}, *parts]}]
    turns = []
    for n in range(count):
        turns.append({"model": "m", "messages": list(messages)})
        messages += [{"role": "assistant", "content": f"Answer {n}."}, {"role": "user", "content": "Sure?"}]
    return turns


def test_pixel_rate_refills_per_second_and_caps_each_request():
    from gateway.policy.pixel_rate import PixelRate

    now = [0.0]
    rate = PixelRate(per_request=100, per_second=300, clock=lambda: now[0])
    assert rate.allowance("a") == 100
    rate.charge("a", 100)
    rate.charge("a", 150)
    assert rate.allowance("a") == 50 and rate.allowance("b") == 100  # tenants apart
    rate.charge("a", 500)
    assert rate.allowance("a") == 0
    now[0] = 0.2
    assert rate.allowance("a") == 60
    now[0] = 60.0
    rate.charge("a", 250)
    assert rate.allowance("a") == 50  # refilled to one second's worth (300), not 60 seconds'


def test_images_are_decoded_in_the_helper_within_the_tenants_pixel_rate(monkeypatch):
    """Nine 2048x2048 images in an 8 KiB body: never decoded in the gateway's process (on
    the event loop or a thread, the GIL would stall every request), at most the tenant's
    pixels per request and per second, each image once, and the turns still compared
    correctly (the same images: no PS207), however many were decoded."""
    import linter.image_parts as image_parts
    from gateway.policy.pixel_rate import PixelRate

    turns = nine_image_turns(4)
    size = len(orjson.dumps(turns[-1]))
    assert size <= 8 * 1024

    def not_here(data: bytes, max_pixels: int):
        raise AssertionError("an image was decoded in the gateway's process")

    monkeypatch.setattr(image_parts, "image_identity", not_here)
    now = [0.0]
    one = 2048 * 2048
    rate = PixelRate(per_request=2 * one, per_second=3 * one, clock=lambda: now[0])
    charged: list[int] = []
    real_charge = rate.charge
    monkeypatch.setattr(rate, "charge", lambda tenant, pixels: (charged.append(pixels), real_charge(tenant, pixels)))
    warner = PrefixWarner(pixels=rate, budget_s=60.0)

    async def go() -> None:
        for n, body in enumerate(turns):
            if n == 3:
                now[0] += 10.0
            found = await warner.check_within_budget("noisy", body, body, body_size=size, conversation_header="c")
            assert not [w for w in found if w.code.startswith("PS2") or w.code == BUDGET_CODE], found

    try:
        asyncio.run(go())
    finally:
        warner.close()
    # The first turn names no image; the second decodes its cap (2 images), the third what
    # is left of the tenant's second (3 - 2), the fourth, a second later, its cap again:
    # the helper remembers the images it decoded, so each is decoded once.
    assert charged == [0, 2 * one, 1 * one, 2 * one]
