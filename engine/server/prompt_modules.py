"""PromptModules: the engine server's PML routes and the SegmentedPrompts of generation requests.

Routes (each scoped to a cache salt, the tenant's namespace; see
:mod:`engine.promptcache.schema_registry`):

* ``POST /v1/prompt_schemas`` ``{"pml": "<schema name=...>...</schema>", "cache_salt": ...}``
  compiles and registers a schema (replacing one of the same name) and answers
  ``{"object": "prompt_schema", "name", "tokens", "modules": [{"name", "tokens"}, ...]}``;
* ``GET /v1/prompt_schemas?cache_salt=...`` lists the salt's schemas;
* ``DELETE /v1/prompt_schemas/{name}?cache_salt=...`` removes one (404 when the salt has none).

Generation requests (called by :class:`~engine.server.request_handler.RequestHandler`):

* ``/v1/completions`` with ``"prompt_format": "pml"`` compiles ``prompt`` (a
  ``<prompt schema=...>``) against the request salt's schemas;
* ``/v1/chat/completions`` with ``"segment_reuse": true`` (default: the server's
  ``--segment-reuse``) cuts the rendered prompt into document segments
  (:mod:`engine.promptcache.segment_reuse`);
* both take ``"recovery": {"mode": "none"|"epic"|"cacheblend", "first_tokens", "last_tokens", "fraction"}``
  (default :class:`~engine.promptcache.segments.Recovery`).

Every client mistake is an :class:`~engine.contract.errors.APIError` 4xx: a PML
error names its line and column (``code: "invalid_pml"``), a full registry is 429
``schema_store_full`` or 400 ``schema_limit``. The registry shares its engine-wide
bounds fairly between the tenants the gateway names in ``x-prefixgate-tenant``
(see :mod:`engine.promptcache.schema_registry`).
"""

from __future__ import annotations

import threading
from typing import Any

import orjson
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from engine.contract import errors
from engine.contract.body_reader import TENANT_HEADER, BodyReader
from engine.contract.errors import APIError
from engine.contract.limits import cache_salt_problem
from engine.promptcache.pml_compiler import PmlCompiler, PmlLimits
from engine.promptcache.pml_schema import CompiledSchema
from engine.promptcache.pml_syntax import MAX_PML_CHARS, PmlError
from engine.promptcache.schema_registry import RegistryFull, SchemaRegistry
from engine.promptcache.segment_reuse import chat_documents, segment_chat
from engine.promptcache.segments import Recovery, SegmentedPrompt

PROMPT_FORMATS = ("text", "pml")


def _pml_error(exc: PmlError, param: str) -> APIError:
    return errors.invalid_param(str(exc), param, "invalid_pml")


def _salt(value: object) -> str | None:
    if value is None:
        return None
    problem = cache_salt_problem(value)
    if problem is not None:
        raise errors.invalid_param(problem, "cache_salt")
    assert isinstance(value, str)
    return value


def _schema_json(schema: CompiledSchema) -> dict[str, Any]:
    return {"object": "prompt_schema", "name": schema.name, "tokens": schema.total_tokens,
            "modules": [{"name": m.path, "tokens": m.tokens} for m in schema.modules()]}


def parse_recovery(value: object) -> Recovery:
    """The ``recovery`` field of a generation request (None: the default)."""
    if value is None:
        return Recovery()
    if not isinstance(value, dict):
        raise errors.invalid_param("'recovery' must be an object {\"mode\": ...}.", "recovery", "invalid_type")
    unknown = sorted(set(value) - {"mode", "first_tokens", "last_tokens", "fraction"})
    if unknown:
        raise errors.invalid_param(f"'recovery' has no field {unknown[0]!r}.", "recovery")
    default = Recovery()
    counts = {"first_tokens": value.get("first_tokens", default.first_tokens),
              "last_tokens": value.get("last_tokens", default.last_tokens)}
    for name, count in counts.items():
        if isinstance(count, bool) or not isinstance(count, int) or not 0 <= count <= 1 << 20:
            raise errors.invalid_param(f"'recovery.{name}' must be an integer in [0, {1 << 20}].",
                                       f"recovery.{name}")
    fraction = value.get("fraction", default.fraction)
    if isinstance(fraction, bool) or not isinstance(fraction, int | float):
        raise errors.invalid_param("'recovery.fraction' must be a number.", "recovery.fraction")
    try:
        return Recovery(value.get("mode", default.mode), counts["first_tokens"], float(fraction),
                        counts["last_tokens"])
    except ValueError as exc:
        raise errors.invalid_param(str(exc), "recovery") from None


