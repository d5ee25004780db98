"""``GET /dashboard``: one HTML page with the hit rates, savings, warnings and slow requests.

No front-end build step: ``page.html`` (package data) holds the markup, the style
and a small script that draws SVG charts and tables from a JSON island the
server fills in (:func:`gateway.stats.dashboard.summary.summarize`, ``?hours=N``, default
one week). The page loads nothing else; a per-response nonce and a strict
Content-Security-Policy allow only its own script and style.

Access: open mode (no config) serves anyone who can reach the gateway, as every
other route does then; with a config, an admin key is required, either as
``Authorization: Bearer <key>`` or as the password of HTTP Basic authentication
(any user name), so a browser asks for it. A tenant key gets 403.
"""

from __future__ import annotations

import base64
import binascii
import secrets
from importlib import resources
from typing import Any

import anyio
import orjson
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from gateway.errors import GatewayError, InvalidRequest, error_response
from gateway.policy.authenticator import Authenticator
from gateway.stats.dashboard.summary import parse_hours, summarize

REALM = 'Basic realm="prefixgate dashboard", charset="UTF-8"'
_TEMPLATE: str | None = None


def page_template() -> str:
    global _TEMPLATE
    if _TEMPLATE is None:
        _TEMPLATE = resources.files(__package__).joinpath("page.html").read_text(encoding="utf-8")
    return _TEMPLATE


def bearer_from(authorization: str | None) -> str | None:
    """The header as a bearer header; a Basic header's password becomes the token."""
    if authorization is None:
        return None
    scheme, _, value = authorization.partition(" ")
    if scheme.lower() != "basic":
        return authorization
    try:
        decoded = base64.b64decode(value.strip(), validate=True).decode("utf-8")
    except (binascii.Error, UnicodeDecodeError):
        return None
    _, _, password = decoded.partition(":")
    return f"Bearer {password}" if password else None


def render(data: dict[str, Any]) -> tuple[str, str]:
    """The page with ``data`` embedded, and the nonce its script and style carry."""
    nonce = secrets.token_urlsafe(16)
    # "<" escaped so no string in the data can close the <script> element.
    island = orjson.dumps(data).decode("utf-8").replace("<", "\\u003c")
    html = page_template().replace("{{NONCE}}", nonce).replace("{{DATA}}", island)
    return html, nonce


def dashboard_route(state: Any) -> Route:
    """The route, bound to an app's ``GatewayState`` (settings, authenticator, writer, db)."""
    authenticator: Authenticator = state.authenticator

    async def dashboard(request: Request) -> Response:
        try:
            if not state.settings.open_mode:
                authenticator.require_admin(bearer_from(request.headers.get("authorization")))
            try:
                hours = parse_hours(request.query_params.get("hours"))
            except ValueError as exc:
                raise InvalidRequest(str(exc), param="hours") from None
        except GatewayError as error:
            headers = {"www-authenticate": REALM} if error.status == 401 else None
            return error_response(error, headers)
        await anyio.to_thread.run_sync(state.writer.flush, 30.0)
        data = await anyio.to_thread.run_sync(summarize, state.db_engine, state.settings.config, hours)
        html, nonce = render(data)
        csp = (f"default-src 'none'; script-src 'nonce-{nonce}'; style-src 'nonce-{nonce}'; "
               "img-src data:; base-uri 'none'; form-action 'none'; frame-ancestors 'none'")
        return Response(html, media_type="text/html; charset=utf-8", headers={
            "content-security-policy": csp, "cache-control": "no-store", "x-content-type-options": "nosniff",
        })

    return Route("/dashboard", dashboard, methods=["GET"])
