"""EngineRequest: one request's state inside the engine loop thread.

It ties together the KV cache manager's view of the request (:class:`Request`:
token ids and block hashes), its block allocation, its working cache in the
model runner, its sampler generator and its detokenizer.

Invariants:

* ``kv.num_tokens == num_prompt_tokens + number of sampled tokens``;
* the KV cache manager reserves slots only for tokens whose K/V the next forward
  computes, so ``num_slots == state.num_computed`` after every forward;
* ``num_cached_tokens`` is the prefix-cache hit taken at the first prefill: whole
  blocks, never the last prompt token;
* ``state is None`` exactly when the request holds no blocks (waiting, preempted
  or finished).
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import torch

from engine.block_hash import BlockHash
from engine.detokenizer import Detokenizer
from engine.model_runner import SequenceState
from engine.output_stream import GenerationRequest, OutputStream
from engine.request import Request
from engine.sampler import make_generator

if TYPE_CHECKING:
    from engine.llm_engine import LLMEngine

INITIAL_OUTPUT_CAPACITY = 256


class EngineRequest:
    """A GenerationRequest being served."""

    def __init__(self, request: GenerationRequest, engine: LLMEngine, fallback_seed: int) -> None:
        self.request_id = request.request_id
        self.params = request.params
        self.engine = engine
        self.kv = Request(
            request.request_id,
            request.prompt_token_ids,
            cache_salt=request.cache_salt,
            mm_items=request.mm_items,
            block_size=engine.block_size,
        )
        self.num_prompt_tokens = self.kv.num_prompt_tokens
        self.num_cached_tokens = 0
        self.generator = make_generator(request.params, fallback_seed)
        self.detokenizer = Detokenizer(engine.tokenizer, request.params, engine.eos_token_ids)
        self.stream: OutputStream | None = None
        self.state: SequenceState | None = None
        self.arrival_time = time.monotonic()
        self.num_preemptions = 0

    def prefill(self) -> torch.Tensor | None:
        """Take the prefix-cache hit, allocate blocks, run every token not cached.

        Runs the prompt on first admission, and prompt plus output so far after a
        preemption. Returns None, changing nothing but the cache statistics, when the
        blocks do not fit right now.
        """
        kvm = self.engine.kv_cache_manager
        hit_blocks, num_cached = kvm.get_computed_blocks(self.kv)
        if kvm.allocate_slots(self.kv, self.kv.num_tokens - num_cached, num_cached, hit_blocks) is None:
            return None
        if not self.kv.output_token_ids:
            self.num_cached_tokens = num_cached
        # The working cache grows by doubling, so a large max_tokens costs nothing up front.
        remaining = self.params.max_tokens - len(self.kv.output_token_ids)
        expected = self.kv.num_tokens + min(remaining, INITIAL_OUTPUT_CAPACITY)
        capacity = min(expected, self.engine.max_model_len)
        self.state, logits = self.engine.runner.prefill(
            self.kv.all_token_ids,
            num_cached,
            kvm.get_block_ids(self.request_id),
            capacity,
            hit_hashes=[b.block_hash for b in hit_blocks if b.block_hash is not None],
        )
        return logits

    def decode(self) -> torch.Tensor | None:
        """Reserve a slot for the last sampled token and run it; None when no block is free."""
        assert self.state is not None
        kvm = self.engine.kv_cache_manager
        if kvm.allocate_slots(self.kv, 1) is None:
            return None
        return self.engine.runner.decode(
            self.state, self.kv.all_token_ids[-1], kvm.get_block_ids(self.request_id)
        )

    def preempt(self) -> None:
        """Give back the blocks and the working cache; a later prefill recomputes (mostly
        from the prefix cache) everything up to the last sampled token."""
        self.engine.kv_cache_manager.free(self.request_id)
        self.state = None
        self.num_preemptions += 1

    def append_token(self, token_id: int) -> str | None:
        """Record a sampled token; returns the finish reason when it ends the request."""
        self.kv.append_output_token_ids(token_id)
        reason = self.detokenizer.add(token_id)
        if reason is None and (
            len(self.kv.output_token_ids) >= self.params.max_tokens
            or self.kv.num_tokens >= self.engine.max_model_len
        ):
            reason = "length"
        return reason

    def written_block_hashes(self) -> list[BlockHash]:
        """Hashes of the full blocks whose K/V the working cache holds."""
        if self.state is None:
            return []
        return self.kv.block_hashes[: self.state.num_computed // self.engine.block_size]

    def forget_unwritten_blocks(self) -> None:
        """After a failed forward: drop the hashes of blocks whose K/V were never written."""
        written = self.state.num_computed if self.state is not None else self.num_cached_tokens
        self.engine.kv_cache_manager.uncache_unwritten_blocks(self.request_id, written)
