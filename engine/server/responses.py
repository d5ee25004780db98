"""The Responses API (``POST /v1/responses``), stateless: output shapes and stream events.

The request is translated by :func:`engine.contract.responses_request.to_chat_body`.

:class:`ResponsesBuilder` builds the ``response`` object and the stream's events:
``response.created``, ``response.in_progress``, then per output item
``response.output_item.added``, for a message ``response.content_part.added``,
``response.output_text.delta``..., ``response.output_text.done``,
``response.content_part.done``, for a function call
``response.function_call_arguments.delta`` and ``.done``, then
``response.output_item.done``; finally ``response.completed`` (or
``response.incomplete`` with ``incomplete_details.reason: "max_output_tokens"``),
or an ``error`` event when the request failed (the stream's last event). Every event
carries a ``sequence_number`` counting from 0. A stream holds the output items of
the non-streamed answer: one message item for the text, then one item per call.
``response.created`` and ``response.in_progress`` carry ``text.format`` without its
``schema``: the request's schema travels once, in the final ``response``.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from typing import Any

from engine.contract.sse import sse_event
from engine.core.output_stream import TokenLogprobs
from engine.server.response_builder import Usage


class ResponsesBuilder:
    """The ``response`` object and stream events of one Responses request."""

    def __init__(self, model: str, request: dict[str, Any],
                 token_text: Callable[[int], str] = str) -> None:
        self.model = model
        self.token_text = token_text
        self.id = f"resp_{uuid.uuid4().hex}"
        self.created_at = int(time.time())
        self.request = request
        self._seq = 0
        self._text = ""
        self._logprobs: list[dict[str, Any]] = []
        self._message_open = False
        self._output: list[dict[str, Any]] = []

    # ------------------------------------------------------------------- body
    def full(self, text: str, calls: list[dict[str, Any]], finish_reason: str,
             usage: Usage, logprobs: list[TokenLogprobs] | None = None) -> dict[str, Any]:
        items = ([self._message_item(text, "completed", self._entries(logprobs))]
                 if text or not calls else [])
        items += [self._call_item(c) for c in calls]
        return self._response(_status(finish_reason), items, usage)

    # ----------------------------------------------------------------- events
    def start(self) -> list[bytes]:
        body = self._response("in_progress", [], None, echo_schema=False)
        return [self._event("response.created", response=body),
                self._event("response.in_progress", response=body)]

    def text(self, delta: str, logprobs: list[TokenLogprobs] | None = None) -> list[bytes]:
        """Events for a text delta (opening the message item first if needed)."""
        events = []
        if not self._message_open:
            self._message_open = True
            self._message_id = f"msg_{uuid.uuid4().hex}"
            item = self._message_item("", "in_progress")
            item["content"] = []
            events += [self._event("response.output_item.added", output_index=len(self._output),
                                   item=item),
                       self._event("response.content_part.added", item_id=self._message_id,
                                   output_index=len(self._output), content_index=0,
                                   part=_text_part(""))]
        self._text += delta
        entries = self._entries(logprobs)
        self._logprobs += entries
        events.append(self._event("response.output_text.delta", item_id=self._message_id,
                                  output_index=len(self._output), content_index=0, delta=delta,
                                  logprobs=entries))
        return events

    def calls(self, calls: list[dict[str, Any]]) -> list[bytes]:
        """Events for whole tool calls, each its own item after the message (if any)."""
        if not calls:
            return []
        events = self._close_message()
        for call in calls:
            item = self._call_item(call)
            index = len(self._output)
            args = call["function"]["arguments"]
            events += [
                self._event("response.output_item.added", output_index=index,
                            item={**item, "arguments": "", "status": "in_progress"}),
                self._event("response.function_call_arguments.delta", item_id=item["id"],
                            output_index=index, delta=args),
                self._event("response.function_call_arguments.done", item_id=item["id"],
                            output_index=index, arguments=args),
                self._event("response.output_item.done", output_index=index, item=item),
            ]
            self._output.append(item)
        return events

    def finish(self, finish_reason: str, usage: Usage) -> list[bytes]:
        events = self._close_message()
        if not self._output:  # nothing generated at all: still one (empty) message
            events += self.text("") + self._close_message()
        status = _status(finish_reason)
        kind = "response.completed" if status == "completed" else "response.incomplete"
        return [*events, self._event(kind, response=self._response(status, self._output, usage))]

    def error(self, error: dict[str, Any]) -> bytes:
        """The ``error`` event that ends a stream the engine failed."""
        return self._event("error", code=error.get("code"), message=error.get("message"),
                           param=error.get("param"))

    # ---------------------------------------------------------------- private
    def _close_message(self) -> list[bytes]:
        if not self._message_open:
            return []
        self._message_open = False
        index = len(self._output)
        item = self._message_item(self._text, "completed", self._logprobs)
        events = [
            self._event("response.output_text.done", item_id=self._message_id, output_index=index,
                        content_index=0, text=self._text, logprobs=self._logprobs),
            self._event("response.content_part.done", item_id=self._message_id, output_index=index,
                        content_index=0, part=_text_part(self._text, self._logprobs)),
            self._event("response.output_item.done", output_index=index, item=item),
        ]
        self._output.append(item)
        self._text = ""
        self._logprobs = []
        return events

    def _message_item(self, text: str, status: str,
                      logprobs: list[dict[str, Any]] | None = None) -> dict[str, Any]:
        if not hasattr(self, "_message_id"):
            self._message_id = f"msg_{uuid.uuid4().hex}"
        return {"id": self._message_id, "type": "message", "role": "assistant", "status": status,
                "content": [_text_part(text, logprobs or [])]}

    def _entries(self, logprobs: list[TokenLogprobs] | None) -> list[dict[str, Any]]:
        """OpenAI's Responses logprobs entries: token, logprob, bytes, top_logprobs."""
        return [{**self._token(e.token_id, e.logprob),
                 "top_logprobs": [self._token(t, lp) for t, lp in e.top]}
                for e in logprobs or ()]

    def _token(self, token_id: int, logprob: float) -> dict[str, Any]:
        text = self.token_text(token_id)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

    @staticmethod
    def _call_item(call: dict[str, Any]) -> dict[str, Any]:
        return {"id": f"fc_{uuid.uuid4().hex}", "type": "function_call", "status": "completed",
                "call_id": call["id"], "name": call["function"]["name"],
                "arguments": call["function"]["arguments"]}

    def _response(self, status: str, output: list[dict[str, Any]], usage: Usage | None,
                  echo_schema: bool = True) -> dict[str, Any]:
        req = self.request
        text_format = (req.get("text") or {}).get("format") or {"type": "text"}
        if not echo_schema and isinstance(text_format, dict):
            text_format = {k: v for k, v in text_format.items() if k != "schema"}
        return {
            "id": self.id, "object": "response", "created_at": self.created_at, "status": status,
            "error": None,
            "incomplete_details": ({"reason": "max_output_tokens"} if status == "incomplete"
                                   else None),
            "instructions": req.get("instructions"), "max_output_tokens": req.get("max_output_tokens"),
            "model": self.model, "output": list(output), "parallel_tool_calls":
                req.get("parallel_tool_calls") is not False,
            "previous_response_id": None, "store": False,
            "temperature": req.get("temperature", 1.0), "top_p": req.get("top_p", 1.0),
            "text": {"format": text_format}, "tool_choice": req.get("tool_choice", "auto"),
            "tools": req.get("tools") or [], "truncation": "disabled", "metadata": {},
            "usage": None if usage is None else _usage(usage),
        }

    def _event(self, kind: str, **fields: Any) -> bytes:
        payload = {"type": kind, "sequence_number": self._seq, **fields}
        self._seq += 1
        return sse_event(payload, kind)


def _text_part(text: str, logprobs: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs or []}


def _status(finish_reason: str) -> str:
    return "incomplete" if finish_reason == "length" else "completed"


def _usage(usage: Usage) -> dict[str, Any]:
    return {"input_tokens": usage.prompt_tokens,
            "input_tokens_details": {"cached_tokens": usage.cached_tokens},
            "output_tokens": usage.completion_tokens,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": usage.prompt_tokens + usage.completion_tokens}
