"""OutputStream: carries one request's StepOutputs from the engine thread to a consumer.

Created inside a running asyncio event loop, it hands every output over with
``loop.call_soon_threadsafe`` so the event loop never waits on torch. Created
outside any event loop (scripts, benchmarks), it is a blocking queue read with
:meth:`OutputStream.result`.

Invariant: the last output put into a stream has ``finished=True`` and nothing
follows it.
"""

from __future__ import annotations

import asyncio
import queue
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass
from typing import Any

from engine.core.sampling_params import SamplingParams
from engine.kvcache.block_hash import MultiModalItem
from engine.promptcache.segments import SegmentedPrompt


@dataclass
class GenerationRequest:
    """What the server asks the engine to generate.

    ``mm_inputs`` (:class:`~engine.multimodal.processor.ImageInput`, for a
    vision-language model) are one per ``mm_items`` entry, in the same order, with the
    same identifiers and ranges. ``tenant`` names who the request is for, only to
    share prefill fairly between tenants (:mod:`engine.core.scheduler`; the cache
    salt when None); isolation is the salt's business, not this. ``segmented``: the
    prompt cut into segments whose KV may be assembled from prompt modules
    (:mod:`engine.promptcache.segments`, :mod:`engine.core.module_assembler`); its
    tokens must be ``prompt_token_ids`` (ValueError otherwise). None: computed
    exactly, as always. ``kv_compression``:
    ``"pyramid"`` or ``"none"`` for this request, None for the engine's default."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    cache_salt: str | None = None
    mm_items: tuple[MultiModalItem, ...] = ()
    mm_inputs: tuple[Any, ...] = ()
    tenant: str | None = None
    segmented: SegmentedPrompt | None = None
    kv_compression: str | None = None

    def __post_init__(self) -> None:
        if self.segmented is not None and self.segmented.token_ids != list(self.prompt_token_ids):
            raise ValueError(
                f"the segmented prompt's {len(self.segmented.token_ids)} tokens are not the request's "
                f"{len(self.prompt_token_ids)} prompt tokens"
            )


@dataclass(frozen=True)
class TokenLogprobs:
    """One token's log-probability and the ``top`` most likely (id, logprob), best first;
    ``rank`` (prompt tokens only, else None): 1 + how many tokens were more likely."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]]
    rank: int | None = None


@dataclass
class StepOutput:
    """What one engine step produced for a request."""

    new_token_ids: list[int]
    new_text: str
    finished: bool
    finish_reason: str | None
    num_prompt_tokens: int
    num_cached_tokens: int
    error: str | None = None
    logprobs: list[TokenLogprobs] | None = None  # one per new token, when params.logprobs is set
    prompt_logprobs: list[TokenLogprobs | None] | None = None
    """With the first token of a request whose params set ``prompt_logprobs``: one per
    prompt token, None for the first (nothing precedes it)."""


class OutputStream:
    """The consumer's end of one request's outputs."""

    def __init__(self, request_id: str, abort: Callable[[str], None]) -> None:
        self.request_id = request_id
        self._abort = abort
        self.finished = False
        try:
            self._loop: asyncio.AbstractEventLoop | None = asyncio.get_running_loop()
        except RuntimeError:
            self._loop = None
        self._async_queue: asyncio.Queue[StepOutput] = asyncio.Queue()
        self._sync_queue: queue.Queue[StepOutput] = queue.Queue()

    def put(self, output: StepOutput) -> bool:
        """Called by the engine thread; False when the consumer's event loop is gone."""
        if self._loop is None:
            self._sync_queue.put(output)
            return True
        try:
            self._loop.call_soon_threadsafe(self._async_queue.put_nowait, output)
        except RuntimeError:
            return False
        return True

    async def __aiter__(self) -> AsyncIterator[StepOutput]:
        if self._loop is None:
            raise RuntimeError("this OutputStream was created outside an event loop: use result()")
        try:
            while not self.finished:
                output = await self._async_queue.get()
                self.finished = output.finished
                yield output
        finally:
            if not self.finished:
                self.cancel()

    async def collect(self) -> list[StepOutput]:
        """Every output until the finished one."""
        return [output async for output in self]

    def outputs(self, timeout: float | None = None) -> Iterator[StepOutput]:
        """Blocking iteration, output by output, for a stream created outside an event
        loop (``timeout``: seconds to wait for each output; ``queue.Empty`` after it)."""
        if self._loop is not None:
            raise RuntimeError("this OutputStream belongs to an event loop: use collect()")
        while not self.finished:
            output = self._sync_queue.get(timeout=timeout)
            self.finished = output.finished
            yield output

    def result(self, timeout: float | None = None) -> list[StepOutput]:
        """Blocking collect for a stream created outside an event loop."""
        return list(self.outputs(timeout))

    def cancel(self) -> None:
        """Abort the request (idempotent); its blocks are freed by the engine."""
        self._abort(self.request_id)
