"""APIError: every client-visible failure of the engine server, in OpenAI's error shape.

The server translates errors at one boundary (``engine.server.app``): parsing,
validation, chat rendering and image decoding raise :class:`APIError` (or
``ValueError``, which the boundary maps to a 400), and only the boundary turns it
into a response body ``{"error": {"message", "type", "param", "code"}}``.

Invariant: a client mistake is always a 4xx with ``type`` ``invalid_request_error``;
5xx is reserved for faults of the engine itself (``server_error``).
"""

from __future__ import annotations

from typing import Any

INVALID_REQUEST = "invalid_request_error"
SERVER_ERROR = "server_error"


class APIError(Exception):
    """An error with an HTTP status and the four fields of OpenAI's error object."""

    def __init__(
        self,
        status_code: int,
        message: str,
        *,
        type: str = INVALID_REQUEST,
        param: str | None = None,
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status_code = status_code
        self.message = message
        self.type = type
        self.param = param
        self.code = code

    def to_dict(self) -> dict[str, Any]:
        """The response body: ``{"error": {"message", "type", "param", "code"}}``."""
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }

    def __repr__(self) -> str:
        return f"APIError({self.status_code}, {self.message!r}, param={self.param!r}, code={self.code!r})"


def invalid_param(message: str, param: str | None, code: str | None = "invalid_value") -> APIError:
    """A 400 for a request field with a bad type, range or combination."""
    return APIError(400, message, param=param, code=code)


def unsupported_param(message: str, param: str) -> APIError:
    """A 400 for a well-formed field this engine does not implement."""
    return APIError(400, message, param=param, code="unsupported_parameter")


def model_not_found(model: str, served: str) -> APIError:
    return APIError(
        404,
        f"The model {model!r} does not exist; this engine serves {served!r}.",
        param="model",
        code="model_not_found",
    )


def context_length_exceeded(message: str, param: str | None = "messages") -> APIError:
    return APIError(400, message, param=param, code="context_length_exceeded")


def malformed_json(detail: str) -> APIError:
    return APIError(
        400,
        f"The request body is not valid JSON: {detail}",
        code="invalid_json",
    )


def body_too_large(limit: int) -> APIError:
    return APIError(
        413,
        f"The request body exceeds the limit of {limit} bytes.",
        code="request_too_large",
    )


def not_found(path: str) -> APIError:
    return APIError(404, f"No route for {path!r}.", code="not_found")


def method_not_allowed(method: str, path: str) -> APIError:
    return APIError(405, f"Method {method} is not allowed on {path!r}.", code="method_not_allowed")


def engine_failure(message: str) -> APIError:
    return APIError(500, message, type=SERVER_ERROR, code="engine_error")


def engine_unavailable(message: str) -> APIError:
    return APIError(503, message, type=SERVER_ERROR, code="engine_unavailable")
