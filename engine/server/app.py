"""The engine's OpenAI-compatible HTTP server: :func:`create_app` and :func:`run_server`.

Routes (vLLM's OpenAI server surface, so the gateway can front either):
``POST /v1/chat/completions``, ``POST /v1/completions``, ``POST /v1/responses``
(stateless, :mod:`engine.server.responses`), ``GET /v1/models``,
``POST``/``GET /v1/prompt_schemas``, ``DELETE /v1/prompt_schemas/{name}`` (PML,
:mod:`engine.server.prompt_modules`),
``GET /health``, ``GET /metrics``; the handlers live in
:class:`~engine.server.request_handler.RequestHandler`.

Errors are translated to OpenAI's shape here and only here (the exception
handlers below): :class:`~engine.contract.errors.APIError` keeps its status; Starlette's
404/405 get the same shape; anything unexpected is a logged 500 ``server_error``.
Every client mistake is a 4xx, never a 500.
"""

from __future__ import annotations

import contextlib
import logging
import signal
import threading
from collections.abc import Callable, Iterator
from typing import Any

import uvicorn
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from engine.contract import errors
from engine.contract.api_key import ApiKeyGuard
from engine.contract.body_reader import BodyLimits, BodyReader
from engine.contract.errors import APIError
from engine.contract.images import MediaPolicy
from engine.core.llm_engine import LLMEngine
from engine.server.request_handler import RequestHandler

logger = logging.getLogger(__name__)

DEFAULT_MAX_BODY_BYTES = 32 * 1024 * 1024


async def _api_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, APIError)
    return JSONResponse(exc.to_dict(), status_code=exc.status_code)


async def _http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    if exc.status_code == 404:
        err = errors.not_found(request.url.path)
    elif exc.status_code == 405:
        err = errors.method_not_allowed(request.method, request.url.path)
    else:
        err = APIError(exc.status_code, str(exc.detail))
    return JSONResponse(err.to_dict(), status_code=err.status_code, headers=exc.headers)


async def _unexpected(request: Request, exc: Exception) -> Response:
    logger.exception("unhandled error on %s", request.url.path, exc_info=exc)
    err = errors.engine_failure(f"Internal error: {type(exc).__name__}")
    return JSONResponse(err.to_dict(), status_code=500)


def create_app(engine: LLMEngine, *, media: MediaPolicy | None = None,
               max_body_bytes: int = DEFAULT_MAX_BODY_BYTES, api_key: str | None = None,
               body_limits: BodyLimits | None = None, segment_reuse: bool = False) -> Starlette:
    """An ASGI app serving ``engine`` (already started; the caller owns its lifetime).

    With ``api_key`` every route but ``/health`` needs it as a bearer token
    (:class:`~engine.contract.api_key.ApiKeyGuard`). ``media`` says which remote image
    URLs are fetched (default: none, only inline data: URLs). ``body_limits`` bounds
    request bodies (:mod:`engine.contract.body_reader`); ``max_body_bytes`` is the
    shorthand for its size limit when it is not given. ``segment_reuse``: the default of
    chat requests' ``segment_reuse`` (:mod:`engine.server.prompt_modules`)."""
    limits = body_limits or BodyLimits(max_bytes=max_body_bytes)
    handler = RequestHandler(engine, media=media or MediaPolicy(), bodies=BodyReader(limits),
                             segment_reuse=segment_reuse)
    modules = handler.prompt_modules
    routes = [
        Route("/health", handler.health, methods=["GET"]),
        Route("/v1/models", handler.models, methods=["GET"]),
        Route("/metrics", handler.metrics_endpoint, methods=["GET"]),
        Route("/v1/chat/completions", handler.chat_completions, methods=["POST"]),
        Route("/v1/completions", handler.completions, methods=["POST"]),
        Route("/v1/responses", handler.responses, methods=["POST"]),
        Route("/v1/prompt_schemas", modules.create_schema, methods=["POST"]),
        Route("/v1/prompt_schemas", modules.list_schemas, methods=["GET"]),
        Route("/v1/prompt_schemas/{name}", modules.delete_schema, methods=["DELETE"]),
    ]
    handlers: dict[Any, Callable[..., Any]] = {
        APIError: _api_error, HTTPException: _http_error, Exception: _unexpected,
    }
    middleware = [Middleware(ApiKeyGuard, api_key=api_key)] if api_key is not None else []
    app = Starlette(routes=routes, exception_handlers=handlers, middleware=middleware)
    app.state.handler = handler
    return app


class _GracefulServer(uvicorn.Server):
    """A uvicorn server that returns after a SIGINT/SIGTERM-triggered graceful stop.

    Plain uvicorn re-raises the captured signal once it has stopped, which kills the
    process before the caller can shut the engine thread down; here the previous
    handlers are restored and ``run`` simply returns.
    """

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        previous = {sig: signal.signal(sig, self.handle_exit) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)


def run_server(engine: LLMEngine, *, host: str = "127.0.0.1", port: int = 8001,
               media: MediaPolicy | None = None, log_level: str = "info",
               api_key: str | None = None, segment_reuse: bool = False) -> None:
    """Serve until SIGINT/SIGTERM, then return; the caller shuts the engine down."""
    app = create_app(engine, media=media, api_key=api_key, segment_reuse=segment_reuse)
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level,
                            timeout_graceful_shutdown=5, access_log=False)
    _GracefulServer(config).run()
