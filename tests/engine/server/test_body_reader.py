"""BodyReader, the one bounded body reader of both servers: content type, size, read
timeouts and the bytes of bodies in flight per tenant and overall (in process, ASGI
messages fed by hand; the servers' HTTP tests cover the same refusals on the wire)."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from starlette.requests import Request

from engine.contract.body_reader import BodyLimits, BodyReader, require_json
from engine.contract.errors import APIError


def make_request(chunks: list[bytes], *, content_type: str | None = "application/json",
                 declared: int | None = None, then: str = "end") -> Request:
    """A request whose body arrives as ``chunks``; ``then`` says what follows the last one:
    "end", "stall" (no more message, ever) or "disconnect"."""
    headers = [] if content_type is None else [(b"content-type", content_type.encode())]
    if declared is not None:
        headers.append((b"content-length", str(declared).encode()))
    pending = list(chunks)

    async def receive() -> dict[str, Any]:
        if pending:
            chunk = pending.pop(0)
            return {"type": "http.request", "body": chunk, "more_body": bool(pending) or then != "end"}
        if then == "disconnect":
            return {"type": "http.disconnect"}
        await asyncio.Event().wait()  # stalled: cancelled by the reader's timeout
        raise AssertionError("unreachable")

    scope = {"type": "http", "method": "POST", "path": "/v1/chat/completions", "headers": headers}
    return Request(scope, receive)


def refused(reader: BodyReader, request: Request, tenant: str = "t") -> APIError:
    async def go() -> APIError:
        with reader.lease(tenant) as lease, pytest.raises(APIError) as caught:
            await reader.read(request, lease)
        reader.check_integrity()
        assert reader.in_flight == 0 and not reader.by_tenant
        return caught.value

    return asyncio.run(go())


@pytest.mark.parametrize("content_type", [
    "application/json", "application/json; charset=utf-8", "Application/JSON;charset=UTF-8", " application/json ",
])
def test_json_content_types_are_accepted(content_type):
    reader = BodyReader()

    async def go() -> bytes:
        with reader.lease("t") as lease:
            return await reader.read(make_request([b'{"a":', b" 1}"], content_type=content_type), lease)

    assert asyncio.run(go()) == b'{"a": 1}'


@pytest.mark.parametrize("content_type", [
    None, "", "text/plain", "text/plain; charset=utf-8", "application/x-www-form-urlencoded",
    "multipart/form-data; boundary=x", "application/jsonx", "application/json-patch+json", "*/*",
])
def test_other_content_types_are_415_before_reading(content_type):
    error = refused(BodyReader(), make_request([b"{}"], content_type=content_type, then="stall"))
    assert (error.status_code, error.code, error.type) == (415, "unsupported_media_type", "invalid_request_error")
    assert "application/json" in error.message


def test_a_declared_or_sent_body_past_max_bytes_is_413():
    reader = BodyReader(BodyLimits(max_bytes=10))
    assert refused(reader, make_request([], declared=11, then="stall")).status_code == 413
    assert refused(reader, make_request([b"12345", b"678901"])).code == "request_too_large"  # chunked
    assert refused(reader, make_request([b"12345678901"], declared=3)).status_code == 413  # lying length


def test_a_stalled_upload_is_408_after_the_idle_timeout():
    reader = BodyReader(BodyLimits(idle_timeout_s=0.05, timeout_s=30))
    error = refused(reader, make_request([b'{"a":'], declared=100, then="stall"))
    assert (error.status_code, error.code) == (408, "body_timeout")
    assert "no byte for 0.05 s" in error.message


def test_a_drip_fed_upload_is_408_after_the_total_timeout():
    reader = BodyReader(BodyLimits(idle_timeout_s=30, timeout_s=0.2))
    drip = [b" "] * 10_000  # each chunk arrives at once, but the reader yields to the loop between them

    async def slow_receive_request() -> Request:
        request = make_request(drip, then="stall")
        inner = request.receive

        async def receive() -> dict[str, Any]:
            await asyncio.sleep(0.01)  # the client's pace, not synchronisation
            return await inner()

        return Request(request.scope, receive)

    error = refused(reader, asyncio.run(slow_receive_request()))
    assert (error.status_code, error.code) == (408, "body_timeout")
    assert "over 0.2 s" in error.message


def test_a_client_leaving_mid_body_is_client_disconnected():
    error = refused(BodyReader(), make_request([b'{"a":'], then="disconnect"))
    assert (error.status_code, error.code) == (400, "client_disconnected")


def test_the_budget_is_per_tenant_then_overall_and_released_with_the_lease():
    reader = BodyReader(BodyLimits(max_bytes=100, tenant_inflight_bytes=150, inflight_bytes=250))

    async def go() -> None:
        a1, a2, b1, c1 = reader.lease("a"), reader.lease("a"), reader.lease("b"), reader.lease("c")
        await reader.read(make_request([b"x" * 100], declared=100), a1)
        await reader.read(make_request([b"x" * 40]), a2)  # no content-length: charged as it arrives
        assert (reader.in_flight, reader.by_tenant["a"]) == (140, 140)
        reader.check_integrity()
        with pytest.raises(APIError) as tenant_full:  # a's 140 + 20 > 150
            await reader.read(make_request([b"x" * 20], declared=20), reader.lease("a"))
        assert (tenant_full.value.status_code, tenant_full.value.code) == (429, "body_budget_exceeded")
        assert tenant_full.value.type == "rate_limit_error"
        await reader.read(make_request([b"x" * 100], declared=100), b1)  # another tenant still fits
        with pytest.raises(APIError) as server_full:  # 240 + 20 > 250
            await reader.read(make_request([b"x" * 20], declared=20), c1)
        assert (server_full.value.status_code, server_full.value.code) == (503, "server_overloaded")
        assert server_full.value.type == "server_error"
        reader.check_integrity()
        a1.release()
        a1.release()  # idempotent
        await reader.read(make_request([b"x" * 20], declared=20), c1)  # room again
        assert (reader.in_flight, dict(reader.by_tenant)) == (160, {"a": 40, "b": 100, "c": 20})
        reader.check_integrity()
        for lease in (a2, b1, c1):
            lease.release()
        assert reader.in_flight == 0 and not reader.by_tenant
        reader.check_integrity()

    asyncio.run(go())


def test_a_stalled_upload_holds_its_declared_size_until_released():
    reader = BodyReader(BodyLimits(tenant_inflight_bytes=1000, idle_timeout_s=0.05))

    async def go() -> None:
        with reader.lease("a") as stalled:
            task = asyncio.ensure_future(reader.read(make_request([b"{"], declared=900, then="stall"), stalled))
            await asyncio.sleep(0)  # let it start reading
            assert reader.in_flight == 900
            with pytest.raises(APIError) as full:
                await reader.read(make_request([b"x" * 200], declared=200), reader.lease("a"))
            assert full.value.status_code == 429
            with pytest.raises(APIError) as timed_out:
                await task
            assert timed_out.value.status_code == 408
        assert reader.in_flight == 0
        reader.check_integrity()

    asyncio.run(go())


@pytest.mark.parametrize("field", ["max_bytes", "inflight_bytes", "tenant_inflight_bytes", "timeout_s",
                                   "idle_timeout_s"])
@pytest.mark.parametrize("value", [0, -1, True, "8"])
def test_limits_must_be_positive_numbers(field, value):
    with pytest.raises(ValueError, match=field):
        BodyLimits(**{field: value})


def test_require_json_names_what_it_got():
    with pytest.raises(APIError, match="got 'text/plain'"):
        require_json("text/plain")
    with pytest.raises(APIError, match="got none"):
        require_json(None)


def test_the_heap_is_trimmed_once_large_bodies_are_gone(monkeypatch):
    """After >= TRIM_AFTER_BYTES were released and nothing is in flight, the C heap is
    trimmed once on a worker thread; not while another body is still held."""
    import threading

    from engine.contract import body_reader

    trimmed = threading.Event()
    calls: list[int] = []

    def fake_trim() -> bool:
        calls.append(1)
        trimmed.set()
        return True

    monkeypatch.setattr(body_reader, "trim_heap", fake_trim)
    monkeypatch.setattr(body_reader, "TRIM_DELAY_S", 0.0)
    big = body_reader.TRIM_AFTER_BYTES

    async def go() -> None:
        loop = asyncio.get_running_loop()
        reader = BodyReader(BodyLimits(max_bytes=big, inflight_bytes=4 * big, tenant_inflight_bytes=4 * big))
        small = reader.lease("a")
        small.take(10)
        small.release()
        assert reader._trim is None  # too few bytes released
        first, second = reader.lease("a"), reader.lease("b")
        first.take(big)
        second.take(1)
        first.release()
        assert reader._trim is None  # a body is still in flight
        second.release()
        assert reader._trim is not None
        reader.check_integrity()
        assert await loop.run_in_executor(None, trimmed.wait, 30)
        assert calls == [1] and reader._trim is None and reader._released == 0
        again = reader.lease("a")
        again.take(big)
        again.release()
        handle = reader._trim
        assert handle is not None
        handle.cancel()
        late = reader.lease("b")
        late.take(1)
        reader._trim_if_idle(loop)  # the timer fires while a new body is held: no trim
        assert calls == [1] and reader._released >= big
        late.release()

    asyncio.run(go())
