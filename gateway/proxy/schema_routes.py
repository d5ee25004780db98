"""PromptSchemaRoutes: the PML schema routes, forwarded under the tenant's server-side salt.

``POST /v1/prompt_schemas``, ``GET /v1/prompt_schemas`` and
``DELETE /v1/prompt_schemas/{name}`` (see :mod:`engine.server.prompt_modules`).
The engine keeps schemas per cache salt; the gateway authenticates the tenant,
takes out whatever ``cache_salt`` the client sent and sends the salt it derives
for the tenant's scope (:func:`gateway.policy.salt.derive_cache_salt`, the same one
its completions carry, so a ``<prompt schema=...>`` finds the tenant's schemas).
A client salt only narrows the tenant's own namespace, exactly as for completions:
another tenant can neither use, list, delete nor time a schema, whatever it sends.

A schema is registered on, and deleted from, every replica (a prompt may be routed
to any). Registration is all or nothing: when a replica refuses (or cannot be
reached), the schema is deleted again from the replicas that had accepted it and
the refusal is relayed (a schema it replaced there is then gone on those replicas
too: the client retries or registers again). A tenant may hold schemas under at
most ``quota.max_namespaces`` client salts, checked before any replica is asked,
and at most ``quota.max_tokens`` module tokens, checked on the answer (a
registration past them is rolled back the same way; see
:mod:`gateway.policy.schema_quota`). Each registered schema's size goes to the
router (:mod:`gateway.routing.schema_affinity`). Listing asks the first replica.
Only an upstream of kind ``vllm`` with prompt modules (prefixgate's engine) serves these
routes; other kinds answer 404 ``not_supported``. Not inference: no stats row.
"""

from __future__ import annotations

import logging
from typing import Any
from urllib.parse import quote

import orjson
from starlette.requests import Request
from starlette.responses import Response

from engine.contract.body_reader import BodyReader
from engine.contract.limits import cache_salt_problem
from gateway.config.config_file import Tenant
from gateway.errors import GatewayError, InvalidRequest, NotFound, UpstreamError
from gateway.policy.authenticator import Authenticator
from gateway.policy.salt import derive_cache_salt
from gateway.policy.schema_quota import SchemaQuota
from gateway.proxy.request_body import read_body
from gateway.routing.replicas import Replica, ReplicaSet

log = logging.getLogger(__name__)

PATH = "/v1/prompt_schemas"


def _json(payload: Any) -> Response:
    return Response(orjson.dumps(payload), media_type="application/json")


def _client_salt(value: object) -> str | None:
    if value is None:
        return None
    problem = cache_salt_problem(value)
    if problem is not None:
        raise InvalidRequest(problem, param="cache_salt")
    assert isinstance(value, str)
    return value


class PromptSchemaRoutes:
    def __init__(self, replicas: ReplicaSet, authenticator: Authenticator, secret: bytes,
                 bodies: BodyReader, quota: SchemaQuota | None = None) -> None:
        self.replicas = replicas
        self.authenticator = authenticator
        self.secret = secret
        self.bodies = bodies
        self.quota = quota or SchemaQuota()

    def _tenant(self, request: Request) -> Tenant:
        tenant = self.authenticator.tenant_for(request.headers.get("authorization"))
        if self.replicas.kind != "vllm":
            raise NotFound(f"prompt schemas need a prefixgate engine upstream (this one is {self.replicas.kind})",
                           code="not_supported")
        return tenant

    def _salt(self, tenant: Tenant, client_salt: str | None) -> dict[str, str]:
        salt = derive_cache_salt(self.secret, tenant.scope, client_salt)
        return {} if salt is None else {"cache_salt": salt}

    async def create(self, request: Request) -> Response:
        tenant = self._tenant(request)
        with self.bodies.lease(tenant.name) as lease:
            raw = await read_body(request, self.bodies, lease)
        try:
            body = orjson.loads(raw)
        except orjson.JSONDecodeError as exc:
            raise InvalidRequest(f"the request body is not valid JSON: {exc}", code="invalid_json") from None
        if not isinstance(body, dict):
            raise InvalidRequest("the request body must be a JSON object", code="invalid_json")
        client_salt = _client_salt(body.pop("cache_salt", None))
        salt = self._salt(tenant, client_salt)
        content = orjson.dumps({**body, **salt})
        with self.quota.registering(tenant.name, client_salt):
            accepted: list[tuple[Replica, dict[str, Any]]] = []
            try:
                for replica in self.replicas.replicas:
                    accepted.append((replica, await replica.upstream.call("POST", PATH, content=content,
                                                                          tenant=tenant.name)))
                answer = accepted[0][1]
                name, tokens = answer.get("name"), answer.get("tokens")
                if not isinstance(name, str) or isinstance(tokens, bool) or not isinstance(tokens, int):
                    raise UpstreamError("the upstream's prompt schema answer has no name and tokens")
                self.quota.registered(tenant.name, client_salt, name, tokens)
            except GatewayError:
                await self._roll_back(accepted, salt, tenant)
                raise
        self.replicas.affinity.registered(salt.get("cache_salt"), name, tokens)
        return _json(answer)

    async def _roll_back(self, accepted: list[tuple[Replica, dict[str, Any]]], params: dict[str, str],
                         tenant: Tenant) -> None:
        """Delete the schema again from the replicas that accepted it (best effort: logged)."""
        for replica, answer in accepted:
            name = answer.get("name")
            if not isinstance(name, str):
                continue
            try:
                await replica.upstream.call("DELETE", f"{PATH}/{quote(name, safe='')}", params=params,
                                            tenant=tenant.name)
            except GatewayError as exc:
                log.warning("replica %s keeps prompt schema %r of tenant %s after a refused registration: %s",
                            replica.name, name[:80], tenant.name, exc)

    async def list_schemas(self, request: Request) -> Response:
        tenant = self._tenant(request)
        params = self._salt(tenant, _client_salt(request.query_params.get("cache_salt")))
        return _json(await self.replicas.replicas[0].upstream.call("GET", PATH, params=params, tenant=tenant.name))

    async def delete(self, request: Request) -> Response:
        tenant = self._tenant(request)
        client_salt = _client_salt(request.query_params.get("cache_salt"))
        params = self._salt(tenant, client_salt)
        name = request.path_params["name"]
        self.quota.deleted(tenant.name, client_salt, name)
        self.replicas.affinity.deleted(params.get("cache_salt"), name)
        path = f"{PATH}/{quote(name, safe='')}"
        answers = [await replica.upstream.call("DELETE", path, params=params, tenant=tenant.name)
                   for replica in self.replicas.replicas]
        return _json(answers[0])
