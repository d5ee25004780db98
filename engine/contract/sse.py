"""Server-sent events as the OpenAI APIs frame them: ``data: <json>`` and a blank line,
with an ``event: <type>`` line first for the Responses API's typed events, and chat's
stream ending in ``data: [DONE]``. The one writer of the engine's streams and of the
events the gateway adds or rewrites in a relayed stream.
"""

from __future__ import annotations

from typing import Any

import orjson

DONE = b"[DONE]"
SSE_DONE = b"data: " + DONE + b"\n\n"


def sse_event(payload: dict[str, Any], event: str | None = None) -> bytes:
    """One event: ``data: <compact JSON>`` and a blank line, after ``event: <event>`` when given."""
    data = b"data: " + orjson.dumps(payload) + b"\n\n"
    return data if event is None else b"event: " + event.encode() + b"\n" + data
