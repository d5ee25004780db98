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
from collections.abc import Iterable
from typing import Any

import torch

from engine.core.detokenizer import Detokenizer
from engine.core.output_stream import GenerationRequest, OutputStream
from engine.core.sampler import make_generator
from engine.kvcache.block_hash import BlockHash
from engine.kvcache.kv_cache_manager import KVCacheManager
from engine.kvcache.request import Request
from engine.model.runner import ModelRunner, SequenceState

INITIAL_OUTPUT_CAPACITY = 256


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
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.kv = Request(
            request.request_id,
            request.prompt_token_ids,
            cache_salt=request.cache_salt,
            mm_items=request.mm_items,
            block_size=block_size,
        )
        self.num_prompt_tokens = self.kv.num_prompt_tokens
        self.num_cached_tokens = 0
        self.generator = make_generator(request.params, fallback_seed)
        self.detokenizer = Detokenizer(tokenizer, request.params, eos_token_ids)
        self.stream: OutputStream | None = None
        self.state: SequenceState | None = None
        self.arrival_time = time.monotonic()
        self.num_preemptions = 0

    def prefill(self, kvm: KVCacheManager, runner: ModelRunner) -> torch.Tensor | None:
        """Take the prefix-cache hit, allocate blocks, run every token not cached.

        Runs the prompt on first admission, and prompt plus output so far after a
        preemption. Returns None, changing nothing but the cache statistics, when the
        blocks do not fit right now.
        """
        hit_blocks, num_cached = kvm.get_computed_blocks(self.kv)
        if kvm.allocate_slots(self.kv, self.kv.num_tokens - num_cached, num_cached, hit_blocks) is None:
            return None
        if not self.kv.output_token_ids:
            self.num_cached_tokens = num_cached
        # The working cache grows by doubling, so a large max_tokens costs nothing up front.
        remaining = self.params.max_tokens - len(self.kv.output_token_ids)
        expected = self.kv.num_tokens + min(remaining, INITIAL_OUTPUT_CAPACITY)
        capacity = min(expected, self.max_model_len)
        self.state, logits = runner.prefill(
            self.kv.all_token_ids,
            num_cached,
            kvm.get_block_ids(self.request_id),
            capacity,
            hit_hashes=[b.block_hash for b in hit_blocks if b.block_hash is not None],
        )
        return logits

    def decode(self, kvm: KVCacheManager, runner: ModelRunner) -> torch.Tensor | None:
        """Reserve a slot for the last sampled token and run it; None when no block is free."""
        assert self.state is not None
        if kvm.allocate_slots(self.kv, 1) is None:
            return None
        return runner.decode(
            self.state, self.kv.all_token_ids[-1], kvm.get_block_ids(self.request_id)
        )

    def preempt(self, kvm: KVCacheManager) -> None:
        """Give back the blocks and the working cache; a later prefill recomputes (mostly
        from the prefix cache) everything up to the last sampled token."""
        kvm.free(self.request_id)
        self.state = None
        self.num_preemptions += 1

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

    def written_block_hashes(self) -> list[BlockHash]:
        """Hashes of the full blocks whose K/V the working cache holds."""
        if self.state is None:
            return []
        return self.kv.block_hashes[: self.state.num_computed // self.block_size]

    def forget_unwritten_blocks(self, kvm: KVCacheManager) -> None:
        """After a failed forward: drop the hashes of blocks whose K/V were never written."""
        written = self.state.num_computed if self.state is not None else self.num_cached_tokens
        kvm.uncache_unwritten_blocks(self.request_id, written)
