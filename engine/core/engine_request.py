"""EngineRequest: one request's state inside the engine, as plain data.

It ties together the KV cache manager's view of the request (:class:`Request`:
token ids and block hashes), how many of its tokens have K/V in its blocks, its
sampler generator and its detokenizer. The scheduler moves it between queues and
owns its blocks; the engine loop advances ``num_computed_tokens`` after a forward
and appends sampled tokens. Nothing here runs a model.

Invariants:

* ``kv.num_tokens == num_prompt_tokens + number of sampled tokens``;
* ``num_computed_tokens <= kv.num_tokens``; while the request runs, the KV cache
  manager holds exactly ``num_computed_tokens`` slots for it between steps (the
  scheduler reserves a step's slots right before its forward);
* a request samples when its forward leaves ``num_computed_tokens == kv.num_tokens``;
* ``num_cached_tokens`` is the prefix-cache hit taken at its first admission: whole
  blocks, never the last prompt token; for a segmented request, plus the module
  tokens reused and not recomputed (:mod:`engine.core.module_assembler`);
* while a segmented request's KV is assembled (``assembly.active``), it holds
  slots for all its tokens and ``num_computed_tokens`` is the first position still
  to compute;
* ``tenant`` (the scheduler's fairness key) is the request's tenant, else its cache
  salt, else None (one shared tenant).
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from typing import Any

from engine.core.assembly import Assembly, assembly_key, exact_head_tokens
from engine.core.detokenizer import Detokenizer
from engine.core.ngram_draft import NgramDraft
from engine.core.output_stream import GenerationRequest, OutputStream
from engine.core.prompt_logprobs import PromptLogprobs
from engine.core.sampler import make_generator
from engine.kvcache.request import Request
from engine.model.packed_kv import PackedKV


class EngineRequest:
    """A GenerationRequest being served."""

    def __init__(
        self,
        request: GenerationRequest,
        *,
        block_size: int,
        max_model_len: int,
        tokenizer: Any,
        eos_token_ids: Iterable[int],
        fallback_seed: int,
    ) -> None:
        self.request_id = request.request_id
        self.params = request.params
        self.max_model_len = max_model_len
        self.kv = Request(
            request.request_id,
            request.prompt_token_ids,
            cache_salt=request.cache_salt,
            mm_items=request.mm_items,
            block_size=block_size,
            assembly=None if request.segmented is None else assembly_key(request.segmented),
            exact_blocks=0 if request.segmented is None else exact_head_tokens(request.segmented) // block_size,
        )
        self.segmented = request.segmented
        self.assembly: Assembly | None = None
        self.num_prompt_tokens = self.kv.num_prompt_tokens
        self.mm_inputs = request.mm_inputs
        self.tenant = request.tenant if request.tenant is not None else request.cache_salt
        self.num_computed_tokens = 0
        self.num_cached_tokens = 0
        self.admitted = False
        self.generator = make_generator(request.params, fallback_seed)
        self.detokenizer = Detokenizer(tokenizer, request.params, eos_token_ids)
        self.stream: OutputStream | None = None
        self.arrival_time = time.monotonic()
        self.num_preemptions = 0
        top = request.params.prompt_logprobs
        self.prompt_logprobs: PromptLogprobs | None = (
            None if top is None else PromptLogprobs(request.prompt_token_ids, top)
        )
        """Filled while the prompt is computed; handed out (and set to None) with the first token."""
        self.compress = False
        """Compress this request's KV after its prefill (resolved by the engine)."""
        self.packed: PackedKV | None = None
        """Its packed K/V once compressed (:mod:`engine.model.packed_kv`), else None."""
        self.packed_reservation: int | None = None
        self.layerwise = False
        """Its chunks over packed pages are computed layer-wise (resolved by the engine:
        the schedule says so and the request wants no prompt logprobs, which need every
        row's logits); the scheduler then reserves each layer the rows it computes."""
        self.packed_from_start = False
        """It was packed at admission (layer-wise, no prefix-cache hit): it never held an
        exact block, and its prefill's last chunk counts it as compressed."""
        self.stays_exact = False
        """Its compression was refused (no room for the packed blocks): exact from then on."""
        self.reserved = 0
        """Blocks the scheduler reserved for it while running (:meth:`Scheduler.reservation`)."""
        self.draft: NgramDraft | None = None
        """Its draft-token lookup (speculative decoding), made by the scheduler on its first decode."""
        self.capture_tail = 0
        """Tokens its last prefill chunk computes at least (a compressed request's window:
        the scheduler shortens the chunk before it and its prefix-cache hit to leave them)."""

    @property
    def num_uncomputed_tokens(self) -> int:
        """Tokens whose K/V are still to be computed (1 while decoding); while a
        segmented request's KV is being assembled, its encode and run tokens."""
        if self.assembly is not None and self.assembly.active:
            return self.assembly.num_pending
        return self.kv.num_tokens - self.num_computed_tokens

    def advance(self, end: int) -> None:
        """After a forward that computed this request's tokens up to ``end``."""
        self.num_computed_tokens = end if self.assembly is None else self.assembly.frontier(end)

    @property
    def prefilling(self) -> bool:
        """True while part of the prompt has no K/V yet."""
        return self.num_computed_tokens < self.num_prompt_tokens

    def append_token(self, token_id: int) -> str | None:
        """Record a sampled token; returns the finish reason when it ends the request."""
        self.kv.append_output_token_ids(token_id)
        reason = self.detokenizer.add(token_id)
        if reason is None and (
            len(self.kv.output_token_ids) >= self.params.max_tokens
            or self.kv.num_tokens >= self.max_model_len
        ):
            reason = "length"
        return reason

    def __repr__(self) -> str:
        return f"EngineRequest({self.request_id!r}, computed={self.num_computed_tokens}/{self.kv.num_tokens})"
