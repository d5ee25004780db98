"""Prompt schemas behind a gateway with two replicas, on loopback.

* Routing: PML prompts of one schema all go to that schema's home replica (the
  consistent hash of the tenant's salt and the schema name), and different schemas
  spread over both. The two replicas are two engine servers (each with its own
  schema registry) on the one tiny engine.
* Atomic registration: when a later replica refuses a schema (a fake that answers
  429, or one that cannot be reached: fault injection), the replicas that accepted
  it delete it again and the client gets the refusal.
"""

from __future__ import annotations

import contextlib
import socket
import threading
from collections import Counter
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest
import uvicorn
from sqlalchemy import select
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route
from test_engine_http_fixtures import serve, wait_until
from test_engine_http_fuzz import _Gateway

from gateway.config.replica_spec import ReplicaSpec
from gateway.server.settings import GatewaySettings
from gateway.stats.database import create_db_engine, default_db_url, upgrade
from gateway.stats.table import request_log

KEY = "pml-engine-key"
ALICE = "alice-key-0123456789"
SECRET = b"pml-secret-0123456789abcdef012345"
DOC = "The harbour closes at dusk; boats must be moored at the north pier before then. " * 3


def schema(name: str) -> str:
    return f'<schema name="{name}"><module name="doc">{DOC}</module></schema>'


@contextlib.contextmanager
def _served(app: Any) -> Iterator[str]:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", access_log=False, lifespan="off"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    wait_until(lambda: server.started, 30, "the fake replica to start")
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(30)
        sock.close()


class RefusingReplica:
    """A replica that is healthy but refuses every schema (429 ``schema_store_full``) and records calls."""

    def __init__(self) -> None:
        self.calls: list[str] = []
        self.app = Starlette(routes=[
            Route("/health", self.health, methods=["GET"]),
            Route("/v1/prompt_schemas", self.create, methods=["POST"]),
            Route("/v1/prompt_schemas/{name}", self.delete, methods=["DELETE"]),
        ])

    async def health(self, request: Request) -> JSONResponse:
        return JSONResponse({})

    async def create(self, request: Request) -> JSONResponse:
        self.calls.append("POST")
        return JSONResponse({"error": {"message": "the engine is full", "type": "invalid_request_error",
                                       "param": None, "code": "schema_store_full"}}, status_code=429)

    async def delete(self, request: Request) -> JSONResponse:
        self.calls.append("DELETE")
        return JSONResponse({"error": {"message": "no such schema", "type": "invalid_request_error",
                                       "param": "name", "code": "schema_not_found"}}, status_code=404)


def _gateway(urls: list[str], tmp_path) -> _Gateway:
    db_url = default_db_url(tmp_path)
    upgrade(db_url)
    replicas = tuple(ReplicaSpec(url, f"r{i}") for i, url in enumerate(urls))
    return _Gateway(GatewaySettings(upstream=urls[0], secret=SECRET, db_url=db_url, data_dir=tmp_path,
                                    upstream_api_key=KEY, replicas=replicas))


def _registry(live) -> Any:
    return live.server.config.app.state.handler.prompt_modules.registry


def test_pml_prompts_of_one_schema_go_to_one_replica(tiny_engine, tmp_path):
    names = [f"s{i}" for i in range(5)]  # odd: round robin alone would split each schema
    with serve(tiny_engine, api_key=KEY) as r0, serve(tiny_engine, api_key=KEY) as r1:
        gateway = _gateway([r0.base_url, r1.base_url], tmp_path)
        with gateway as url:
            with httpx.Client(base_url=url, timeout=60, headers={"authorization": f"Bearer {ALICE}"}) as http:
                for name in names:
                    assert http.post("/v1/prompt_schemas", json={"pml": schema(name)}).status_code == 200
            usage = [list(_registry(r).owner_usage().values()) for r in (r0, r1)]
            assert usage[0] == usage[1] and usage[0][0][0] == 1  # both replicas hold the tenant's one namespace
            sdk = openai.OpenAI(base_url=url + "/v1", api_key=ALICE, max_retries=0, timeout=120)
            for i, name in enumerate(names * 2):  # markup too short to share a block: no prefix to follow
                sdk.completions.create(model=tiny_engine.model_id, max_tokens=1, extra_body={"prompt_format": "pml"},
                                       prompt=f'<prompt schema="{name}"><doc/>Q{i}?</prompt>')
            db = create_db_engine(gateway.server.config.app.state.gateway.settings.db_url)

            def rows() -> list[Any]:
                with db.connect() as connection:
                    return connection.execute(select(request_log.c.replica, request_log.c.status).order_by(request_log.c.id)).all()

            wait_until(lambda: len(rows()) == 2 * len(names), 30, "one stats row per completion")
            db.dispose()
    assert {status for _, status in rows()} == {200}
    # Requests were sent schema by schema in order, so row i is names[i % 5].
    by_schema = {name: {rows()[i].replica, rows()[i + len(names)].replica} for i, name in enumerate(names)}
    assert all(len(replicas) == 1 for replicas in by_schema.values()), by_schema
    assert Counter(next(iter(r)) for r in by_schema.values()).keys() == {"r0", "r1"}, by_schema


@pytest.mark.parametrize("fault", ["refuses", "unreachable"])
def test_a_refused_registration_is_rolled_back_on_the_replicas_that_accepted_it(tiny_engine, tmp_path, fault):
    fake = RefusingReplica()
    with serve(tiny_engine, api_key=KEY) as real, _served(fake.app) as fake_url:
        if fault == "unreachable":
            probe = socket.socket()
            probe.bind(("127.0.0.1", 0))
            fake_url = f"http://127.0.0.1:{probe.getsockname()[1]}"  # bound, not listening: refused
        else:
            probe = None
        gateway = _gateway([real.base_url, fake_url], tmp_path)
        try:
            with gateway as url, httpx.Client(base_url=url, timeout=60,
                                              headers={"authorization": f"Bearer {ALICE}"}) as http:
                answer = http.post("/v1/prompt_schemas", json={"pml": schema("rag")})
                error = answer.json()["error"]
                if fault == "refuses":
                    assert answer.status_code == 429 and error["code"] == "schema_store_full", answer.text
                    assert fake.calls == ["POST"]
                else:
                    assert answer.status_code == 503, answer.text
                assert set(error) == {"message", "type", "param", "code"}
                # The real replica accepted it, then deleted it again: nothing is left anywhere.
                registry = _registry(real)
                assert registry.total_tokens == 0 and registry.owner_usage() == {}
                registry.check_integrity()
                assert http.get("/v1/prompt_schemas").json()["data"] == []
                state = gateway.server.config.app.state.gateway
                state.schema_quota.check_integrity()
                assert state.schema_quota.namespaces(state.authenticator.tenant_for(f"Bearer {ALICE}").name) == 0
        finally:
            if probe is not None:
                probe.close()
