"""Scheduler: which tokens of which requests the next forward computes.

The scheduler owns the :class:`~engine.kvcache.kv_cache_manager.KVCacheManager`:
admission, block allocation and preemption are decided here and nowhere else.
Each step (:meth:`Scheduler.schedule`) fills a budget of ``max_num_batched_tokens``:

1. running requests first, in admission order: one token for a decoding request,
   the next chunk of the prompt for one still prefilling. When no block is free
   for it, the most recently admitted running request is preempted (its blocks
   freed, back to the head of the queue; later recomputed, mostly from the prefix
   cache), possibly the request itself;
2. then waiting requests, first come first served, while fewer than
   ``max_num_seqs`` run: take the prefix-cache hit, allocate blocks for the
   first chunk of the rest. A request whose blocks do not fit stops admission
   (it never preempts running requests).

Prefix sharing while running: a full block is cached (findable by its hash) as
soon as the step that computes it is scheduled, so a request admitted later in the
same step or in any later step shares it through its ref count. A block's K/V are
written at the start of each layer's attention, before any sequence of the batch
reads, so a sharer in the same forward reads finished values. A request that
arrives while another is still prefilling the same prefix therefore never
recomputes it: the producer runs first every step and its chunk takes the whole
remaining token budget until its last chunk, so nothing behind it is admitted
before that step; in that step all the producer's full prompt blocks are cached
at allocation, and the newcomer, admitted after it, hits them. The newcomer waits
at most as many steps as the producer has chunks left (tested in
``tests/engine/core/test_engine_batching.py``).

Invariants:

* admission is by reservation: the running requests' reservations
  (``ceil(min(prompt + max_tokens, prompt + RESERVE_HORIZON, max_model_len) /
  block_size)`` blocks each) never exceed the pool, so preemption only happens
  to requests generating past their horizon;
* a request is in exactly one of ``waiting`` and ``running`` until it finishes;
* between steps a running request holds slots for exactly its
  ``num_computed_tokens`` (a waiting one holds no block).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from engine.config import DEFAULT_MAX_NUM_BATCHED_TOKENS, DEFAULT_MAX_NUM_SEQS
from engine.core.engine_request import EngineRequest
from engine.kvcache.kv_cache_manager import BlockLoader, KVCacheManager

RESERVE_HORIZON = 1024
"""Output tokens a request's admission reservation covers at most."""


@dataclass(frozen=True)
class ScheduledSequence:
    """Compute ``request``'s tokens ``[start, start + num_new_tokens)`` this step."""

    request: EngineRequest
    start: int
    num_new_tokens: int

    @property
    def end(self) -> int:
        return self.start + self.num_new_tokens

    @property
    def samples(self) -> bool:
        """The forward covers the request's last token: a token is sampled after it."""
        return self.end == self.request.kv.num_tokens


@dataclass
class SchedulerOutput:
    """One step's work, in batch order, and the requests preempted to make room."""

    scheduled: list[ScheduledSequence] = field(default_factory=list)
    preempted: list[EngineRequest] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)


