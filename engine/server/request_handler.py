"""RequestHandler: the endpoints of the engine's OpenAI-compatible server, for one engine.

Flow of one generation request (``POST /v1/chat/completions`` or ``/v1/completions``):

1. the body is read with a byte bound (413 past ``max_body_bytes``);
2. in a worker thread (the event loop never decodes JSON, tokenizes or touches
   torch), the body is decoded (400 for malformed JSON), validated
   (:mod:`engine.server.protocol`), the model name checked (404), a prompt too
   long by its size alone refused (400), the prompt rendered and tokenized (:mod:`engine.server.chat`) and its length checked (400
   ``context_length_exceeded``);
3. the request is submitted to the engine, whose own thread runs it;
4. outputs are streamed as SSE (:class:`~engine.server.event_stream.EventStreamResponse`)
   or collected; if the client goes away first the engine request is cancelled, so
   its KV blocks are freed. TTFT (arrival to first token) goes to the metrics.

Handlers raise :class:`~engine.server.errors.APIError`; ``engine.server.app`` turns it into
the response, so errors are translated in one place.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import orjson
from starlette.concurrency import run_in_threadpool
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response
from starlette.types import Receive

from engine.core.llm_engine import GenerationRequest, LLMEngine, OutputStream, StepOutput
from engine.server import errors
from engine.server.chat import ChatRenderer
from engine.server.errors import APIError
from engine.server.event_stream import EventStreamResponse
from engine.server.images import http_fetcher
from engine.server.metrics import EngineMetrics
from engine.server.protocol import GenerationBody, parse_chat_body, parse_completion_body
from engine.server.response_builder import SSE_DONE, ResponseBuilder, Usage, sse_event

logger = logging.getLogger(__name__)


@dataclass
class _Prepared:
    body: GenerationBody
    request: GenerationRequest
    builder: ResponseBuilder


@dataclass
class _Tally:
    """What the outputs of one request add up to."""

    text: str = ""
    completion_tokens: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    finish_reason: str | None = None
    error: str | None = None
    first_token_at: float | None = None

    def add(self, out: StepOutput) -> None:
        if out.new_token_ids and self.first_token_at is None:
            self.first_token_at = time.perf_counter()
        self.text += out.new_text
        self.completion_tokens += len(out.new_token_ids)
        self.prompt_tokens = out.num_prompt_tokens
        self.cached_tokens = out.num_cached_tokens
        if out.finished:
            self.finish_reason = out.finish_reason
            self.error = out.error

    def usage(self) -> Usage:
        return Usage(self.prompt_tokens, self.completion_tokens, self.cached_tokens)


class RequestHandler:
    """The request handlers of one app, bound to one engine (see the module docstring)."""

    def __init__(self, engine: LLMEngine, *, allow_remote_images: bool, max_body_bytes: int) -> None:
        self.engine = engine
        self.max_body_bytes = max_body_bytes
        self.renderer = ChatRenderer(
            engine.tokenizer,
            supports_images=engine.supports_images,
            image_placeholder=getattr(engine, "image_placeholder", None),
            allow_remote_images=allow_remote_images,
            fetch=http_fetcher() if allow_remote_images else None,
        )
        # Token ids a client may send: the model's vocabulary (may exceed the tokenizer's).
        self.vocab_size = int(getattr(engine, "vocab_size", None) or len(engine.tokenizer))
        self.metrics = EngineMetrics(engine, engine.model_id)
        self.created = int(time.time())

    # ------------------------------------------------------------- simple GETs
    async def health(self, request: Request) -> Response:
        return JSONResponse({"status": "ok", "model": self.engine.model_id})

    async def models(self, request: Request) -> Response:
        card = {
            "id": self.engine.model_id, "object": "model", "created": self.created,
            "owned_by": "prefixgate", "root": self.engine.model_id, "parent": None,
            "max_model_len": self.engine.max_model_len,
        }
        return JSONResponse({"object": "list", "data": [card]})

    async def metrics_endpoint(self, request: Request) -> Response:
        body = await run_in_threadpool(self.metrics.render)
        return Response(body, media_type=self.metrics.content_type)

    # ------------------------------------------------------------- generation
    async def chat_completions(self, request: Request) -> Response:
        return await self._generate(request, "chat")

    async def completions(self, request: Request) -> Response:
        return await self._generate(request, "completion")

    async def _generate(self, request: Request, kind: str) -> Response:
        arrival = time.perf_counter()
        try:
            prepared, stream = await self._admit(request, kind)
        except APIError as exc:
            self.metrics.count_request(kind, "client_error" if exc.status_code < 500 else "error")
            raise
        if prepared.body.stream:
            return self._stream(stream, prepared, kind, arrival)
        return await self._respond(stream, prepared, kind, arrival, request.receive)

    async def _admit(self, request: Request, kind: str) -> tuple[_Prepared, OutputStream]:
        """Read, validate, tokenize and submit; every refusal is an APIError."""
        raw = await self._read_body(request)
        try:
            prepared = await run_in_threadpool(self._prepare, raw, kind)
            return prepared, self.engine.submit(prepared.request)
        except ValueError as exc:  # user input refused below protocol.py, naming its value
            raise errors.invalid_param(str(exc), None) from exc
        except RecursionError as exc:  # caused by the body's shape, not by the engine
            raise errors.invalid_param("The request is nested too deeply to render.", None,
                                       "json_too_deep") from exc
        except RuntimeError as exc:  # submit() after the engine shut down
            raise errors.engine_unavailable(str(exc)) from exc

    async def _read_body(self, request: Request) -> bytes:
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_body_bytes:
            raise errors.body_too_large(self.max_body_bytes)
        chunks: list[bytes] = []
        size = 0
        try:
            async for chunk in request.stream():
                size += len(chunk)
                if size > self.max_body_bytes:
                    raise errors.body_too_large(self.max_body_bytes)
                chunks.append(chunk)
        except ClientDisconnect as exc:  # nobody is left to answer; no stack trace either
            raise errors.APIError(400, "The client disconnected while sending the body.",
                                  code="client_disconnected") from exc
        return b"".join(chunks)

    def _prepare(self, content: bytes, kind: str) -> _Prepared:
        """Decode, validate, render and tokenize (runs in a worker thread: a body of
        megabytes is decoded off the event loop too)."""
        try:
            raw = orjson.loads(content)
        except orjson.JSONDecodeError as exc:
            raise errors.malformed_json(str(exc)) from exc
        if kind == "chat":
            body = parse_chat_body(raw, self.vocab_size)
        else:
            body = parse_completion_body(raw, self.vocab_size)
        if body.model is not None and body.model != self.engine.model_id:
            raise errors.model_not_found(body.model, self.engine.model_id)
        self._refuse_by_size(body)
        mm_items: tuple[Any, ...] = ()
        if body.messages is not None:
            rendered = self.renderer.render(body.messages, body.tools)
            token_ids, mm_items = rendered.token_ids, rendered.mm_items
        elif isinstance(body.prompt, str):
            token_ids = self.renderer.encode(body.prompt)
        else:
            assert body.prompt is not None
            token_ids = list(body.prompt)
        try:
            params = body.sampling_params(len(token_ids), self.engine.max_model_len)
        except ValueError as exc:  # SamplingParams' own range checks
            raise errors.invalid_param(str(exc), None) from exc
        builder = ResponseBuilder(kind, self.engine.model_id, include_usage=body.include_usage)
        request = GenerationRequest(
            request_id=builder.id, prompt_token_ids=token_ids, params=params,
            cache_salt=body.cache_salt, mm_items=mm_items,
        )
        return _Prepared(body, request, builder)

    def _refuse_by_size(self, body: GenerationBody) -> None:
        """A prompt whose text alone cannot fit in the context is refused before it is
        rendered or tokenized (each token stands for at most ``max_token_chars``
        characters), so an oversized request costs no tokenizer time and never holds
        the tokenizer's lock while other requests wait for it."""
        per_token = self.renderer.max_token_chars
        if per_token is None:
            return
        chars = body.text_chars()
        most_tokens_fit = self.engine.max_model_len - 1
        if chars > most_tokens_fit * per_token:
            raise errors.context_length_exceeded(
                f"This model's maximum context length is {self.engine.max_model_len} tokens; the prompt "
                f"has {chars} characters, more than {most_tokens_fit} tokens can hold (one token covers "
                f"at most {per_token} characters).",
                "messages" if body.kind == "chat" else "prompt",
            )

    async def _respond(self, stream: OutputStream, prepared: _Prepared, kind: str, arrival: float,
                       receive: Receive) -> Response:
        tally = _Tally()
        collect = asyncio.ensure_future(_drain(stream, tally))
        gone = asyncio.ensure_future(_wait_disconnect(receive))
        try:
            done, _ = await asyncio.wait({collect, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
            if not collect.done():
                collect.cancel()
                stream.cancel()
        if collect not in done:
            self.metrics.count_request(kind, "abort")
            logger.info("client went away; cancelled %s", prepared.request.request_id)
            return Response(status_code=499)
        collect.result()
        self._finish_metrics(tally, kind, arrival)
        _raise_for_failure(tally)
        assert tally.finish_reason is not None
        body = prepared.builder.full(tally.text, tally.finish_reason, tally.usage())
        return Response(orjson.dumps(body), media_type="application/json")

    def _stream(self, stream: OutputStream, prepared: _Prepared, kind: str,
                arrival: float) -> Response:
        tally = _Tally()
        builder = prepared.builder

        async def events() -> AsyncIterator[bytes]:
            async for out in stream:
                tally.add(out)
                if out.new_text:
                    yield sse_event(builder.delta(out.new_text))
            self._finish_metrics(tally, kind, arrival)
            try:
                _raise_for_failure(tally)
            except APIError as exc:
                yield sse_event(exc.to_dict())
                yield SSE_DONE
                return
            assert tally.finish_reason is not None
            yield sse_event(builder.finish(tally.finish_reason))
            if builder.include_usage:
                yield sse_event(builder.usage_chunk(tally.usage()))
            yield SSE_DONE

        def on_close() -> None:
            if tally.finish_reason is None:
                stream.cancel()
                self.metrics.count_request(kind, "abort")

        return EventStreamResponse(events(), on_close)

    def _finish_metrics(self, tally: _Tally, kind: str, arrival: float) -> None:
        if tally.first_token_at is not None:
            self.metrics.observe_ttft(tally.first_token_at - arrival)
        self.metrics.count_request(kind, tally.finish_reason or "error")


async def _drain(stream: OutputStream, tally: _Tally) -> None:
    async for out in stream:
        tally.add(out)


async def _wait_disconnect(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


def _raise_for_failure(tally: _Tally) -> None:
    if tally.finish_reason == "abort":
        raise errors.engine_unavailable("The request was aborted by the engine (shutting down?).")
    if tally.finish_reason == "error" or tally.finish_reason is None:
        raise errors.engine_failure(f"The engine failed on this request: {tally.error or 'unknown'}")
