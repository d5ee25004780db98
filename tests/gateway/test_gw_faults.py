"""Fault injection: upstream 500s, timeouts, refused connections, invalid JSON, a
stream cut in the middle, and a client that disconnects mid-stream."""

from __future__ import annotations

import asyncio
import threading
import time

import httpx
import orjson
import pytest
from gw_fakes import FakeUpstream, gateway_client, make_settings, rows, serve_in_thread
from support.sse import sse_events

from gateway.server.app import create_app

CHAT = {"model": "fake-model", "messages": [{"role": "user", "content": "hi"}]}


def call(tmp_path, transport, body=CHAT):
    async def go():
        settings = make_settings(tmp_path)
        async with gateway_client(settings, transport) as gw:
            return settings, await gw.post("/v1/chat/completions", json=body)

    return asyncio.run(go())


def raising(exc: Exception) -> httpx.MockTransport:
    def handler(request: httpx.Request) -> httpx.Response:
        raise exc

    return httpx.MockTransport(handler)


@pytest.mark.parametrize(
    ("exc", "status", "code"),
    [
        (httpx.ConnectError("refused"), 503, "upstream_unavailable"),
        (httpx.ConnectTimeout("slow connect"), 503, "upstream_unavailable"),
        (httpx.ReadTimeout("slow read"), 504, "upstream_timeout"),
        (httpx.RemoteProtocolError("peer closed"), 502, "upstream_error"),
    ],
)
@pytest.mark.parametrize("stream", [False, True])
def test_transport_failures_map_to_5xx(tmp_path, exc, status, code, stream):
    settings, response = call(tmp_path, raising(exc), {**CHAT, "stream": stream})
    assert response.status_code == status
    assert response.json()["error"]["code"] == code
    (row,) = rows(settings.db_url)
    assert (row.status, row.error_code, row.tenant) == (status, code, "anonymous")


@pytest.mark.parametrize("stream", [False, True])
def test_upstream_500_becomes_502(tmp_path, fake_upstream, stream):
    fake_upstream.mode = "error500"
    settings, response = call(tmp_path, httpx.ASGITransport(fake_upstream.app), {**CHAT, "stream": stream})
    assert response.status_code == 502
    assert "HTTP 500" in response.json()["error"]["message"]
    assert rows(settings.db_url)[0].status == 502


def test_upstream_invalid_json_becomes_502(tmp_path, fake_upstream):
    fake_upstream.mode = "invalid_json"
    settings, response = call(tmp_path, httpx.ASGITransport(fake_upstream.app))
    assert response.status_code == 502
    assert rows(settings.db_url)[0].error_code == "upstream_error"
    assert "invalid JSON" in response.json()["error"]["message"]


def test_upstream_connection_refused_on_real_loopback(tmp_path):
    from support.net import free_port

    port = free_port()  # nothing listens there
    settings, response = call(tmp_path, httpx.AsyncHTTPTransport())
    assert response.status_code in (502, 503)
    settings = make_settings(tmp_path / "b", upstream=f"http://127.0.0.1:{port}")

    async def go():
        async with gateway_client(settings, httpx.AsyncHTTPTransport()) as gw:
            return await gw.post("/v1/chat/completions", json=CHAT)

    assert asyncio.run(go()).status_code == 503


class CutStream(httpx.AsyncByteStream):
    async def __aiter__(self):
        chunk = {"choices": [{"index": 0, "delta": {"content": "par"}, "finish_reason": None}]}
        yield b"data: " + orjson.dumps(chunk) + b"\n\n"
        raise httpx.RemoteProtocolError("peer closed connection without sending complete message body")


def test_upstream_disconnect_mid_stream_ends_with_an_error_event(tmp_path):
    transport = httpx.MockTransport(lambda request: httpx.Response(200, stream=CutStream()))
    settings, response = call(tmp_path, transport, {**CHAT, "stream": True})
    assert response.status_code == 200  # headers were already sent
    events = sse_events(response.text)
    assert orjson.loads(events[0][6:])["choices"][0]["delta"]["content"] == "par"
    error = orjson.loads(events[-2][6:])["error"]
    assert error["code"] == "upstream_error" and "RemoteProtocolError" in error["message"]
    assert events[-1] == "data: [DONE]"  # after the error, as the engine and vLLM end a failed stream
    (row,) = rows(settings.db_url)
    assert (row.status, row.error_code) == (502, "upstream_error")


def test_stream_without_done_is_an_upstream_error(tmp_path):
    class Short(httpx.AsyncByteStream):
        async def __aiter__(self):
            yield b'data: {"choices": []}\n\n'

    settings, response = call(tmp_path, httpx.MockTransport(lambda r: httpx.Response(200, stream=Short())),
                              {**CHAT, "stream": True})
    assert "ended before" in response.text
    assert rows(settings.db_url)[0].status == 502


GOOD = b'data: {"object": "chat.completion.chunk", "choices": [{"index": 0, "delta": {"content": "par"}}]}\n\n'


