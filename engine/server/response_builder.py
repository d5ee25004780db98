"""ResponseBuilder: the OpenAI-shaped JSON bodies and SSE chunks of one request.

One builder per request fixes the id, the creation time and the served model name,
so every chunk of a stream carries the same three. Invariants:

* ``usage.prompt_tokens_details.cached_tokens`` is always present, 0 included;
* a stream is: one chunk per text delta (for chat, the first carries the role),
  a final chunk with the ``finish_reason``, then, only when the client asked for
  ``stream_options.include_usage``, a chunk with empty ``choices`` and the usage;
  while usage is requested every other chunk has ``"usage": null``, as OpenAI does.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass
from typing import Any

import orjson


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int

    def to_dict(self) -> dict[str, Any]:
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.prompt_tokens + self.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": self.cached_tokens},
        }


def sse_event(payload: dict[str, Any]) -> bytes:
    """One server-sent event: ``data: <json>`` and a blank line."""
    return b"data: " + orjson.dumps(payload) + b"\n\n"


SSE_DONE = b"data: [DONE]\n\n"


class ResponseBuilder:
    """Builds the bodies of one chat (``kind="chat"``) or completion request."""

    def __init__(self, kind: str, model: str, *, include_usage: bool = False) -> None:
        assert kind in ("chat", "completion"), kind
        self.kind = kind
        self.model = model
        self.include_usage = include_usage
        prefix = "chatcmpl" if kind == "chat" else "cmpl"
        self.id = f"{prefix}-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self._sent_role = False

    # ---------------------------------------------------------------- full body
    def full(self, text: str, finish_reason: str, usage: Usage) -> dict[str, Any]:
        """The non-streaming response body."""
        if self.kind == "chat":
            choice: dict[str, Any] = {
                "index": 0,
                "message": {"role": "assistant", "content": text, "tool_calls": []},
                "logprobs": None,
                "finish_reason": finish_reason,
            }
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}
        return {**self._envelope(streaming=False), "choices": [choice], "usage": usage.to_dict()}

    # ------------------------------------------------------------------ chunks
    def delta(self, text: str) -> dict[str, Any]:
        """A chunk carrying ``text`` (for chat, the first one also carries the role)."""
        return self._chunk(text, None)

    def finish(self, finish_reason: str) -> dict[str, Any]:
        """The chunk that ends the choice; it carries no text."""
        return self._chunk("", finish_reason)

    def usage_chunk(self, usage: Usage) -> dict[str, Any]:
        """The last chunk when usage was requested: no choices, the usage."""
        return {**self._envelope(streaming=True), "choices": [], "usage": usage.to_dict()}

    # ----------------------------------------------------------------- private
    def _envelope(self, *, streaming: bool) -> dict[str, Any]:
        if self.kind == "chat":
            obj = "chat.completion.chunk" if streaming else "chat.completion"
        else:
            obj = "text_completion"
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    def _chunk(self, text: str, finish_reason: str | None) -> dict[str, Any]:
        if self.kind == "chat":
            delta: dict[str, Any] = {"content": text}
            if not self._sent_role:
                delta = {"role": "assistant", **delta}
                self._sent_role = True
            choice: dict[str, Any] = {
                "index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason,
            }
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}
        chunk = {**self._envelope(streaming=True), "choices": [choice]}
        if self.include_usage:
            chunk["usage"] = None
        return chunk
