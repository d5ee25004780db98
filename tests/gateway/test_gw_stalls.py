"""Stuck upstreams, over real HTTP on loopback: a replica that sends nothing and misses its
health probe ends the requests waiting on it with a 504 (an error event in a stream) and
leaves the pool; a replica that is only slow keeps its requests; the total timeout ends a
request that trickles forever. Fault injection: a socket that never answers (as a
SIGSTOPped process), and a small Starlette upstream that stalls on demand.
The real SIGSTOP of an engine under `serve --replicas 2` is in test_gw_stalls_e2e.py."""

from __future__ import annotations

import asyncio
import dataclasses
import socket
import time

import httpx
import orjson
import pytest
from gw_fakes import FakeUpstream, make_settings, rows, serve_in_thread
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route
from support.sse import sse_events

from gateway.config.replica_spec import ReplicaSpec, RoutingOptions
from gateway.server.app import create_app

CHAT = {"model": "fake-model", "messages": [{"role": "user", "content": "hi"}]}
IDLE = {"upstream_idle_timeout_s": 0.5}


def _settings(tmp_path, urls: list[str], server: dict | None = None):
    """Open mode; ``server``: GatewayConfig fields (the idle timeout 0.5 s unless given)."""
    settings = make_settings(tmp_path, upstream=urls[0])
    specs = tuple(ReplicaSpec(url, f"r{i}") for i, url in enumerate(urls))
    config = dataclasses.replace(settings.config, **{**IDLE, **(server or {})})
    return dataclasses.replace(settings, config=config, replicas=specs,
                               routing=RoutingOptions(health_interval_s=3600))


class _Silent:
    """A listening socket nobody accepts from: connections complete (the kernel's backlog) and
    requests are written, but no byte ever comes back -- what a SIGSTOPped server looks like."""

    def __enter__(self) -> str:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(64)
        return f"http://127.0.0.1:{self.sock.getsockname()[1]}"

    def __exit__(self, *exc: object) -> None:
        self.sock.close()


class _Stalling:
    """An upstream that stalls on demand. ``frozen``: /health never answers either.
    ``release_after_probes``: a slow answer, released once /health was asked that many times."""

    def __init__(self, frozen: bool, release_after_probes: int | None = None) -> None:
        self.frozen = frozen
        self.release_after_probes = release_after_probes
        self.probes = 0
        self.released = asyncio.Event()
        self._forever: tuple[asyncio.AbstractEventLoop, asyncio.Event] | None = None
        self.app = Starlette(routes=[Route("/v1/chat/completions", self.chat, methods=["POST"]),
                                     Route("/health", self.health, methods=["GET"])])

    async def forever(self) -> None:
        """Wait until :meth:`unblock` (the test's end), so the server can shut down."""
        if self._forever is None:
            self._forever = (asyncio.get_running_loop(), asyncio.Event())
        await self._forever[1].wait()

    def unblock(self) -> None:
        if self._forever is not None:
            loop, event = self._forever
            loop.call_soon_threadsafe(event.set)

    async def health(self, request: Request) -> Response:
        self.probes += 1
        if self.release_after_probes is not None and self.probes >= self.release_after_probes:
            self.released.set()
        if self.frozen:
            await self.forever()  # never answers
        return Response(status_code=200)

    async def chat(self, request: Request) -> Response:
        body = orjson.loads(await request.body())
        if body.get("stream"):
            return StreamingResponse(self.events(), media_type="text/event-stream")
        if self.release_after_probes is None:
            await self.forever()
            return Response(status_code=500)  # the test is over
        await self.released.wait()
        return JSONResponse({"id": "c", "object": "chat.completion", "model": "fake-model",
                             "choices": [{"index": 0, "message": {"role": "assistant", "content": "late"},
                                          "finish_reason": "stop"}]})

    async def events(self):
        chunk = {"id": "c", "object": "chat.completion.chunk", "model": "fake-model",
                 "choices": [{"index": 0, "delta": {"content": "he"}, "finish_reason": None}]}
        yield b"data: " + orjson.dumps(chunk) + b"\n\n"
        await self.forever()  # then nothing, ever


async def _ask(app, stream: bool = False) -> httpx.Response:
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gw",
                                 timeout=60) as client:
        response = await client.post("/v1/chat/completions", json={**CHAT, "stream": stream},
                                     headers={"authorization": "Bearer k"})
        await response.aread()
        return response


