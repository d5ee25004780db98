"""Relays an upstream SSE stream to the client event by event.

Events are forwarded byte for byte unless one of these applies:

- the gateway asked the upstream for usage the client did not request
  (``strip_usage``): the usage-only chunk (``choices == []``) is dropped and a
  ``"usage": null`` field is removed from the other chunks, so the client sees the
  stream it asked for while the stats still get token counts;
- prefix warnings are attached as ``prefix_warnings`` to the final chunk the
  client sees: the usage chunk when the client asked for usage, otherwise the
  chunk carrying a ``finish_reason``; if neither arrives, one extra chunk with
  ``choices: []`` holding them is sent before ``data: [DONE]``.

Usage and the time of the first event are copied into the request record (for
a Responses stream, from the ``response`` of its final ``response.completed`` or
``response.incomplete`` event, which also ends it as ``data: [DONE]`` ends the
others; its prefix warnings travel in the header only).

A stream the gateway cannot vouch for is ended, not relayed: a ``data:`` payload
that is not a JSON object (nor ``[DONE]``), an ``{"error": ...}`` event from the
upstream, or an event growing past :data:`MAX_EVENT_BYTES` without its blank
line. :meth:`SseRelay.feed` then returns the events before it, forwards nothing
after it, and keeps the failure (a :class:`~gateway.errors.GatewayError`: an
:class:`~gateway.errors.InvalidRequest` when the upstream's error says
``invalid_request_error``, else an :class:`~gateway.errors.UpstreamError`) for
:meth:`SseRelay.raise_failure`, which the stream calls after sending each batch.
The client then gets one error event, :meth:`SseRelay.error_events`, in the
stream's own shape: for chat and completions ``data: {"error": ...}`` followed by
``data: [DONE]`` (as vLLM and the engine end a failed stream); for Responses an
``event: error`` (``{"type": "error", "code", "message", "param",
"sequence_number"}``) and nothing after it. A Responses ``error`` event from the
upstream is itself an ending: it is relayed as sent, nothing is appended, and
the row takes its status from it (:attr:`SseRelay.ended_by`).
"""

from __future__ import annotations

import re
from typing import Any

import orjson

from engine.contract.sse import DONE, SSE_DONE, sse_event
from gateway.errors import GatewayError, InvalidRequest, UpstreamError
from gateway.request_record import RequestRecord

RESPONSES_END = ("response.completed", "response.incomplete", "response.failed")
MAX_EVENT_BYTES = 8 * 1024 * 1024
_HAS_FINISH = re.compile(rb'"finish_reason"\s*:(?!\s*null)')
_SEQUENCE = re.compile(rb'"sequence_number"\s*:\s*(\d+)')
# The engine's codes for its own failures; any other error code is the request's fault.
SERVER_CODES = (None, "engine_error", "engine_unavailable", "server_error")


