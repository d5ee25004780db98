"""The gateway's Starlette app factory.

``create_app`` wires one :class:`Proxy` (auth, canonicalization, warnings, salts,
upstream, stats) behind the OpenAI routes. The upstream ``httpx.AsyncClient`` is
injected so tests can swap its transport; when none is given the app creates a
pooled one (``connection_pool.ConnectionPool`` as its transport) and closes it on
shutdown. The lifespan's shutdown drains the stats writer, so no row is lost on a
graceful stop.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterator
from typing import Any

import anyio
import httpx
import orjson
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route
from starlette.types import ASGIApp, Receive, Scope, Send

from engine.contract.body_reader import BodyReader
from gateway.errors import GatewayError, NotFound, Unauthorized, error_response
from gateway.policy.authenticator import Authenticator, bearer_token
from gateway.policy.prefix_warner import History, PrefixWarner
from gateway.policy.schema_quota import SchemaQuota
from gateway.proxy.handler import PATHS, Proxy
from gateway.proxy.schema_routes import PromptSchemaRoutes
from gateway.responses.routes import ResponsesRoutes
from gateway.responses.store import ResponseStore
from gateway.responses.turn import ResponseTurns
from gateway.routing.replica_metrics import ReplicaCollector
from gateway.routing.replicas import ReplicaSet
from gateway.server.settings import GatewaySettings
from gateway.stats.dashboard import dashboard_route
from gateway.stats.database import create_db_engine
from gateway.stats.metrics import CONTENT_TYPE, GatewayMetrics, MetricsListener
from gateway.stats.report import per_tenant
from gateway.stats.writer import StatsWriter
from gateway.upstream.connection_pool import ConnectionPool
from gateway.upstream.stall_watchdog import StallWatchdog

log = logging.getLogger(__name__)


def _json(payload: Any, status: int = 200) -> Response:
    return Response(orjson.dumps(payload), status_code=status, media_type="application/json")


def default_client(settings: GatewaySettings) -> httpx.AsyncClient:
    config = settings.config
    timeout = httpx.Timeout(config.upstream_timeout_s, connect=config.connect_timeout_s)
    # Expire idle connections before uvicorn-based engines do (their keep-alive timeout
    # is 5 s, httpx's default expiry too): reusing a connection the server is closing
    # would fail a request with a read error.
    limits = httpx.Limits(max_connections=512, max_keepalive_connections=512, keepalive_expiry=4.0)
    return httpx.AsyncClient(timeout=timeout, transport=ConnectionPool(limits=limits))


class InferenceRoutes:
    """The three inference routes as plain ASGI, in front of Starlette's routing.

    A POST to one of :data:`INFERENCE_PATHS` goes straight to :meth:`Proxy.handle`;
    everything else (other paths and methods, 404 and 405 included) continues to
    the router. Installed as the app's only middleware, so it runs inside
    Starlette's ``ServerErrorMiddleware`` (an exception still becomes a 500) but
    skips the exception middleware, route matching and per-route wrappers: under
    load those layers cost as much CPU as the proxy's own work. ``Proxy.handle``
    renders every error itself, so nothing those layers do is lost.
    """

    def __init__(self, app: ASGIApp, state: GatewayState) -> None:
        self.app = app
        self.state = state

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["method"] == "POST":
            endpoint = INFERENCE_PATHS.get(scope["path"])
            if endpoint is not None:
                response = await self.state.proxy.handle(Request(scope, receive), endpoint)
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


INFERENCE_PATHS = {path: endpoint for endpoint, path in PATHS.items()}


class GatewayState:
    """The per-app objects; reachable as ``app.state.gateway``."""

    def __init__(
        self, settings: GatewaySettings, client: httpx.AsyncClient | None, history: History | None = None
    ) -> None:
        self.settings = settings
        self.owns_client = client is None
        self.client = client or default_client(settings)
        self.replicas = ReplicaSet(
            settings.replica_specs(), self.client, settings.routing,
            kind=settings.upstream_kind, api_key=settings.upstream_api_key,
            watchdog=StallWatchdog(settings.config.upstream_idle_timeout_s, settings.config.upstream_timeout_s),
        )
        self.authenticator = Authenticator(settings.config, open_mode=settings.open_mode)
        self.db_engine = create_db_engine(settings.db_url)
        self.writer = StatsWriter(self.db_engine, batch_size=settings.stats_batch_size)
        self.metrics = GatewayMetrics()
        self.metrics.add_collector(ReplicaCollector(self.replicas))
        self.warner = PrefixWarner(history=history)
        self.responses = ResponseStore(self.db_engine, settings.responses)
        self.schema_quota = SchemaQuota()
        self.proxy = Proxy(
            replicas=self.replicas,
            authenticator=self.authenticator,
            warner=self.warner,
            writer=self.writer,
            metrics=self.metrics,
            secret=settings.secret,
            bodies=BodyReader(settings.config.body_limits()),
            turns=ResponseTurns(self.responses),
        )

    async def aclose(self) -> None:
        await self.replicas.aclose()
        await anyio.to_thread.run_sync(self.writer.close)
        self.warner.close()
        if self.owns_client:
            await self.client.aclose()
        self.db_engine.dispose()


def create_app(
    settings: GatewaySettings, client: httpx.AsyncClient | None = None, history: History | None = None
) -> Starlette:
    """The app; ``history`` is the shared conversation history when several workers serve it."""
    state = GatewayState(settings, client, history)
    stored = ResponsesRoutes(state.responses, state.authenticator)
    schemas = PromptSchemaRoutes(state.replicas, state.authenticator, settings.secret,
                                 state.proxy.bodies, state.schema_quota)

    def inference(endpoint: str) -> Any:
        async def handle(request: Request) -> Response:
            return await state.proxy.handle(request, endpoint)
        return handle

    async def models(request: Request) -> Response:
        state.authenticator.tenant_for(request.headers.get("authorization"))
        return _json(await state.replicas.get("/v1/models"))

    async def health(request: Request) -> Response:
        error = await state.replicas.any_healthy()
        if error is not None:
            return _json({"status": "degraded", "upstream": error.message}, status=503)
        return _json({"status": "ok", "upstream": "ok"})

    async def metrics(request: Request) -> Response:
        authorization = request.headers.get("authorization")
        if bearer_token(authorization) is None:
            raise Unauthorized("/metrics needs an admin API key (or run with --metrics-port PORT "
                               "to serve it without one on 127.0.0.1:PORT).")
        state.authenticator.require_admin(authorization)
        return Response(state.metrics.render(), media_type=CONTENT_TYPE)

    async def cache_stats(request: Request) -> Response:
        state.authenticator.require_admin(request.headers.get("authorization"))
        await anyio.to_thread.run_sync(state.writer.flush, 30.0)
        groups = await anyio.to_thread.run_sync(per_tenant, state.db_engine)
        return _json({
            "object": "cache.stats",
            "tenants": {name: stats.to_dict() for name, stats in groups.items()},
        })

    async def gateway_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, GatewayError)
        return error_response(exc)

    async def not_found(request: Request, exc: Exception) -> Response:
        return error_response(NotFound(f"no route for {request.method} {request.url.path}"))

    async def method_not_allowed(request: Request, exc: Exception) -> Response:
        error = GatewayError(f"method {request.method} not allowed on {request.url.path}", code="method_not_allowed")
        error.status, error.type = 405, "invalid_request_error"
        return error_response(error)

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        state.replicas.start()
        listener = None
        if settings.metrics_port is not None:
            listener = MetricsListener(settings.metrics_port, state.metrics.render).start()
        try:
            yield
        finally:
            if listener is not None:
                listener.close()
            await state.aclose()

    app = Starlette(
        routes=[
            # Answered by InferenceRoutes before routing; the routes give other methods their 405.
            *(Route(path, inference(endpoint), methods=["POST"]) for path, endpoint in INFERENCE_PATHS.items()),
            Route("/v1/models", models, methods=["GET"]),
            Route("/health", health, methods=["GET"]),
            Route("/metrics", metrics, methods=["GET"]),
            Route("/v1/cache/stats", cache_stats, methods=["GET"]),
            Route("/v1/responses/{response_id}", stored.retrieve, methods=["GET"]),
            Route("/v1/responses/{response_id}", stored.delete, methods=["DELETE"]),
            Route("/v1/responses/{response_id}/input_items", stored.input_items, methods=["GET"]),
            Route("/v1/prompt_schemas", schemas.create, methods=["POST"]),
            Route("/v1/prompt_schemas", schemas.list_schemas, methods=["GET"]),
            Route("/v1/prompt_schemas/{name}", schemas.delete, methods=["DELETE"]),
            dashboard_route(state),
        ],
        middleware=[Middleware(InferenceRoutes, state=state)],
        exception_handlers={GatewayError: gateway_error, 404: not_found, 405: method_not_allowed},
        lifespan=lifespan,
    )
    app.state.gateway = state
    return app
