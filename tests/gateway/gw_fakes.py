"""Gateway test helpers: a small fake OpenAI upstream, gateway apps wired to it, and
a uvicorn-on-loopback runner for the tests that need real HTTP."""

from __future__ import annotations

import asyncio
import contextlib
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import orjson
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route
from support.net import free_port

from gateway.config.config_file import GatewayConfig, parse_config
from gateway.server.app import create_app
from gateway.server.settings import GatewaySettings
from gateway.stats.database import default_db_url, upgrade

SECRET = b"test-secret-0123456789abcdef0123456789"


class FakeUpstream:
    """An OpenAI-shaped upstream that records every body it receives.

    ``mode``: "ok", "no_cached" (usage without prompt_tokens_details), "error500",
    "error429", "invalid_json", "endless" (streams until the client goes away).
    """

    def __init__(self) -> None:
        self.mode = "ok"
        self.bodies: list[dict[str, Any]] = []
        self.stream_cancelled = threading.Event()
        self.app = Starlette(routes=[
            Route("/v1/chat/completions", self.chat, methods=["POST"]),
            Route("/v1/completions", self.chat, methods=["POST"]),
            Route("/v1/models", self.models, methods=["GET"]),
            Route("/health", self.health, methods=["GET"]),
        ])

    def usage(self, body: dict[str, Any]) -> dict[str, Any]:
        prompt = len(orjson.dumps(body.get("messages") or body.get("prompt"))) // 4
        usage: dict[str, Any] = {"prompt_tokens": prompt, "completion_tokens": 3, "total_tokens": prompt + 3}
        if self.mode != "no_cached":
            usage["prompt_tokens_details"] = {"cached_tokens": 16 if "cache_salt" in body else 0}
        return usage

    async def chat(self, request: Request) -> Response:
        body = orjson.loads(await request.body())
        self.bodies.append(body)
        if self.mode == "error500":
            return JSONResponse({"error": {"message": "boom", "type": "server_error"}}, status_code=500)
        if self.mode == "error429":
            return JSONResponse({"error": {"message": "slow down", "type": "rate_limit_error", "param": None,
                                           "code": "rate_limit_exceeded"}}, status_code=429)
        if self.mode == "invalid_json":
            return Response(b"{not json", media_type="application/json")
        if body.get("model") == "missing-model":
            return JSONResponse(
                {"error": {"message": "no such model", "type": "invalid_request_error",
                           "param": "model", "code": "model_not_found"}}, status_code=404,
            )
        if body.get("stream"):
            return StreamingResponse(self.events(body), media_type="text/event-stream")
        return JSONResponse({
            "id": "cmpl-1", "object": "chat.completion", "model": body["model"],
            "choices": [{"index": 0, "message": {"role": "assistant", "content": "hi!"},
                         "finish_reason": "stop"}],
            "usage": self.usage(body),
        })

    async def events(self, body: dict[str, Any]):
        include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
        base = {"id": "cmpl-1", "object": "chat.completion.chunk", "model": body["model"]}
        extra = {"usage": None} if include_usage else {}
        try:
            words = ["he", "llo", "!"]
            index = 0
            while True:
                word = words[index % 3] if index < 3 or self.mode == "endless" else None
                if word is None:
                    break
                chunk = {**base, "choices": [{"index": 0, "delta": {"content": word}, "finish_reason": None}], **extra}
                yield b"data: " + orjson.dumps(chunk) + b"\n\n"
                index += 1
                if self.mode == "endless":
                    await asyncio.sleep(0.02)  # pacing of the fake stream, not synchronisation
            final = {**base, "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}], **extra}
            yield b"data: " + orjson.dumps(final) + b"\n\n"
            if include_usage:
                yield b"data: " + orjson.dumps({**base, "choices": [], "usage": self.usage(body)}) + b"\n\n"
            yield b"data: [DONE]\n\n"
        except (asyncio.CancelledError, GeneratorExit):
            self.stream_cancelled.set()
            raise

    async def models(self, request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [{"id": "fake-model", "object": "model"}]})

    async def health(self, request: Request) -> Response:
        return Response(status_code=200)


def make_settings(tmp_path: Path, config: dict[str, Any] | None = None, upstream: str = "http://upstream") -> GatewaySettings:
    db_url = default_db_url(tmp_path)
    upgrade(db_url)
    parsed = parse_config(config) if config is not None else GatewayConfig()
    return GatewaySettings(
        upstream=upstream, secret=SECRET, db_url=db_url, config=parsed,
        open_mode=config is None, data_dir=tmp_path, stats_batch_size=8,
    )


@contextlib.asynccontextmanager
async def gateway_client(settings: GatewaySettings, upstream_transport: httpx.AsyncBaseTransport):
    """An httpx client talking to a gateway app (in process) whose upstream is the transport."""
    upstream_client = httpx.AsyncClient(transport=upstream_transport, timeout=5.0)
    app = create_app(settings, upstream_client)
    try:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gw") as client:
            yield client
    finally:
        await app.state.gateway.aclose()
        await upstream_client.aclose()


def wait_healthy(
    url: str, process: subprocess.Popen, *, name: str, timeout: float = 60.0, interval: float = 0.1
) -> None:
    """Poll ``url``/health until it answers 200; fail if ``process`` exits or time runs out."""
    deadline = time.monotonic() + timeout
    while True:
        assert process.poll() is None, (
            process.stderr.read() if process.stderr else f"{name} exited during start-up"
        )
        try:
            if httpx.get(url + "/health", timeout=5).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        assert time.monotonic() < deadline, f"{name} did not become healthy"
        time.sleep(interval)



@contextlib.contextmanager
def serve_in_thread(app: Any) -> Iterator[str]:
    """Run ``app`` with uvicorn on a free loopback port; yields its base URL."""
    import uvicorn

    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", lifespan="on"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(30)


def rows(db_url: str) -> list[Any]:
    from sqlalchemy import select

    from gateway.stats.database import create_db_engine
    from gateway.stats.table import request_log

    engine = create_db_engine(db_url)
    try:
        with engine.connect() as connection:
            return list(connection.execute(select(request_log).order_by(request_log.c.id)))
    finally:
        engine.dispose()
