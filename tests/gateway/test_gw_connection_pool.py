"""ConnectionPool against real loopback servers: reuse, framing, streaming, and every
failure mapped to the httpx exception ``upstream.py`` translates."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable

import httpx
import pytest

from gateway.upstream.connection_pool import ConnectionPool

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]
LIMITS = httpx.Limits(max_connections=8, max_keepalive_connections=8, keepalive_expiry=4.0)


async def read_request(reader: asyncio.StreamReader) -> bytes:
    head = await reader.readuntil(b"\r\n\r\n")
    length = 0
    for line in head.split(b"\r\n"):
        if line.lower().startswith(b"content-length:"):
            length = int(line.split(b":")[1])
    return head + await reader.readexactly(length)


@contextlib.asynccontextmanager
async def raw_server(handler: Handler) -> AsyncIterator[tuple[str, list[int]]]:
    """A loopback server running ``handler`` per connection; yields its URL and a list
    that gets one entry per accepted connection."""
    accepted: list[int] = []

    async def on_connect(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        accepted.append(1)
        try:
            await handler(reader, writer)
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    server = await asyncio.start_server(on_connect, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    async with server:
        yield f"http://127.0.0.1:{port}", accepted


def keep_alive_json(body: bytes = b'{"ok": true}') -> Handler:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while True:
            await read_request(reader)
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: "
                         + str(len(body)).encode() + b"\r\n\r\n" + body)
            await writer.drain()
    return handler


def client(**kwargs: float) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=ConnectionPool(limits=LIMITS), timeout=httpx.Timeout(30.0, **kwargs))


def test_sequential_requests_reuse_one_connection_and_concurrent_ones_are_bounded():
    async def go() -> None:
        async with raw_server(keep_alive_json()) as (url, accepted), client() as http:
            for _ in range(20):
                response = await http.post(url + "/v1/x", content=b'{"a": 1}')
                assert response.status_code == 200 and response.json() == {"ok": True}
            assert len(accepted) == 1
            results = await asyncio.gather(*(http.post(url + "/v1/x", content=b"{}") for _ in range(40)))
            assert all(r.status_code == 200 for r in results)
            assert 1 < len(accepted) <= 1 + LIMITS.max_connections
    asyncio.run(go())


def test_the_pool_works_on_uvloop_whose_transports_are_not_asyncio_transports():
    """uvicorn runs the gateway on uvloop when it is installed (a dependency on Linux)."""
    uvloop = pytest.importorskip("uvloop")

    async def go() -> None:
        async with raw_server(keep_alive_json()) as (url, accepted), client() as http:
            for _ in range(5):
                response = await http.post(url + "/v1/x", content=b'{"a": 1}')
                assert response.status_code == 200 and response.json() == {"ok": True}
            assert len(accepted) == 1
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        runner.run(go())


def test_chunked_stream_arrives_in_pieces_and_the_connection_is_reused():
    events = [b"data: {\"n\": %d}\n\n" % i for i in range(5)] + [b"data: [DONE]\n\n"]
    release = asyncio.Event()

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while True:
            await read_request(reader)
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n")
            for index, event in enumerate(events):
                writer.write(b"%x\r\n%s\r\n" % (len(event), event))
                await writer.drain()
                if index == 0:
                    await release.wait()  # the client must see event 0 before the rest exists
            writer.write(b"0\r\n\r\n")
            await writer.drain()

    async def go() -> None:
        async with raw_server(handler) as (url, accepted), client() as http:
            for _ in range(2):
                release.clear()
                received = b""
                async with http.stream("POST", url + "/s", content=b"{}") as response:
                    async for chunk in response.aiter_bytes():
                        received += chunk
                        release.set()
                assert received == b"".join(events)
            assert len(accepted) == 1
    asyncio.run(go())


def test_a_response_closed_early_closes_its_connection():
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n5\r\nhello\r\n")
        await writer.drain()
        assert await reader.read() == b""  # the client hung up: the upstream can stop

    async def go() -> None:
        async with raw_server(handler) as (url, accepted), client() as http:
            for _ in range(2):
                async with http.stream("POST", url, content=b"{}") as response:
                    async for chunk in response.aiter_bytes():
                        assert chunk == b"hello"
                        break
            assert len(accepted) == 2
    asyncio.run(go())


def test_body_delimited_by_the_end_of_the_connection():
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nconnection: close\r\n\r\nall of it")
        await writer.drain()

    async def go() -> None:
        async with raw_server(handler) as (url, accepted), client() as http:
            assert (await http.get(url)).content == b"all of it"
            assert (await http.get(url)).content == b"all of it"
            assert len(accepted) == 2
    asyncio.run(go())


@pytest.mark.parametrize(
    ("reply", "error"),
    [
        (b"HTTP/1.1 200 OK\r\ncontent-length: 100\r\n\r\nshort", httpx.ReadError),
        (b"", httpx.ReadError),
        (b"NOT HTTP AT ALL\r\n\r\n", httpx.RemoteProtocolError),
    ],
)
def test_broken_responses_raise_httpx_errors(reply, error):
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(reply)
        await writer.drain()

    async def go() -> None:
        async with raw_server(handler) as (url, _), client() as http:
            with pytest.raises(error):
                await http.post(url, content=b"{}")
    asyncio.run(go())


def test_timeouts_and_refused_connections():
    async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        await reader.read()

    async def go() -> None:
        async with raw_server(silent) as (url, _), client(read=0.2) as http:
            with pytest.raises(httpx.ReadTimeout):
                await http.post(url, content=b"{}")
        async with client() as http:
            port = url.rsplit(":", 1)[1]  # the server is gone: nothing listens there now
            with pytest.raises(httpx.ConnectError):
                await http.post(f"http://127.0.0.1:{port}", content=b"{}")
    asyncio.run(go())


def test_pool_timeout_when_every_connection_is_busy():
    gate, busy = asyncio.Event(), asyncio.Event()

    async def slow(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        busy.set()
        await gate.wait()

    async def go() -> None:
        limits = httpx.Limits(max_connections=1, max_keepalive_connections=1, keepalive_expiry=4.0)
        async with raw_server(slow) as (url, _), httpx.AsyncClient(
            transport=ConnectionPool(limits=limits), timeout=httpx.Timeout(5.0, pool=0.2)
        ) as http:
            first = asyncio.ensure_future(http.post(url, content=b"{}"))
            await busy.wait()  # the first request holds the only connection
            with pytest.raises(httpx.PoolTimeout):
                await http.post(url, content=b"{}")
            first.cancel()
            gate.set()
            with contextlib.suppress(asyncio.CancelledError):
                await first
    asyncio.run(go())


def test_trace_hook_fires_once_the_request_is_sent():
    async def go() -> None:
        seen: list[str] = []

        async def trace(event: str, info: dict) -> None:
            seen.append(event)

        async with raw_server(keep_alive_json()) as (url, _), client() as http:
            await http.post(url, content=b"{}", extensions={"trace": trace})
        assert seen == ["http11.send_request_body.complete"]
    asyncio.run(go())


def test_https_upstream_with_a_trusted_certificate(tmp_path):
    import shutil
    import ssl
    import subprocess

    if shutil.which("openssl") is None:
        pytest.skip("openssl is not installed")
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=localhost",
         "-addext", "subjectAltName=DNS:localhost", "-keyout", str(key), "-out", str(cert)],
        check=True, capture_output=True,
    )
    server_tls = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    server_tls.load_cert_chain(cert, key)
    client_tls = ssl.create_default_context(cafile=str(cert))

    async def go() -> None:
        accepted: list[int] = []

        async def on_connect(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            accepted.append(1)
            with contextlib.suppress(asyncio.IncompleteReadError, ConnectionError):
                await keep_alive_json()(reader, writer)
            writer.close()

        server = await asyncio.start_server(on_connect, "127.0.0.1", 0, ssl=server_tls)
        port = server.sockets[0].getsockname()[1]
        async with server, httpx.AsyncClient(
            transport=ConnectionPool(limits=LIMITS, ssl_context=client_tls), timeout=5.0
        ) as http:
            for _ in range(3):
                response = await http.post(f"https://localhost:{port}/v1/x", content=b"{}")
                assert response.json() == {"ok": True}
            assert len(accepted) == 1
        async with httpx.AsyncClient(transport=ConnectionPool(limits=LIMITS), timeout=5.0) as untrusting:
            server = await asyncio.start_server(on_connect, "127.0.0.1", port, ssl=server_tls)
            async with server:
                with pytest.raises(httpx.ConnectError):  # the default trust store rejects the certificate
                    await untrusting.post(f"https://localhost:{port}/v1/x", content=b"{}")
    asyncio.run(go())


def test_an_idle_connection_the_upstream_dropped_is_not_reused_before_the_loop_notices():
    """A replica killed between two requests: its FIN is in the kernel, but the event loop has
    not run since, so ``connection_lost`` has not fired. The next request must not be written
    into the dead socket (that is a ReadError after sending: never retried); it opens a new one."""
    import socket
    import threading

    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    closed = threading.Event()
    answer = b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 2\r\n\r\n{}"

    def serve() -> None:
        for index in range(2):
            conn, _ = listener.accept()
            with conn:
                conn.recv(65536)
                conn.sendall(answer)
                if index == 0:  # drop the keep-alive connection while it is idle
                    conn.shutdown(socket.SHUT_RDWR)
                    closed.set()
                else:
                    conn.recv(65536)  # until the client closes

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()

    async def go() -> None:
        async with client() as http:
            pool = http._transport
            assert isinstance(pool, ConnectionPool)
            first = await http.post(f"http://127.0.0.1:{port}/v1/x", content=b"{}")
            assert first.status_code == 200
            closed.wait(5)  # blocks the loop: the FIN stays unprocessed
            second = await http.post(f"http://127.0.0.1:{port}/v1/x", content=b"{}")
            assert second.status_code == 200 and pool.opened == 2

    asyncio.run(go())
    listener.close()


def test_an_upstream_cookie_never_travels_with_the_next_request():
    """The gateway's one client serves every tenant: a Set-Cookie from the upstream must not
    come back on anyone's next request (upstream.py sends through the transport, no cookie jar)."""
    from gateway.upstream.client import Upstream

    heads: list[bytes] = []

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while True:
            heads.append(await read_request(reader))
            writer.write(b"HTTP/1.1 200 OK\r\nset-cookie: session=tenant-a; Path=/\r\n"
                         b"content-type: application/json\r\ncontent-length: 2\r\n\r\n{}")
            await writer.drain()

    async def go() -> None:
        async with raw_server(handler) as (url, _), client() as http:
            upstream = Upstream(url, http)
            for _ in range(2):
                assert await upstream.post("/v1/chat/completions", b"{}") == ({}, b"{}")
    asyncio.run(go())
    assert len(heads) == 2 and all(b"cookie:" not in head.lower() for head in heads)
