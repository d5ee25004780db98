"""RequestHandler: the endpoints of the engine's OpenAI-compatible server, for one engine.

Flow of one generation request (``POST /v1/chat/completions``, ``/v1/completions``
or ``/v1/responses``):

1. the body is read by the server's :class:`~engine.contract.body_reader.BodyReader`
   (415 unless ``application/json``, 413 past its size limit, 408 when too slow,
   429/503 past the bytes of bodies in flight per tenant and overall);
2. in a worker thread (the event loop never decodes JSON, tokenizes or touches
   torch), the body is decoded (400 for malformed JSON), validated
   (:mod:`engine.server.protocol`; a Responses body is first translated to chat by
   :mod:`engine.server.responses`), the model name checked (404), a prompt too
   long by its size alone refused (400), the prompt rendered and tokenized
   (:mod:`engine.contract.chat`) and its length checked (400
   ``context_length_exceeded``), and the output grammar, if any, compiled
   (:mod:`engine.server.structured_output`, 400 ``invalid_schema``); each of the
   ``n`` choices gets its own grammar state and seed (``seed + i``);
3. the choices are submitted to the engine (:class:`~engine.server.fanout.ChoiceFanout`:
   choice 0 first, the rest once its prompt is cached), whose own thread runs them;
4. outputs are streamed as SSE (:class:`~engine.server.event_stream.EventStreamResponse`)
   or collected, tool calls split from the text (:mod:`engine.server.tool_calls`);
   if the client goes away first the engine requests are cancelled, so their KV
   blocks are freed. TTFT (arrival to first token) goes to the metrics.

Handlers raise :class:`~engine.contract.errors.APIError`; ``engine.server.app`` turns it into
the response, so errors are translated in one place.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import orjson
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.types import Receive

from engine.contract import errors
from engine.contract.body_reader import TENANT_HEADER, BodyReader
from engine.contract.chat import ChatRenderer
from engine.contract.errors import APIError
from engine.contract.images import MediaPolicy
from engine.contract.pixel_budget import PixelBudget
from engine.contract.responses_request import responses_param, translate
from engine.contract.sse import SSE_DONE, sse_event
from engine.core.llm_engine import GenerationRequest, LLMEngine, StepOutput
from engine.core.output_stream import TokenLogprobs
from engine.server.event_stream import EventStreamResponse
from engine.server.fanout import ChoiceFanout
from engine.server.metrics import EngineMetrics
from engine.server.prompt_modules import PromptModules
from engine.server.protocol import GenerationBody, parse_chat_body, parse_completion_body
from engine.server.response_builder import Choice, ResponseBuilder, Usage
from engine.server.responses import ResponsesBuilder
from engine.server.structured_output import GRAMMAR_ERROR_PREFIX, grammar_for, schema_param
from engine.server.tool_calls import ToolCallStream, extract_tool_calls

logger = logging.getLogger(__name__)

MAX_TENANT_CHARS = 256


@dataclass
class _Prepared:
    kind: str  # "chat" | "completion" | "responses"
    body: GenerationBody
    fanout: ChoiceFanout
    builder: ResponseBuilder
    responses: ResponsesBuilder | None = None
    grammar_param: str | None = None  # the field whose schema the output grammar came from


@dataclass
class _Tally:
    """What the outputs of one choice add up to."""

    text: str = ""
    completion_tokens: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    finish_reason: str | None = None
    error: str | None = None
    first_token_at: float | None = None
    logprobs: list[TokenLogprobs] | None = None
    prompt_logprobs: list[TokenLogprobs | None] | None = None

    def add(self, out: StepOutput) -> None:
        if out.new_token_ids and self.first_token_at is None:
            self.first_token_at = time.perf_counter()
        self.text += out.new_text
        self.completion_tokens += len(out.new_token_ids)
        self.prompt_tokens = out.num_prompt_tokens
        self.cached_tokens = out.num_cached_tokens
        if out.logprobs is not None:
            self.logprobs = (self.logprobs or []) + out.logprobs
        if out.prompt_logprobs is not None:
            self.prompt_logprobs = out.prompt_logprobs
        if out.finished:
            self.finish_reason = out.finish_reason
            self.error = out.error


def _usage(tallies: list[_Tally]) -> Usage:
    """The prompt counted once (choice 0's), completion tokens summed over the choices."""
    return Usage(tallies[0].prompt_tokens, sum(t.completion_tokens for t in tallies),
                 tallies[0].cached_tokens)


class RequestHandler:
    """The request handlers of one app, bound to one engine (see the module docstring)."""

    def __init__(self, engine: LLMEngine, *, media: MediaPolicy, bodies: BodyReader,
                 segment_reuse: bool = False) -> None:
        self.engine = engine
        self.media = media
        self.bodies = bodies
        self.renderer = ChatRenderer(
            engine.tokenizer,
            supports_images=engine.supports_images,
            image_placeholder=getattr(engine, "image_placeholder", None),
            allow_remote_images=media.allows_remote,
            fetch=media.fetcher(),
            image_processor=getattr(engine, "image_processor", None),
            pixel_budget=PixelBudget(media.max_pixels_in_flight),
        )
        # Token ids a client may send: the model's vocabulary (may exceed the tokenizer's).
        self.vocab_size = int(getattr(engine, "vocab_size", None) or len(engine.tokenizer))
        self.metrics = EngineMetrics(engine, engine.model_id)
        self.prompt_modules = PromptModules(engine.tokenizer, engine.max_model_len, bodies,
                                            segment_reuse=segment_reuse, tokenizer_lock=self.renderer.lock)
        self.created = int(time.time())
        self._compiler: Any = None  # GrammarCompiler, built on first use (about a second)
        self._compiler_lock = threading.Lock()
        self._token_text_lock = threading.Lock()

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

    async def responses(self, request: Request) -> Response:
        return await self._generate(request, "responses")

    async def _generate(self, request: Request, kind: str) -> Response:
        arrival = time.perf_counter()
        try:
            prepared = await self._admit(request, kind)
        except APIError as exc:
            self.metrics.count_request(kind, "client_error" if exc.status_code < 500 else "error")
            raise
        if prepared.body.stream:
            return self._stream(prepared, arrival)
        return await self._respond(prepared, arrival, request.receive)

    async def _admit(self, request: Request, kind: str) -> _Prepared:
        """Read, validate, tokenize and submit; every refusal is an APIError.

        The body's budget is held until it is parsed and submitted: nothing built from
        the raw bytes outlives this method but the prompt, which the scheduler bounds."""
        tenant = request.headers.get(TENANT_HEADER)
        if tenant is not None and not 0 < len(tenant) <= MAX_TENANT_CHARS:
            raise errors.invalid_param(f"The {TENANT_HEADER} header must have 1 to {MAX_TENANT_CHARS} characters.",
                                       None, "invalid_tenant")
        with self.bodies.lease(tenant or "") as lease:
            raw = await self.bodies.read(request, lease)
            try:
                prepared = await run_in_threadpool(self._prepare, raw, kind, tenant)
                prepared.fanout.submit_first()
                return prepared
            except ValueError as exc:  # user input refused below protocol.py, naming its value
                raise errors.invalid_param(str(exc), None) from exc
            except RecursionError as exc:  # caused by the body's shape, not by the engine
                raise errors.invalid_param("The request is nested too deeply to render.", None,
                                           "json_too_deep") from exc
            except RuntimeError as exc:  # submit() after the engine shut down
                raise errors.engine_unavailable(str(exc)) from exc
            finally:
                del raw  # a failure's traceback keeps this frame: not the bytes too

    def _prepare(self, content: bytes, kind: str, tenant: str | None = None) -> _Prepared:
        """Decode, validate, render and tokenize (runs in a worker thread: a body of
        megabytes is decoded off the event loop too)."""
        try:
            raw = orjson.loads(content)
        except orjson.JSONDecodeError as exc:
            raise errors.malformed_json(str(exc)) from exc
        origins: list[str] = []  # Responses: the input item each chat message came from
        try:
            return self._prepare_kind(raw, kind, origins, tenant)
        except APIError as exc:
            if kind == "responses":  # name the Responses field, not the chat one
                exc.param = responses_param(exc.param, origins)
            raise

    def _prepare_kind(self, raw: object, kind: str, origins: list[str], tenant: str | None) -> _Prepared:
        if kind == "completion":
            body = parse_completion_body(raw, self.vocab_size)
        elif kind == "responses":
            chat, found = translate(raw)
            origins.extend(found)
            body = parse_chat_body(chat, self.vocab_size)
        else:
            body = parse_chat_body(raw, self.vocab_size)
        if body.model is not None and body.model != self.engine.model_id:
            raise errors.model_not_found(body.model, self.engine.model_id)
        self._refuse_by_size(body)
        self._refuse_by_image_count(body)
        mm_items: tuple[Any, ...] = ()
        mm_inputs: tuple[Any, ...] = ()
        segmented = None  # the prompt's reusable segments (PML, segment_reuse)
        assert isinstance(raw, dict)  # parse_*_body checked it
        if body.messages is not None:
            rendered = self.renderer.render(body.messages, body.tools)
            token_ids, mm_items, mm_inputs = rendered.token_ids, rendered.mm_items, rendered.mm_inputs
            if kind == "chat" and not mm_items:
                segmented = self.prompt_modules.chat_prompt(raw, body.messages, rendered.text, token_ids)
        elif (segmented := self.prompt_modules.completion_prompt(raw, body.prompt, body.cache_salt)) is not None:
            token_ids = segmented.token_ids
        elif isinstance(body.prompt, str):
            token_ids = self.renderer.encode(body.prompt)
        else:
            assert body.prompt is not None
            token_ids = list(body.prompt)
        try:
            params = body.sampling_params(len(token_ids), self.engine.max_model_len)
        except ValueError as exc:  # SamplingParams' own range checks
            raise errors.invalid_param(str(exc), None) from exc
        grammar = grammar_param = None
        if body.tool_choice.forced or body.response_format is not None:
            grammar = grammar_for(self.compiler(), body.tool_choice, body.tools, body.response_format)
            grammar_param = schema_param(body.tool_choice, body.tools, body.response_format)
        if grammar is not None and body.ignore_eos:  # a complete grammar allows only EOS
            raise errors.invalid_param("'ignore_eos' cannot be combined with a response_format "
                                       "or a forced tool_choice.", "ignore_eos")
        builder = ResponseBuilder("completion" if kind == "completion" else "chat",
                                  self.engine.model_id, include_usage=body.include_usage,
                                  token_text=self._token_text)
        requests = []
        for i in range(body.n):
            choice_params = dataclasses.replace(
                params,
                seed=None if params.seed is None else params.seed + i,
                constraint=None if grammar is None else self.compiler().constraint(grammar),
            )
            requests.append(GenerationRequest(
                request_id=builder.id if body.n == 1 else f"{builder.id}-{i}",
                prompt_token_ids=token_ids, params=choice_params,
                cache_salt=body.cache_salt, mm_items=mm_items, mm_inputs=mm_inputs, tenant=tenant,
                segmented=segmented,
                kv_compression=body.kv_compression,
            ))
        responses = None
        if kind == "responses":
            assert isinstance(raw, dict)  # to_chat_body checked it
            responses = ResponsesBuilder(self.engine.model_id, raw, token_text=self._token_text)
            grammar_param = responses_param(grammar_param, origins)
        return _Prepared(kind, body, ChoiceFanout(self.engine, requests), builder, responses,
                         grammar_param)

    def compiler(self) -> Any:
        """The grammar compiler for this engine's tokenizer, built once on first use."""
        with self._compiler_lock:
            if self._compiler is None:
                from engine.structured.grammar import GrammarCompiler

                self._compiler = GrammarCompiler(self.engine.tokenizer, self.vocab_size)
            return self._compiler

    @functools.lru_cache(maxsize=65536)  # noqa: B019 -- one handler per app, bounded
    def _token_text(self, token_id: int) -> str:
        with self._token_text_lock:
            return str(self.engine.tokenizer.decode([token_id]))

    def _refuse_by_image_count(self, body: GenerationBody) -> None:
        """More image parts than the media policy allows are refused before any is decoded
        or fetched (bounded work per request); the param names the first one too many."""
        limit = self.media.max_images_per_request
        seen = 0
        for i, message in enumerate(body.messages or ()):
            content = message.get("content") if isinstance(message, dict) else None
            for j, part in enumerate(content if isinstance(content, list) else ()):
                if isinstance(part, dict) and part.get("type") == "image_url":
                    seen += 1
                    if seen > limit:
                        raise errors.invalid_param(
                            f"At most {limit} images are accepted per request (--max-images-per-request).",
                            f"messages[{i}].content[{j}]", "too_many_images")

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

    async def _respond(self, prepared: _Prepared, arrival: float, receive: Receive) -> Response:
        tallies = [_Tally() for _ in range(prepared.body.n)]
        collect = asyncio.ensure_future(_drain(prepared.fanout, tallies))
        gone = asyncio.ensure_future(_wait_disconnect(receive))
        try:
            done, _ = await asyncio.wait({collect, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
            if not collect.done():
                collect.cancel()
        if collect not in done:
            self.metrics.count_request(prepared.kind, "abort")
            logger.info("client went away; cancelled %s", prepared.builder.id)
            return Response(status_code=499)
        collect.result()
        self._finish_metrics(tallies, prepared.kind, arrival)
        for tally in tallies:
            _raise_for_failure(tally, prepared.grammar_param)
        body = prepared.body
        choices = []
        for index, tally in enumerate(tallies):
            assert tally.finish_reason is not None
            text, calls = extract_tool_calls(tally.text, body.tool_choice, body.tools,
                                             truncated=tally.finish_reason == "length")
            choices.append(Choice(index, text, tally.finish_reason, calls, tally.logprobs,
                                  tally.prompt_logprobs))
        if prepared.responses is not None:
            c = choices[0]
            out = prepared.responses.full(c.text, c.tool_calls, c.finish_reason, _usage(tallies),
                                          c.logprobs)
        else:
            out = prepared.builder.full(choices, _usage(tallies))
        return Response(orjson.dumps(out), media_type="application/json")

    def _stream(self, prepared: _Prepared, arrival: float) -> Response:
        body, builder, responses = prepared.body, prepared.builder, prepared.responses
        tallies = [_Tally() for _ in range(body.n)]
        splitters = [ToolCallStream(body.tool_choice, body.tools) for _ in range(body.n)]

        async def events() -> AsyncIterator[bytes]:
            if responses is not None:
                for event in responses.start():
                    yield event
            async for index, out in prepared.fanout.outputs():
                tally = tallies[index]
                tally.add(out)
                text, calls = splitters[index].feed(out.new_text)
                if out.finished:
                    rest, last = splitters[index].finish(truncated=out.finish_reason == "length")
                    text, calls = text + rest, calls + last
                if responses is not None:
                    deltas = responses.text(text, out.logprobs) if text or out.logprobs else []
                    for event in deltas + responses.calls(calls):
                        yield event
                else:
                    if text or out.logprobs or out.prompt_logprobs is not None:
                        chunk = builder.delta(text, index, out.logprobs)
                        if out.prompt_logprobs is not None:  # vLLM: in the choice's first chunk
                            chunk["choices"][0]["prompt_logprobs"] = builder.prompt_logprobs(out.prompt_logprobs)
                        yield sse_event(chunk)
                    if calls:
                        yield sse_event(builder.tool_calls(calls, index))
                if not out.finished:
                    continue
                try:
                    _raise_for_failure(tally, prepared.grammar_param)
                except APIError as exc:
                    self._finish_metrics(tallies, prepared.kind, arrival)
                    if responses is not None:  # a Responses stream ends on its error event
                        yield responses.error(exc.to_dict()["error"])
                        return
                    yield sse_event(exc.to_dict())  # then [DONE], as vLLM ends a failed stream
                    yield SSE_DONE
                    return
                assert tally.finish_reason is not None
                if responses is None:
                    yield sse_event(builder.finish(tally.finish_reason, index))
            self._finish_metrics(tallies, prepared.kind, arrival)
            if responses is not None:
                assert tallies[0].finish_reason is not None
                for event in responses.finish(tallies[0].finish_reason, _usage(tallies)):
                    yield event
                return
            if builder.include_usage:
                yield sse_event(builder.usage_chunk(_usage(tallies)))
            yield SSE_DONE

        def on_close() -> None:
            if any(t.finish_reason is None for t in tallies):
                for stream in prepared.fanout.streams:
                    stream.cancel()
                self.metrics.count_request(prepared.kind, "abort")

        return EventStreamResponse(events(), on_close)

    def _finish_metrics(self, tallies: list[_Tally], kind: str, arrival: float) -> None:
        firsts = [t.first_token_at for t in tallies if t.first_token_at is not None]
        if firsts:
            self.metrics.observe_ttft(min(firsts) - arrival)
        failed = next((t.finish_reason or "error" for t in tallies
                       if t.finish_reason in (None, "error", "abort")), None)
        self.metrics.count_request(kind, failed or tallies[0].finish_reason or "error")


async def _drain(fanout: ChoiceFanout, tallies: list[_Tally]) -> None:
    async for index, out in fanout.outputs():
        tallies[index].add(out)


async def _wait_disconnect(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


def _raise_for_failure(tally: _Tally, grammar_param: str | None = None) -> None:
    """The APIError for a choice that did not finish normally: a grammar that failed
    mid-generation is the request schema's fault (400 ``invalid_schema`` naming it),
    anything else the engine's (5xx)."""
    if tally.finish_reason == "abort":
        raise errors.engine_unavailable("The request was aborted by the engine (shutting down?).")
    if tally.finish_reason == "error" and (tally.error or "").startswith(GRAMMAR_ERROR_PREFIX):
        reason = (tally.error or "")[len(GRAMMAR_ERROR_PREFIX):]
        raise errors.invalid_param(
            f"The output grammar of this request's schema failed during generation: {reason}",
            grammar_param, "invalid_schema")
    if tally.finish_reason == "error" or tally.finish_reason is None:
        raise errors.engine_failure(f"The engine failed on this request: {tally.error or 'unknown'}")