class PromptModules:
    """The PML compiler and schema registry of one engine server (see the module docstring)."""

    def __init__(self, tokenizer: Any, max_model_len: int, bodies: BodyReader, *,
                 segment_reuse: bool = False, registry: SchemaRegistry | None = None,
                 tokenizer_lock: threading.Lock | None = None) -> None:
        """``tokenizer_lock``: the lock the server's other tokenizer users hold
        (:attr:`engine.contract.chat.ChatRenderer.lock`)."""
        self.tokenizer = tokenizer
        self.tokenizer_lock = tokenizer_lock or threading.Lock()
        self.compiler = PmlCompiler(tokenizer, PmlLimits(max_param_tokens=max_model_len), self.tokenizer_lock)
        self.registry = registry or SchemaRegistry()
        self.bodies = bodies
        self.segment_reuse_default = segment_reuse

    # ----------------------------------------------------------------- routes
    async def create_schema(self, request: Request) -> Response:
        tenant = request.headers.get(TENANT_HEADER)
        with self.bodies.lease(tenant or "") as lease:
            raw = await self.bodies.read(request, lease)
            schema, salt = await run_in_threadpool(self._compile, raw)
        try:
            self.registry.put(salt, schema, tenant)
        except RegistryFull as exc:
            if exc.per_salt:
                raise errors.invalid_param(str(exc), "pml", "schema_limit") from None
            raise APIError(429, str(exc), code="schema_store_full") from None
        return JSONResponse(_schema_json(schema))

    def _compile(self, raw: bytes) -> tuple[CompiledSchema, str | None]:
        try:
            body = orjson.loads(raw)
        except orjson.JSONDecodeError as exc:
            raise errors.malformed_json(str(exc)) from exc
        if not isinstance(body, dict):
            raise errors.invalid_param("The request body must be a JSON object.", None, "invalid_json")
        pml = body.get("pml")
        if not isinstance(pml, str) or not pml:
            raise errors.invalid_param("'pml' must be a non-empty string holding a <schema>.", "pml")
        if len(pml) > MAX_PML_CHARS:
            raise errors.invalid_param(f"'pml' has more than {MAX_PML_CHARS} characters.", "pml")
        salt = _salt(body.get("cache_salt"))
        try:
            return self.compiler.schema(pml), salt
        except PmlError as exc:
            raise _pml_error(exc, "pml") from None

    async def list_schemas(self, request: Request) -> Response:
        salt = _salt(request.query_params.get("cache_salt"))
        return JSONResponse({"object": "list", "data": [_schema_json(s) for s in self.registry.list(salt)]})

    async def delete_schema(self, request: Request) -> Response:
        salt = _salt(request.query_params.get("cache_salt"))
        name = request.path_params["name"]
        if not self.registry.delete(salt, name):
            raise APIError(404, f"No prompt schema named {name[:80]!r}.", param="name", code="schema_not_found")
        return JSONResponse({"object": "prompt_schema.deleted", "name": name, "deleted": True})

    # ---------------------------------------------------- generation requests
    def completion_prompt(self, raw: dict[str, Any], prompt: object, salt: str | None) -> SegmentedPrompt | None:
        """The SegmentedPrompt of a completion body with ``"prompt_format": "pml"``, None for text."""
        fmt = raw.get("prompt_format")
        if fmt is None or fmt == "text":
            if raw.get("recovery") is not None:
                raise errors.invalid_param("'recovery' needs \"prompt_format\": \"pml\".", "recovery")
            return None
        if fmt not in PROMPT_FORMATS:
            raise errors.invalid_param(f"'prompt_format' must be one of {', '.join(PROMPT_FORMATS)}, got {fmt!r:.40}.",
                                       "prompt_format")
        if not isinstance(prompt, str):
            raise errors.invalid_param("With \"prompt_format\": \"pml\", 'prompt' must be a <prompt> string.",
                                       "prompt")
        recovery = parse_recovery(raw.get("recovery"))
        try:
            return self.compiler.prompt(prompt, lambda name: self.registry.get(salt, name), recovery)
        except PmlError as exc:
            raise _pml_error(exc, "prompt") from None

    def chat_prompt(self, raw: dict[str, Any], messages: list[dict[str, Any]], text: str | None,
                    token_ids: list[int]) -> SegmentedPrompt | None:
        """The chat request's document segments when segment reuse is on for it, else None."""
        wanted = raw.get("segment_reuse")
        if wanted is not None and not isinstance(wanted, bool):
            raise errors.invalid_param("'segment_reuse' must be a boolean.", "segment_reuse", "invalid_type")
        on = self.segment_reuse_default if wanted is None else wanted
        recovery = parse_recovery(raw.get("recovery"))
        if not on and raw.get("recovery") is not None:
            raise errors.invalid_param("'recovery' needs \"segment_reuse\": true.", "recovery")
        if not on or not text:
            return None
        with self.tokenizer_lock:
            return segment_chat(self.tokenizer, text, token_ids, chat_documents(messages), recovery)