@pytest.mark.parametrize("stream", [False, True])
def test_a_silent_replica_fails_its_requests_fast_and_the_next_go_elsewhere(tmp_path, stream) -> None:
    live = FakeUpstream()

    async def scenario(settings):
        app = create_app(settings)
        state = app.state.gateway
        state.replicas.watchdog.probe_timeout_s = 1.0  # the silent socket never answers: no need for 5 s
        state.replicas.start()
        try:
            began = time.monotonic()
            first = await _ask(app, stream)  # ties go to r0: the silent one
            took = time.monotonic() - began
            second = await _ask(app, stream)
            return first, took, second, [(r.healthy, r.stalls, r.in_flight) for r in state.replicas.replicas]
        finally:
            await state.aclose()

    with _Silent() as silent, serve_in_thread(live.app) as url:
        settings = _settings(tmp_path, [silent, url], {"connect_timeout_s": 2.0})
        first, took, second, replicas = asyncio.run(scenario(settings))
    assert first.status_code == 504
    error = orjson.loads(first.content)["error"]
    assert error["code"] == "upstream_stalled" and "r0" in error["message"], error
    assert took < 0.5 + 1 + 1 + 2  # idle + one scan tick + the probe's timeout + slack, not 600 s
    assert second.status_code == 200 and len(live.bodies) == 1
    assert replicas == [(False, 1, 0), (True, 0, 0)]
    assert [(r.replica, r.status) for r in rows(settings.db_url)] == [("r0", 504), ("r1", 200)]


def test_a_stream_that_stops_mid_way_ends_with_an_error_event(tmp_path) -> None:
    frozen = _Stalling(frozen=True)

    async def scenario(settings):
        app = create_app(settings)
        app.state.gateway.replicas.start()
        try:
            return await _ask(app, stream=True), app.state.gateway.replicas.replicas[0].healthy
        finally:
            await app.state.gateway.aclose()

    with serve_in_thread(frozen.app) as url:
        settings = _settings(tmp_path, [url], {"connect_timeout_s": 1.0})
        try:
            response, healthy = asyncio.run(scenario(settings))
        finally:
            frozen.unblock()
    assert response.status_code == 200  # the head was sent before the stall
    events = sse_events(response.text)
    assert '"he"' in events[0]
    assert events[-1] == "data: [DONE]"  # a failed chat stream ends as the engine and vLLM end one
    last = orjson.loads(events[-2].removeprefix("data: "))
    assert last["error"]["code"] == "upstream_stalled"
    assert not healthy
    assert [r.status for r in rows(settings.db_url)] == [504]


def test_a_slow_replica_that_answers_its_probe_keeps_its_request(tmp_path) -> None:
    # The answer comes only after the watchdog probed /health twice, i.e. after two idle periods.
    slow = _Stalling(frozen=False, release_after_probes=2)

    async def scenario(settings):
        app = create_app(settings)
        app.state.gateway.replicas.start()
        try:
            return await _ask(app), app.state.gateway.replicas.replicas[0]
        finally:
            await app.state.gateway.aclose()

    with serve_in_thread(slow.app) as url:
        settings = _settings(tmp_path, [url])
        response, replica = asyncio.run(scenario(settings))
    assert response.status_code == 200 and orjson.loads(response.content)["choices"][0]["message"]["content"] == "late"
    assert slow.probes >= 2 and replica.healthy and replica.stalls == 0


def test_the_total_timeout_ends_a_request_whose_replica_stays_alive(tmp_path) -> None:
    slow = _Stalling(frozen=False)  # answers /health, never the request

    async def scenario(settings):
        app = create_app(settings)
        app.state.gateway.replicas.start()
        try:
            return await _ask(app), app.state.gateway.replicas.replicas[0]
        finally:
            await app.state.gateway.aclose()

    with serve_in_thread(slow.app) as url:
        settings = _settings(tmp_path, [url], {"upstream_timeout_s": 2.0})
        try:
            response, replica = asyncio.run(scenario(settings))
        finally:
            slow.unblock()
    assert response.status_code == 504
    assert orjson.loads(response.content)["error"]["code"] == "upstream_timeout"
    assert replica.healthy and replica.stalls == 0 and slow.probes >= 1