class SseRelay:
    def __init__(
        self, record: RequestRecord, *, strip_usage: bool, warnings: list[dict[str, Any]] | None
    ) -> None:
        self.record = record
        self.strip_usage = strip_usage
        self.warnings = warnings or None
        self.saw_done = False
        self.failure: GatewayError | None = None
        self.ended_by: GatewayError | None = None  # a Responses error event that ended the stream
        self.responses = record.endpoint == "responses"
        self._next_sequence = 0
        self.final_response: dict[str, Any] | None = None  # a Responses stream's completed response
        self._buffer = b""

    def feed(self, data: bytes) -> list[bytes]:
        """Bytes to send to the client for an upstream chunk (possibly none)."""
        self._buffer += data.replace(b"\r\n", b"\n") if b"\r" in data else data
        out: list[bytes] = []
        while self.failure is None:
            end = self._buffer.find(b"\n\n")
            if end < 0:
                if len(self._buffer) > MAX_EVENT_BYTES:
                    self.failure = UpstreamError(f"upstream sent an SSE event over {MAX_EVENT_BYTES} bytes")
                break
            event, self._buffer = self._buffer[: end + 2], self._buffer[end + 2 :]
            out.extend(self._event(event))
        return out

    def finish(self) -> list[bytes]:
        """Bytes for the end of the upstream stream (a trailing partial event)."""
        out = self._event(self._buffer + b"\n\n") if self._buffer.strip() and self.failure is None else []
        self._buffer = b""
        return out

    def raise_failure(self) -> None:
        """Raise the failure that ended the relay, if any (after its earlier events were sent)."""
        if self.failure is not None:
            raise self.failure

    def error_events(self, error: GatewayError) -> list[bytes]:
        """The events that end this stream with ``error`` (see the module docstring)."""
        body = error.to_dict()
        if not self.responses:
            return [sse_event(body), SSE_DONE]
        fields = body["error"]
        payload = {"type": "error", "sequence_number": self._next_sequence, "code": fields["code"],
                   "message": fields["message"], "param": fields["param"]}
        return [sse_event(payload, "error")]

    def _event(self, event: bytes) -> list[bytes]:
        self.record.mark_first_byte()
        if self.ended_by is not None:  # nothing follows a Responses error event
            return []
        data = _data_of(event)
        if data is None:
            return [event]
        if self.responses:
            sequence = _SEQUENCE.search(data)
            if sequence is not None:
                self._next_sequence = int(sequence[1]) + 1
        if data.strip() == DONE:
            self.saw_done = True
            return [*self._pending_warnings(), event]
        try:
            chunk = orjson.loads(data)
        except orjson.JSONDecodeError as exc:
            self.failure = UpstreamError(f"upstream sent an SSE event that is not JSON: {exc}")
            return []
        if not isinstance(chunk, dict):
            self.failure = UpstreamError("upstream sent an SSE event that is not a JSON object")
            return []
        if "error" in chunk:
            error = chunk["error"]
            if isinstance(error, dict) and error.get("type") == "invalid_request_error":
                self.failure = InvalidRequest(str(error.get("message")), param=_str(error.get("param")),
                                              code=_str(error.get("code")))
            else:
                detail = error.get("message") if isinstance(error, dict) else error
                self.failure = UpstreamError(f"upstream failed mid-stream: {detail}")
            return []
        if self.responses and chunk.get("type") == "error":
            self.ended_by = _responses_error(chunk)
            self.saw_done = True
            return [event]
        if not self._may_matter(data):
            return [event]
        return self._chunk(chunk, event)

    def _may_matter(self, data: bytes) -> bool:
        """False when the chunk surely needs no rewrite: no usage, and no finish
        reason while warnings still wait for the final chunk (a cheap byte test
        that keeps plain content chunks forwarded byte for byte)."""
        if b'"usage"' in data:
            return True
        return bool(self.warnings) and _HAS_FINISH.search(data) is not None

    def _chunk(self, chunk: dict[str, Any], event: bytes) -> list[bytes]:
        usage = chunk.get("usage")
        response = chunk.get("response")
        if isinstance(response, dict) and isinstance(response.get("usage"), dict):
            self.record.take_usage(response["usage"])  # a Responses event: relayed as sent
            if chunk.get("type") in RESPONSES_END:  # a Responses stream has no [DONE]
                self.saw_done = True
                if chunk["type"] != "response.failed":
                    self.final_response = response
            return [event]
        choices = chunk.get("choices")
        is_usage_chunk = isinstance(usage, dict) and choices == []
        if isinstance(usage, dict):
            self.record.take_usage(usage)
        changed = False
        if self.strip_usage:
            if is_usage_chunk:
                return []
            if "usage" in chunk and usage is None:
                del chunk["usage"]
                changed = True
        if self.warnings and self._is_final(chunk, is_usage_chunk):
            chunk["prefix_warnings"] = self.warnings
            self.warnings = None
            changed = True
        if not changed:
            return [event]
        return [sse_event(chunk)]

    def _is_final(self, chunk: dict[str, Any], is_usage_chunk: bool) -> bool:
        if not self.strip_usage:
            return is_usage_chunk
        choices = chunk.get("choices")
        return isinstance(choices, list) and any(
            isinstance(choice, dict) and choice.get("finish_reason") for choice in choices
        )

    def _pending_warnings(self) -> list[bytes]:
        if not self.warnings:
            return []
        chunk = {"object": "chat.completion.chunk", "choices": [], "prefix_warnings": self.warnings}
        self.warnings = None
        return [sse_event(chunk)]


def _data_of(event: bytes) -> bytes | None:
    """The joined ``data:`` lines of one SSE event, or None if it has none."""
    parts = [line[5:].lstrip(b" ") for line in event.split(b"\n") if line.startswith(b"data:")]
    if not parts:
        return None
    return b"\n".join(parts)


def _str(value: object) -> str | None:
    return value if isinstance(value, str) else None


def _responses_error(event: dict[str, Any]) -> GatewayError:
    """The row's error for a Responses ``error`` event (the event itself is relayed)."""
    code, message = _str(event.get("code")), str(event.get("message"))
    if code in SERVER_CODES:
        return UpstreamError(f"upstream failed mid-stream: {message}")
    return InvalidRequest(message, param=_str(event.get("param")), code=code)
