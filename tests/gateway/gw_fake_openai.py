"""A fake of OpenAI's hosted API, strict where the gateway could go wrong.

It checks the bearer key, accepts exactly OpenAI's documented request parameters
of ``/v1/chat/completions`` and ``/v1/completions`` and answers any other one with
OpenAI's 400 (``Unrecognized request argument supplied: NAME``). It has no
``/health``. Prefix caching is modelled the way OpenAI routes it: a request whose
``prompt_cache_key`` was seen before with the same first message reports that
message's tokens (4 characters each) as ``cached_tokens``.
"""

from __future__ import annotations

from typing import Any

import orjson
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

API_KEY = "sk-test-0123456789"
CHAT_PARAMETERS = frozenset({
    "audio", "frequency_penalty", "function_call", "functions", "logit_bias", "logprobs",
    "max_completion_tokens", "max_tokens", "messages", "metadata", "modalities", "model", "n",
    "parallel_tool_calls", "prediction", "presence_penalty", "prompt_cache_key",
    "prompt_cache_retention", "reasoning_effort", "response_format", "safety_identifier", "seed",
    "service_tier", "stop", "store", "stream", "stream_options", "temperature", "tool_choice", "tools",
    "top_logprobs", "top_p", "user", "verbosity", "web_search_options",
})
COMPLETION_PARAMETERS = frozenset({
    "model", "prompt", "best_of", "echo", "frequency_penalty", "logit_bias", "logprobs", "max_tokens",
    "n", "presence_penalty", "seed", "stop", "stream", "stream_options", "suffix", "temperature",
    "top_p", "user",
})


def _error(status: int, message: str, type_: str, code: str | None = None, param: str | None = None) -> Response:
    return JSONResponse({"error": {"message": message, "type": type_, "param": param, "code": code}},
                        status_code=status)


class FakeOpenAI:
    def __init__(self) -> None:
        self.bodies: list[dict[str, Any]] = []
        self.authorizations: list[str | None] = []
        self.usages: list[dict[str, Any]] = []
        self.seen: dict[str, str] = {}  # prompt_cache_key -> first message of its last request
        self.app = Starlette(routes=[
            Route("/v1/chat/completions", self.chat, methods=["POST"]),
            Route("/v1/completions", self.completions, methods=["POST"]),
            Route("/v1/models", self.models, methods=["GET"]),
        ])

    def _check(self, request: Request, body: Any, allowed: frozenset[str]) -> Response | None:
        self.authorizations.append(request.headers.get("authorization"))
        if request.headers.get("authorization") != f"Bearer {API_KEY}":
            return _error(401, "Incorrect API key provided.", "invalid_request_error", "invalid_api_key")
        if not isinstance(body, dict):
            return _error(400, "We could not parse the JSON body of your request.", "invalid_request_error")
        for name in body:
            if name not in allowed:
                return _error(400, f"Unrecognized request argument supplied: {name}", "invalid_request_error")
        key = body.get("prompt_cache_key")
        if key is not None and not isinstance(key, str):
            return _error(400, "Invalid type for 'prompt_cache_key'.", "invalid_request_error",
                          "invalid_type", "prompt_cache_key")
        return None

    def _usage(self, body: dict[str, Any]) -> dict[str, Any]:
        text = orjson.dumps(body.get("messages") or body.get("prompt")).decode()
        prompt = len(text) // 4
        cached = 0
        messages = body.get("messages") or []
        first = orjson.dumps(messages[0]).decode() if messages else ""
        key = body.get("prompt_cache_key")
        if key is not None:
            if self.seen.get(key) == first:
                cached = len(first) // 4
            self.seen[key] = first
        return {"prompt_tokens": prompt, "completion_tokens": 2, "total_tokens": prompt + 2,
                "prompt_tokens_details": {"cached_tokens": cached, "audio_tokens": 0},
                "completion_tokens_details": {"reasoning_tokens": 0}}

    async def chat(self, request: Request) -> Response:
        return await self._answer(request, CHAT_PARAMETERS, "chat.completion")

    async def completions(self, request: Request) -> Response:
        return await self._answer(request, COMPLETION_PARAMETERS, "text_completion")

    async def _answer(self, request: Request, allowed: frozenset[str], kind: str) -> Response:
        body = orjson.loads(await request.body())
        rejected = self._check(request, body, allowed)
        if rejected is not None:
            return rejected
        self.bodies.append(body)
        usage = self._usage(body)
        self.usages.append(usage)
        base = {"id": "chatcmpl-fake", "object": kind, "created": 1, "model": body["model"]}
        if kind == "chat.completion":
            choice: dict[str, Any] = {"index": 0, "message": {"role": "assistant", "content": "Hi."},
                                      "finish_reason": "stop", "logprobs": None}
        else:
            choice = {"index": 0, "text": "Hi.", "finish_reason": "stop", "logprobs": None}
        if not body.get("stream"):
            return JSONResponse({**base, "choices": [choice], "usage": usage})
        include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
        return StreamingResponse(self._events(base, include_usage, usage), media_type="text/event-stream")

    async def _events(self, base: dict[str, Any], include_usage: bool, usage: dict[str, Any]):
        chunk = {**base, "object": "chat.completion.chunk"}
        extra = {"usage": None} if include_usage else {}
        for delta, finish in (({"role": "assistant", "content": "Hi."}, None), ({}, "stop")):
            event = {**chunk, "choices": [{"index": 0, "delta": delta, "finish_reason": finish}], **extra}
            yield b"data: " + orjson.dumps(event) + b"\n\n"
        if include_usage:
            yield b"data: " + orjson.dumps({**chunk, "choices": [], "usage": usage}) + b"\n\n"
        yield b"data: [DONE]\n\n"

    async def models(self, request: Request) -> Response:
        self.authorizations.append(request.headers.get("authorization"))
        if request.headers.get("authorization") != f"Bearer {API_KEY}":
            return _error(401, "Incorrect API key provided.", "invalid_request_error", "invalid_api_key")
        return JSONResponse({"object": "list", "data": [{"id": "gpt-4o-mini", "object": "model"}]})
