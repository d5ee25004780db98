"""Reading a server-sent event stream the way a client does (the writer is
:mod:`engine.contract.sse`): events are separated by a blank line."""

from __future__ import annotations

import json
from typing import Any, TypeVar

T = TypeVar("T", str, bytes)


def sse_events(raw: T) -> list[T]:
    """The stream's events (each ``data: ...`` with its ``event:`` line, if any), in order."""
    separator = b"\n\n" if isinstance(raw, bytes) else "\n\n"
    return [event for event in raw.split(separator) if event.strip()]  # type: ignore[arg-type]


def sse_data(raw: str | bytes) -> list[dict[str, Any]]:
    """The JSON payload of every event's ``data:`` line, ``[DONE]`` left out."""
    text = raw.decode() if isinstance(raw, bytes) else raw
    out = []
    for event in sse_events(text):
        for line in event.split("\n"):
            if line.startswith("data: ") and line[len("data: "):].strip() != "[DONE]":
                out.append(json.loads(line[len("data: "):]))
    return out