@pytest.mark.parametrize(
    ("bad", "says"),
    [
        (b"data: {not json\n\n", "not JSON"),
        (b"data: [1, 2]\n\n", "not a JSON object"),
        (b'data: {"error": {"message": "engine fell over", "type": "server_error"}}\n\n', "engine fell over"),
        (b"data: " + b"x" * (9 * 1024 * 1024), "over"),  # an event that never ends
    ],
    ids=["not-json", "not-object", "error-event", "endless-event"],
)
def test_malformed_upstream_event_ends_the_stream_with_an_error_event_and_a_502_row(tmp_path, bad, says):
    class Malformed(httpx.AsyncByteStream):
        async def __aiter__(self):
            yield GOOD + bad
            yield GOOD  # never relayed: the stream ended at the bad event
            yield b"data: [DONE]\n\n"

    settings, response = call(tmp_path, httpx.MockTransport(lambda r: httpx.Response(200, stream=Malformed())),
                              {**CHAT, "stream": True})
    assert response.status_code == 200  # headers were already sent
    events = sse_events(response.text)
    assert len(events) == 3 and orjson.loads(events[0][6:])["choices"][0]["delta"]["content"] == "par"
    assert events[2] == "data: [DONE]"
    body = orjson.loads(events[1][6:])
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    assert body["error"]["code"] == "upstream_error" and says in body["error"]["message"]
    (row,) = rows(settings.db_url)
    assert (row.status, row.error_code) == (502, "upstream_error")


def wait_for(condition, timeout=30.0):
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.02)


def test_client_disconnect_mid_stream_cancels_upstream(tmp_path):
    """Real HTTP on loopback: fake upstream and gateway each under uvicorn."""
    upstream = FakeUpstream()
    upstream.mode = "endless"
    with serve_in_thread(upstream.app) as upstream_url:
        settings = make_settings(tmp_path, upstream=upstream_url)
        app = create_app(settings)
        with serve_in_thread(app) as gateway_url:
            with httpx.Client(timeout=30) as client, client.stream(
                "POST", gateway_url + "/v1/chat/completions", json={**CHAT, "stream": True}
            ) as response:
                assert response.status_code == 200
                for line in response.iter_lines():
                    if line.startswith("data:"):
                        break  # got a first chunk: now hang up
            wait_for(upstream.stream_cancelled.is_set)
        # the gateway shut down gracefully: its row is in the database
    (row,) = rows(settings.db_url)
    assert (row.status, row.error_code, row.stream) == (499, "client_disconnected", True)


def test_client_disconnect_before_upstream_answers(tmp_path):
    """A non-streaming request whose upstream hangs: the client leaves, the upstream call is cancelled."""
    cancelled = threading.Event()

    async def upstream_app(scope, receive, send):
        """Never answers; notices when the gateway drops the connection."""
        if scope["type"] != "http":
            return
        while (await receive())["type"] != "http.disconnect":
            pass
        cancelled.set()

    with serve_in_thread(upstream_app) as upstream_url:
        settings = make_settings(tmp_path, upstream=upstream_url)
        with serve_in_thread(create_app(settings)) as gateway_url:
            errors = []

            def client_call():
                try:
                    httpx.post(gateway_url + "/v1/chat/completions", json=CHAT, timeout=httpx.Timeout(30, read=1.0))
                except httpx.ReadTimeout as exc:
                    errors.append(exc)

            thread = threading.Thread(target=client_call)
            thread.start()
            thread.join(60)
            assert errors, "the client should have given up"
            wait_for(cancelled.is_set)
    (row,) = rows(settings.db_url)
    assert (row.status, row.error_code) == (499, "client_disconnected")


def test_a_responses_stream_ending_in_an_error_event_gets_nothing_appended(tmp_path):
    def sse(kind, seq, **fields):
        return (b"event: " + kind.encode() + b"\ndata: "
                + orjson.dumps({"type": kind, "sequence_number": seq, **fields}) + b"\n\n")

    class Failing(httpx.AsyncByteStream):
        async def __aiter__(self):
            yield sse("response.created", 0, response={"id": "resp_1", "status": "in_progress"})
            yield sse("error", 1, code="invalid_schema", message="grammar failed", param="text.format")

    async def go():
        settings = make_settings(tmp_path)
        transport = httpx.MockTransport(lambda r: httpx.Response(200, stream=Failing()))
        async with gateway_client(settings, transport) as gw:
            body = {"model": "fake-model", "input": "hi", "stream": True}
            return settings, await gw.post("/v1/responses", json=body)

    settings, response = asyncio.run(go())
    events = sse_events(response.text)
    assert len(events) == 2 and events[-1].startswith("event: error\n")
    assert orjson.loads(events[-1].split("data: ", 1)[1])["code"] == "invalid_schema"
    assert '"error":' not in response.text and "[DONE]" not in response.text
    (row,) = rows(settings.db_url)
    assert (row.status, row.error_code) == (400, "invalid_schema")


def test_a_responses_stream_cut_short_ends_with_a_responses_error_event(tmp_path):
    class Cut(httpx.AsyncByteStream):
        async def __aiter__(self):
            yield b'event: response.created\ndata: {"type": "response.created", "sequence_number": 0}\n\n'

    async def go():
        settings = make_settings(tmp_path)
        transport = httpx.MockTransport(lambda r: httpx.Response(200, stream=Cut()))
        async with gateway_client(settings, transport) as gw:
            body = {"model": "fake-model", "input": "hi", "stream": True}
            return settings, await gw.post("/v1/responses", json=body)

    settings, response = asyncio.run(go())
    events = sse_events(response.text)
    assert len(events) == 2 and events[-1].startswith("event: error\n")
    payload = orjson.loads(events[-1].split("data: ", 1)[1])
    assert payload["type"] == "error" and payload["sequence_number"] == 1
    assert payload["code"] == "upstream_error" and "[DONE]" not in response.text
    assert rows(settings.db_url)[0].status == 502
