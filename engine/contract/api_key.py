"""ApiKeyGuard: the engine's bearer-key check (``prefixgate engine --api-key``, like vLLM's).

With a key, every request except ``GET /health`` (the readiness probe, which
says nothing about prompts) must carry ``Authorization: Bearer <key>``; anything
else is a 401 in OpenAI's shape (``authentication_error``, ``invalid_api_key``)
before the body is read. Inference routes, ``/v1/models`` and ``/metrics`` (whose
prefix-cache counters reveal other clients' hits) are all behind it. The key is
compared in constant time. Without a key the guard is not installed and the
engine is open, as vLLM is without ``--api-key``: bind it to loopback, or put the
gateway in front with a key (``prefixgate serve`` always does).

The key may come from ``--api-key`` or, better (a command line is readable by
every local user in ``/proc``), from :data:`API_KEY_ENV`.
"""

from __future__ import annotations

import hmac

from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Receive, Scope, Send

from engine.contract.errors import APIError

API_KEY_ENV = "PREFIXGATE_ENGINE_API_KEY"
OPEN_PATHS = frozenset({"/health"})


class ApiKeyGuard:
    """ASGI middleware refusing HTTP requests without the bearer ``api_key``."""

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        if not api_key:
            raise ValueError("the engine API key must be a non-empty string")
        self.app = app
        self.expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in OPEN_PATHS or self._authorized(scope):
            await self.app(scope, receive, send)
            return
        error = APIError(401, "A valid 'Authorization: Bearer <key>' header is required.",
                         type="authentication_error", code="invalid_api_key")
        response = JSONResponse(error.to_dict(), status_code=401, headers={"www-authenticate": "Bearer"})
        await response(scope, receive, send)

    def _authorized(self, scope: Scope) -> bool:
        for name, value in scope["headers"]:
            if name == b"authorization":
                return hmac.compare_digest(value, self.expected)
        return False
