"""ResponseBuilder: the OpenAI-shaped JSON bodies and SSE chunks of one request.

One builder per request fixes the id, the creation time and the served model name,
so every chunk of a stream carries the same three. Invariants:

* ``usage.prompt_tokens_details.cached_tokens`` is always present, 0 included;
  with ``n > 1`` the prompt is counted once;
* a stream is, per choice (each chunk names its choice's ``index``): chunks with
  text deltas and/or that step's logprobs (for chat, a choice's first chunk
  carries the role), chunks with ``delta.tool_calls`` (each call whole, with its
  own ``index`` among the choice's calls), a chunk with the ``finish_reason``;
  then, only when the client asked for ``stream_options.include_usage``, a chunk
  with empty ``choices`` and the usage; while usage is requested every other
  chunk has ``"usage": null``, as OpenAI does;
* a chat message with tool calls has ``content: null`` when no text is left
  outside the calls, and ``finish_reason: "tool_calls"`` when it stopped on its own;
* logprobs take OpenAI's shapes: chat ``{"content": [{"token", "logprob",
  "bytes", "top_logprobs"}], "refusal": null}``; completions ``{"tokens",
  "token_logprobs", "top_logprobs", "text_offset"}``.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from engine.core.output_stream import TokenLogprobs


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


@dataclass
class Choice:
    """One finished choice: text (outside any tool calls), calls, reason, logprobs."""

    index: int
    text: str
    finish_reason: str
    tool_calls: list[dict[str, Any]] = field(default_factory=list)
    logprobs: list[TokenLogprobs] | None = None
    prompt_logprobs: list[TokenLogprobs | None] | None = None


def new_call_id() -> str:
    """A fresh id for a tool call in a response; ids never reach a prompt
    (:func:`engine.server.tool_calls.render_call` drops them)."""
    return f"call_{uuid.uuid4().hex[:24]}"


class ResponseBuilder:
    """Builds the bodies of one chat (``kind="chat"``) or completion request.

    ``token_text`` turns a token id into its text (for logprobs).
    """

    def __init__(self, kind: str, model: str, *, include_usage: bool = False,
                 token_text: Callable[[int], str] = str) -> None:
        assert kind in ("chat", "completion"), kind
        self.kind = kind
        self.model = model
        self.include_usage = include_usage
        self.token_text = token_text
        prefix = "chatcmpl" if kind == "chat" else "cmpl"
        self.id = f"{prefix}-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self._sent_role: set[int] = set()
        self._num_calls: dict[int, int] = {}
        self._text_offset: dict[int, int] = {}

    # ---------------------------------------------------------------- full body
    def full(self, choices: list[Choice], usage: Usage) -> dict[str, Any]:
        """The non-streaming response body."""
        out = []
        for c in choices:
            logprobs = None if c.logprobs is None else self._logprobs(c.index, c.logprobs)
            if self.kind == "chat":
                message: dict[str, Any] = {"role": "assistant",
                                           "content": c.text if c.text or not c.tool_calls else None,
                                           "tool_calls": c.tool_calls}
                out.append({"index": c.index, "message": message, "logprobs": logprobs,
                            "finish_reason": _reason(c.finish_reason, bool(c.tool_calls))})
            else:
                out.append({"index": c.index, "text": c.text, "logprobs": logprobs,
                            "finish_reason": c.finish_reason})
                if c.prompt_logprobs is not None:
                    out[-1]["prompt_logprobs"] = self.prompt_logprobs(c.prompt_logprobs)
        return {**self._envelope(streaming=False), "choices": out, "usage": usage.to_dict()}

    # ------------------------------------------------------------------ chunks
    def delta(self, text: str, index: int = 0,
              logprobs: list[TokenLogprobs] | None = None) -> dict[str, Any]:
        """A chunk carrying ``text`` and that step's logprobs, if asked for."""
        lp = None if logprobs is None else self._logprobs(index, logprobs)
        if self.kind == "chat":
            return self._chunk(index, {"content": text}, None, lp)
        return self._chunk(index, {"text": text}, None, lp)

    def prompt_logprobs(self, entries: list[TokenLogprobs | None]) -> list[dict[str, Any] | None]:
        """vLLM's ``prompt_logprobs`` of a completion choice: per prompt token None (the
        first) or ``{token_id: {"logprob", "rank", "decoded_token"}}`` for the token and
        its alternatives (ranked 1, 2, ... best first); ids as JSON object keys."""
        out: list[dict[str, Any] | None] = []
        for e in entries:
            if e is None:
                out.append(None)
                continue
            item = {str(e.token_id): {"logprob": e.logprob, "rank": e.rank,
                                      "decoded_token": self.token_text(e.token_id)}}
            for rank, (t, lp) in enumerate(e.top, start=1):
                item.setdefault(str(t), {"logprob": lp, "rank": rank, "decoded_token": self.token_text(t)})
            out.append(item)
        return out

    def tool_calls(self, calls: list[dict[str, Any]], index: int = 0) -> dict[str, Any]:
        """A chat chunk carrying whole tool calls, numbered within their choice."""
        first = self._num_calls.get(index, 0)
        self._num_calls[index] = first + len(calls)
        numbered = [{"index": first + k, **call} for k, call in enumerate(calls)]
        return self._chunk(index, {"content": None, "tool_calls": numbered}, None, None)

    def finish(self, finish_reason: str, index: int = 0) -> dict[str, Any]:
        """The chunk that ends a choice; it carries no text."""
        reason = _reason(finish_reason, self._num_calls.get(index, 0) > 0)
        if self.kind == "chat":
            return self._chunk(index, {"content": ""}, reason, None)
        return self._chunk(index, {"text": ""}, reason, None)

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

    def _chunk(self, index: int, body: dict[str, Any], finish_reason: str | None,
               logprobs: dict[str, Any] | None) -> dict[str, Any]:
        if self.kind == "chat":
            if index not in self._sent_role:
                body = {"role": "assistant", **body}
                self._sent_role.add(index)
            choice: dict[str, Any] = {"index": index, "delta": body}
        else:
            choice = {"index": index, **body}
        choice["logprobs"] = logprobs
        choice["finish_reason"] = finish_reason
        chunk = {**self._envelope(streaming=True), "choices": [choice]}
        if self.include_usage:
            chunk["usage"] = None
        return chunk

    def _logprobs(self, index: int, entries: list[TokenLogprobs]) -> dict[str, Any]:
        if self.kind == "chat":
            content = [{**self._token(e.token_id, e.logprob),
                        "top_logprobs": [self._token(t, lp) for t, lp in e.top]} for e in entries]
            return {"content": content, "refusal": None}
        texts = [self.token_text(e.token_id) for e in entries]
        offsets = []
        offset = self._text_offset.get(index, 0)
        for text in texts:
            offsets.append(offset)
            offset += len(text)
        self._text_offset[index] = offset
        return {"tokens": texts, "token_logprobs": [e.logprob for e in entries],
                "top_logprobs": [{self.token_text(t): lp for t, lp in e.top} for e in entries],
                "text_offset": offsets}

    def _token(self, token_id: int, logprob: float) -> dict[str, Any]:
        text = self.token_text(token_id)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}


def _reason(finish_reason: str, has_calls: bool) -> str:
    return "tool_calls" if has_calls and finish_reason == "stop" else finish_reason
