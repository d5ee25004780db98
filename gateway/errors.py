"""Gateway error classes and their OpenAI-shaped JSON rendering.

Every failure the gateway reports is a :class:`GatewayError`, an
:class:`engine.contract.errors.APIError` (the one OpenAI error type, and its one
``{"error": {"message", "type", "param", "code"}}`` shape) whose status, type and code
are its class's defaults; the app turns it into a response at one place
(:func:`error_response`, the exception handler registered once on the app). Upstream transport failures (httpx exceptions) are
translated into these classes in :mod:`gateway.upstream.client` and nowhere else.
"""

from __future__ import annotations

from typing import Any

import orjson
from starlette.responses import Response

from engine.contract.errors import APIError


class GatewayError(APIError):
    """An :class:`APIError` whose status, type and code default to its class's; ``extra``
    adds top-level fields next to ``error`` (``prefix_warnings``)."""

    status: int = 500
    type: str = "server_error"
    code: str | None = None

    def __init__(
        self,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        extra: dict[str, Any] | None = None,
    ) -> None:
        super().__init__(self.status, message, type=self.type, param=param,
                         code=self.code if code is None else code)
        self.extra = extra or {}

    @property
    def status_code(self) -> int:
        """:attr:`status`, under the name the engine's APIError uses."""
        return self.status

    @status_code.setter
    def status_code(self, value: int) -> None:
        self.status = value

    def to_dict(self) -> dict[str, Any]:
        body = super().to_dict()
        body.update(self.extra)
        return body


class InvalidRequest(GatewayError):
    status = 400
    type = "invalid_request_error"
    code = "invalid_request"


class PrefixWarningRejected(InvalidRequest):
    code = "prefix_warning_rejected"


class Unauthorized(GatewayError):
    status = 401
    type = "authentication_error"
    code = "invalid_api_key"


class Forbidden(GatewayError):
    status = 403
    type = "permission_error"
    code = "forbidden"


class NotFound(GatewayError):
    status = 404
    type = "invalid_request_error"
    code = "not_found"


class PayloadTooLarge(GatewayError):
    status = 413
    type = "invalid_request_error"
    code = "request_too_large"


class UpstreamError(GatewayError):
    """The upstream answered with a server error or something that is not valid."""

    status = 502
    type = "upstream_error"
    code = "upstream_error"


class UpstreamUnavailable(GatewayError):
    """The upstream could not be reached (connection refused, reset, DNS)."""

    status = 503
    type = "upstream_error"
    code = "upstream_unavailable"


class UpstreamUnreachable(UpstreamUnavailable):
    """No connection to the upstream could be made: nothing of the request reached it,
    so another replica may take it (:mod:`gateway.routing.replicas`)."""


class UpstreamTimeout(GatewayError):
    status = 504
    type = "upstream_error"
    code = "upstream_timeout"


class UpstreamStalled(UpstreamTimeout):
    """The replica sent nothing for the idle timeout and did not answer a health probe
    (frozen or wedged): the request ends now instead of at the total timeout."""

    code = "upstream_stalled"


def error_response(error: GatewayError, headers: dict[str, str] | None = None) -> Response:
    """Render ``error`` as an OpenAI-shaped JSON response."""
    return Response(
        orjson.dumps(error.to_dict()),
        status_code=error.status,
        media_type="application/json",
        headers=headers,
    )
