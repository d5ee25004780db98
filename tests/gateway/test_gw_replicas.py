"""Several replicas behind one gateway, over real HTTP on loopback: retry before send,
no retry after, health checks with leave and rejoin, one stats row naming the replica."""

from __future__ import annotations

import asyncio
import socket
import threading

import httpx
import pytest
from gw_fakes import FakeUpstream, make_settings, rows, serve_in_thread
from support.net import free_port

from gateway.config.replica_spec import ReplicaSpec, RoutingOptions
from gateway.routing.replicas import ReplicaSet
from gateway.server.app import create_app

CHAT = {"model": "fake-model", "messages": [{"role": "user", "content": "hi"}]}


def _settings(tmp_path, urls: list[str]):
    settings = make_settings(tmp_path, upstream=urls[0])
    specs = tuple(ReplicaSpec(url, f"r{i}") for i, url in enumerate(urls))
    return type(settings)(**{**settings.__dict__, "replicas": specs, "routing": RoutingOptions(health_interval_s=0.5)})


async def _post_many(settings, n: int, stream: bool = False) -> list[httpx.Response]:
    app = create_app(settings, httpx.AsyncClient(timeout=10))
    try:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gw") as client:
            responses = [await client.post("/v1/chat/completions", json={**CHAT, "stream": stream},
                                           headers={"authorization": "Bearer k"}) for _ in range(n)]
            for response in responses:
                await response.aread()
        for replica in app.state.gateway.replicas.replicas:  # every route was released once
            assert (replica.in_flight, replica.queued_prefill) == (0, 0), replica.name
            assert replica.index.hit_blocks([b"x" * 32]) == 0
        return responses
    finally:
        await app.state.gateway.aclose()


@pytest.mark.parametrize("stream", [False, True])
def test_a_dead_replica_is_skipped_and_no_request_is_lost(tmp_path, stream) -> None:
    live = [FakeUpstream(), FakeUpstream()]
    dead = f"http://127.0.0.1:{free_port()}"  # nothing listens there: connect refused
    with serve_in_thread(live[0].app) as url1, serve_in_thread(live[1].app) as url2:
        settings = _settings(tmp_path, [dead, url1, url2])
        responses = asyncio.run(_post_many(settings, 6, stream))
    assert [r.status_code for r in responses] == [200] * 6
    assert len(live[0].bodies) + len(live[1].bodies) == 6
    logged = rows(settings.db_url)
    assert len(logged) == 6 and {r.replica for r in logged} <= {"r1", "r2"}
    assert {r.upstream for r in logged} <= {url1, url2}
    # The same prompt stays on the replica that has its prefix (from routing history: no events here).
    assert len({r.replica for r in logged}) == 1


def _drop_after_request_server() -> tuple[str, list[bytes], threading.Event]:
    """A server that reads one whole HTTP request, then closes the connection without answering."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    received: list[bytes] = []
    stop = threading.Event()

    def serve() -> None:
        listener.settimeout(0.2)
        while not stop.is_set():
            try:
                conn, _ = listener.accept()
            except TimeoutError:
                continue
            with conn:
                data = b""
                while b"\r\n\r\n" not in data:
                    data += conn.recv(65536)
                head, _, body = data.partition(b"\r\n\r\n")
                length = int(next(line.split(b":")[1] for line in head.split(b"\r\n")
                                  if line.lower().startswith(b"content-length")))
                while len(body) < length:
                    body += conn.recv(65536)
                received.append(body)
        listener.close()

    threading.Thread(target=serve, daemon=True).start()
    return f"http://127.0.0.1:{listener.getsockname()[1]}", received, stop


def test_a_request_that_reached_a_replica_is_never_retried(tmp_path) -> None:
    other = FakeUpstream()
    url, received, stop = _drop_after_request_server()
    try:
        with serve_in_thread(other.app) as other_url:
            settings = _settings(tmp_path, [url, other_url])
            responses = asyncio.run(_post_many(settings, 1))
    finally:
        stop.set()
    assert responses[0].status_code == 502
    assert len(received) == 1 and other.bodies == []
    (row,) = rows(settings.db_url)
    assert row.replica == "r0" and row.status == 502


def _serve_on(app, port: int):
    import uvicorn

    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        assert thread.is_alive()
    return server, thread


def test_health_checks_take_a_replica_out_and_bring_it_back(tmp_path) -> None:
    port = free_port()
    up, other = FakeUpstream(), FakeUpstream()

    async def scenario(other_url: str) -> None:
        async with httpx.AsyncClient(timeout=5) as client:
            replicas = ReplicaSet([ReplicaSpec(f"http://127.0.0.1:{port}", "a"), ReplicaSpec(other_url, "b")],
                                  client, RoutingOptions(), keyer=None)
            a = replicas.replicas[0]
            a.index.routed([b"k" * 32])
            a.index.finished([b"k" * 32])
            await replicas.check_health()
            assert not a.healthy and a.index.num_blocks == 0  # left the pool, index dropped
            server, thread = _serve_on(up.app, port)
            try:
                await replicas.check_health()
                assert a.healthy
            finally:
                server.should_exit = True
                await asyncio.to_thread(thread.join, 30)
            await replicas.check_health()
            assert not a.healthy and replicas.replicas[1].healthy

    with serve_in_thread(other.app) as other_url:
        asyncio.run(scenario(other_url))


def test_gateway_health_is_ok_while_one_replica_is(tmp_path) -> None:
    up = FakeUpstream()

    async def scenario(url: str) -> tuple[int, int]:
        dead = f"http://127.0.0.1:{free_port()}"
        app = create_app(_settings(tmp_path, [dead, url]), httpx.AsyncClient(timeout=5))
        try:
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gw") as client:
                health = await client.get("/health")
                models = await client.get("/v1/models", headers={"authorization": "Bearer k"})
                return health.status_code, models.status_code
        finally:
            await app.state.gateway.aclose()

    with serve_in_thread(up.app) as url:
        assert asyncio.run(scenario(url)) == (200, 200)


def test_a_replica_that_answers_badly_leaves_only_after_repeated_failures(tmp_path) -> None:
    from starlette.applications import Starlette
    from starlette.responses import Response
    from starlette.routing import Route

    from gateway.routing.replicas import FAILURES_TO_LEAVE

    state = {"status": 503}

    async def health(request):
        return Response(status_code=state["status"])

    app = Starlette(routes=[Route("/health", health)])

    async def scenario(url: str) -> None:
        async with httpx.AsyncClient(timeout=5) as client:
            replicas = ReplicaSet([ReplicaSpec(url, "a"), ReplicaSpec(url, "b")], client, RoutingOptions(), keyer=None)
            a = replicas.replicas[0]
            a.index.routed([b"k" * 32])
            for _ in range(FAILURES_TO_LEAVE - 1):
                await replicas.check_health()
                assert a.healthy and a.index.hit_blocks([b"k" * 32]) == 1  # a slow or busy engine keeps its place
            await replicas.check_health()
            assert not a.healthy
            state["status"] = 200
            await replicas.check_health()
            assert a.healthy and a.failed_checks == 0

    with serve_in_thread(app) as url:
        asyncio.run(scenario(url))