class Scheduler:
    """Continuous batching under a token budget and a block budget."""

    def __init__(
        self,
        kv_cache_manager: KVCacheManager,
        max_model_len: int,
        *,
        max_num_seqs: int = DEFAULT_MAX_NUM_SEQS,
        max_num_batched_tokens: int = DEFAULT_MAX_NUM_BATCHED_TOKENS,
    ) -> None:
        if max_num_seqs < 1 or max_num_batched_tokens < 1:
            raise ValueError(
                f"max_num_seqs and max_num_batched_tokens must be >= 1, got "
                f"{max_num_seqs!r} and {max_num_batched_tokens!r}"
            )
        self.kv_cache_manager = kv_cache_manager
        self.block_size = kv_cache_manager.block_size
        self.num_blocks = kv_cache_manager.num_blocks
        self.max_model_len = max_model_len
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[EngineRequest] = deque()
        self.running: list[EngineRequest] = []
        self.reserved_blocks = 0
        self.reserve_horizon = RESERVE_HORIZON
        self.num_preemptions = 0
        self.block_loader: BlockLoader | None = None

    def reservation(self, req: EngineRequest) -> int:
        """Blocks set aside for a request at admission."""
        prompt = req.num_prompt_tokens
        tokens = min(prompt + req.params.max_tokens, prompt + self.reserve_horizon, self.max_model_len)
        return -(-tokens // self.block_size)

    def add(self, req: EngineRequest) -> None:
        self.waiting.append(req)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def all_requests(self) -> list[EngineRequest]:
        return [*self.running, *self.waiting]

    # ------------------------------------------------------------------ a step
    def schedule(self) -> SchedulerOutput:
        """Choose this step's work and reserve its slots (see the module docstring)."""
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            n = min(req.num_uncomputed_tokens, budget)
            if self._allocate_or_preempt(req, n, out):
                out.scheduled.append(ScheduledSequence(req, req.num_computed_tokens, n))
                budget -= n
                i += 1
        kvm = self.kv_cache_manager
        while self.waiting and len(self.running) < self.max_num_seqs and budget > 0:
            req = self.waiting[0]
            need = self.reservation(req)
            if self.reserved_blocks + need > self.num_blocks:
                break
            self._load_from_lower_tier(req)
            hits, num_cached = kvm.get_computed_blocks(req.kv, count=False)
            n = min(req.kv.num_tokens - num_cached, budget)
            if kvm.allocate_slots(req.kv, n, num_cached, hits) is None:
                break
            self.waiting.popleft()
            kvm.count_query(req.kv, num_cached)
            if not req.admitted:
                req.admitted = True
                req.num_cached_tokens = num_cached
            req.num_computed_tokens = num_cached
            self.running.append(req)
            self.reserved_blocks += need
            out.scheduled.append(ScheduledSequence(req, num_cached, n))
            budget -= n
        return out

    def _load_from_lower_tier(self, req: EngineRequest) -> None:
        """Before admission: blocks of ``req``'s chain past its RAM hit that the block
        loader (the disk tier) holds become cached blocks, so the hit below takes them."""
        if self.block_loader is not None:
            self.kv_cache_manager.load_blocks(req.kv, self.block_loader)

    def _allocate_or_preempt(self, req: EngineRequest, n: int, out: SchedulerOutput) -> bool:
        """Reserve ``n`` more slots for a running request, preempting the newest running
        requests while none is free. False when ``req`` itself was preempted."""
        while self.kv_cache_manager.allocate_slots(req.kv, n) is None:
            victim = self.running[-1]
            self._preempt(victim)
            out.preempted.append(victim)
            if victim is req:
                return False
        return True

    def _preempt(self, req: EngineRequest) -> None:
        self.kv_cache_manager.free(req.request_id)
        self.running.remove(req)
        self.reserved_blocks -= self.reservation(req)
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(req)

    # ---------------------------------------------------------- after a step
    def forget_unwritten(self, out: SchedulerOutput) -> None:
        """After a failed forward: no block the step was computing stays findable."""
        for s in out.scheduled:
            self.kv_cache_manager.uncache_unwritten_blocks(s.request.request_id, s.start)

    def finish(self, req: EngineRequest) -> None:
        """Take a finished request out of the queues and free its blocks."""
        self.remove(req.request_id)

    def remove(self, request_id: str) -> EngineRequest | None:
        """Take a request out of the queues and free its blocks; None if unknown."""
        self.kv_cache_manager.free(request_id)
        for req in self.running:
            if req.request_id == request_id:
                self.running.remove(req)
                self.reserved_blocks -= self.reservation(req)
                return req
        for i, waiting in enumerate(self.waiting):
            if waiting.request_id == request_id:
                del self.waiting[i]
                return waiting
        return None
