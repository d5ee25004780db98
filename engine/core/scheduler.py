"""Scheduler: which tokens of which requests the next forward computes.

The scheduler owns the :class:`~engine.kvcache.kv_cache_manager.KVCacheManager`:
admission, block allocation and preemption are decided here and nowhere else.
Each step (:meth:`Scheduler.schedule`) fills a budget of ``max_num_batched_tokens``:

1. decodes first: one token for every running request with one token left to
   compute, in admission order;
2. then prefill, shared between tenants (a request's tenant is its
   ``GenerationRequest.tenant``, else its cache salt; requests with neither share
   one tenant). Each tenant with prefill work (running requests still prefilling,
   then its waiting requests, first come first served) gets an equal share of what
   is left of the budget, water-filled: a tenant needing less than its share
   leaves the rest to the others. Tenants are served least recently served first,
   so a tenant that just arrived is in the very next forward, beside (not behind)
   another tenant's long prompt: one tenant's long prompts delay another's short
   request by at most the forward already under way. Within a tenant, the oldest
   request takes the tenant's share first (its chunk takes all of it until its
   last chunk), as before. In the step where a tenant arrives beside tenants
   already prefilling, every tenant gets at most the newcomer's demand, so that
   forward costs about what the newcomer's costs alone (never two such steps in a
   row: the others keep at least every other full step).

Admission of a waiting request (while fewer than ``max_num_seqs`` run): take the
prefix-cache hit, allocate blocks for the first chunk of the rest. A request whose
reservation or blocks do not fit stops admission for its tenant in this step (it
never preempts running requests); other tenants' requests may still be admitted.
When a running request finds no free block, the most recently admitted running
request not yet scheduled in this step is preempted (its blocks freed, back to the
head of the queue; later recomputed, mostly from the prefix cache), possibly the
request itself. A request already scheduled in this step is never preempted: its
blocks were cached at allocation and may already be shared.

Prefix sharing while running: a full block is cached (findable by its hash) as
soon as the step that computes it is scheduled, so a request admitted later in the
same step or in any later step shares it through its ref count. A block's K/V are
written at the start of each layer's attention, before any sequence of the batch
reads, so a sharer in the same forward reads finished values. A request that
arrives while another is still prefilling the same prefix therefore never
recomputes it: its admission is deferred while the next block it could hit is
one a running request is still to compute (whatever their tenants), and within a
tenant the producer's chunk takes the tenant's whole share until its last chunk.
The newcomer waits at most as many steps as the producer has chunks left (tested
in ``tests/engine/core/test_engine_batching.py``).

Segmented requests (prompt modules, :mod:`engine.core.module_assembler`): admitted
with blocks for all their tokens plus their missing module blocks; their module
encodes (``SchedulerOutput.encodes``), copies (``SchedulerOutput.copies``, applied
before the forward) and runs (several ``ScheduledSequence`` of one request in one
step, in position order) take their tenant's prefill share like any prefill; a
preempted or aborted one uncaches its blocks past its frontier first. Their blocks
are cached at admission, before they are written: a request whose hit includes
such a block waits until its producer has computed it.

Invariants:

* admission is by reservation: the running requests' reservations
  (``ceil(min(prompt + max_tokens, prompt + RESERVE_HORIZON, max_model_len) /
  block_size)`` blocks each) never exceed the pool, so preemption only happens
  to requests generating past their horizon;
* a request is in exactly one of ``waiting`` and ``running`` until it finishes;
  a step schedules a request at most once;
* between steps a running request holds slots for exactly its
  ``num_computed_tokens`` (a waiting one holds no block), except a segmented
  request still assembling, which holds slots for all its tokens;
* the tenants remembered for ordering are those with work (bounded by the requests).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from engine.config import DEFAULT_MAX_NUM_BATCHED_TOKENS, DEFAULT_MAX_NUM_SEQS
from engine.core.assembly import anchor_of
from engine.core.engine_request import EngineRequest
from engine.core.module_assembler import ModuleAssembler
from engine.kvcache.kv_cache_manager import BlockLoader, KVCacheManager
from engine.model.kv_shift import KVCopy

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


@dataclass(frozen=True)
class ModuleEncode:
    """Compute a prompt module's tokens ``token_ids`` at positions ``start ..`` into the
    module blocks ``block_ids`` (no sampling), for ``request``'s assembly."""

    request: EngineRequest
    token_ids: list[int]
    start: int
    block_ids: list[int]


@dataclass
class SchedulerOutput:
    """One step's work, in batch order, and the requests preempted to make room.
    ``copies`` (module K/V moved into segmented requests' blocks) are done before the
    forward, in order; ``encodes`` (module K/V computed) are part of the forward."""

    scheduled: list[ScheduledSequence] = field(default_factory=list)
    preempted: list[EngineRequest] = field(default_factory=list)
    encodes: list[ModuleEncode] = field(default_factory=list)
    copies: list[KVCopy] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled) + sum(len(e.token_ids) for e in self.encodes)


class _Step:
    """One step being planned: its output, the budget left, who is already scheduled."""

    def __init__(self, budget: int) -> None:
        self.out = SchedulerOutput()
        self.budget = budget
        self.requests: set[EngineRequest] = set()

    def add(self, seq: ScheduledSequence) -> None:
        self.out.scheduled.append(seq)
        self.requests.add(seq.request)
        self.budget -= seq.num_new_tokens


def _water_fill(demands: dict[str | None, int], budget: int) -> dict[str | None, int]:
    """Equal shares of ``budget``; a demand below its share leaves the rest to the others."""
    shares: dict[str | None, int] = {}
    left = len(demands)
    for tenant, demand in sorted(demands.items(), key=lambda kv: kv[1]):
        shares[tenant] = min(demand, -(-budget // left) if left else 0)
        budget -= shares[tenant]
        left -= 1
    return shares


class Scheduler:
    """Continuous batching under a token budget and a block budget, fair between tenants."""

    def __init__(
        self,
        kv_cache_manager: KVCacheManager,
        max_model_len: int,
        *,
        max_num_seqs: int = DEFAULT_MAX_NUM_SEQS,
        max_num_batched_tokens: int = DEFAULT_MAX_NUM_BATCHED_TOKENS,
        model: str = "model",
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
        self.modules = ModuleAssembler(kv_cache_manager, model)
        self.num_steps = 0
        self._last_served: dict[str | None, int] = {}  # tenant -> step of its last prefill tokens
        self._capped_last = False  # the previous step's prefill was capped for a newcomer
        self._prefilling_before: set[str | None] = set()  # tenants with prefill work in the previous step

    def reservation(self, req: EngineRequest) -> int:
        """Blocks set aside for a request at admission: its prompt and horizon, and for
        a segmented request the module blocks it may hold until its copies (each
        module's, whether cached or not); never more than the pool."""
        prompt = req.num_prompt_tokens
        tokens = min(prompt + req.params.max_tokens, prompt + self.reserve_horizon, self.max_model_len)
        blocks = -(-tokens // self.block_size)
        if req.segmented is not None and self._assembles(req):
            anchor = len(anchor_of(req.segmented))
            blocks += sum(-(-(anchor + len(s.token_ids)) // self.block_size)
                          for s in req.segmented.segments if s.module is not None)
        return min(blocks, self.num_blocks)

    def add(self, req: EngineRequest) -> None:
        self.waiting.append(req)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def all_requests(self) -> list[EngineRequest]:
        return [*self.running, *self.waiting]

    # ------------------------------------------------------------------ a step
    def schedule(self) -> SchedulerOutput:
        """Choose this step's work and reserve its slots (see the module docstring)."""
        self.num_steps += 1
        step = _Step(self.max_num_batched_tokens)
        for req in list(self.running):
            if step.budget <= 0:
                break
            if req.num_uncomputed_tokens == 1 and req in self.running:
                self._run(req, 1, step)
        queues = self._prefill_queues()
        order = sorted(queues, key=lambda t: self._last_served.get(t, -1))
        demands = {t: sum(r.num_uncomputed_tokens for r in queues[t]) for t in order}
        step.budget = self._newcomer_cap(demands, step.budget)
        shares = _water_fill(demands, step.budget)
        carry = 0
        for tenant in order:
            allowance = min(shares[tenant] + carry, step.budget)
            used = self._prefill_tenant(queues[tenant], allowance, step)
            carry = allowance - used
            if used:
                self._last_served[tenant] = self.num_steps
        for tenant in [t for t in self._last_served if t not in queues]:
            del self._last_served[tenant]
        return step.out

    def _newcomer_cap(self, demands: dict[str | None, int], budget: int) -> int:
        """The prefill budget of this step: when a tenant arrives (no prefill work in the
        previous step) beside tenants already prefilling, the step gives every tenant at
        most the newcomers' largest demand, so the newcomer's first forward costs about
        what it costs alone; never two such steps in a row, so the others lose at most
        every other full step to newcomers."""
        new = [d for t, d in demands.items() if t not in self._prefilling_before]
        capped = bool(new) and len(new) < len(demands) and not self._capped_last
        cap = max(new) * len(demands) if capped else budget
        self._capped_last = cap < budget
        self._prefilling_before = set(demands)
        return min(cap, budget)

    def _prefill_queues(self) -> dict[str | None, list[EngineRequest]]:
        """Each tenant's prefill work in order: its running prefilling requests (admission
        order), then its waiting requests (queue order)."""
        queues: dict[str | None, list[EngineRequest]] = {}
        for req in self.running:
            if req.num_uncomputed_tokens > 1:
                queues.setdefault(req.tenant, []).append(req)
        for req in self.waiting:
            queues.setdefault(req.tenant, []).append(req)
        return queues

    def _prefill_tenant(self, queue: list[EngineRequest], allowance: int, step: _Step) -> int:
        """Give up to ``allowance`` tokens to one tenant's queue, oldest first; the tokens used."""
        used = 0
        for req in queue:
            if used >= allowance or step.budget <= 0:
                break
            n = min(req.num_uncomputed_tokens, allowance - used, step.budget)
            if req in self.running:
                if self._run(req, n, step):
                    used += n
            elif req in self.waiting:
                admitted = self._admit(req, n, step)
                if admitted is None:
                    break  # stops admission for this tenant (FCFS within a tenant)
                used += admitted
        return used

    def _run(self, req: EngineRequest, n: int, step: _Step) -> bool:
        """Schedule ``n`` more tokens of a running request; False when it was preempted."""
        if req.assembly is not None and req.assembly.active:
            return self._assemble(req, n, step) > 0
        if not self._allocate_or_preempt(req, n, step):
            return False
        step.add(ScheduledSequence(req, req.num_computed_tokens, n))
        return True

    def _admit(self, req: EngineRequest, most: int, step: _Step) -> int | None:
        """Admit a waiting request with a first chunk of at most ``most`` tokens beyond its
        hit; the tokens scheduled, or None when it cannot be admitted in this step."""
        if len(self.running) >= self.max_num_seqs:
            return None
        need = self.reservation(req)
        if self.reserved_blocks + need > self.num_blocks:
            return None
        kvm = self.kv_cache_manager
        self._load_from_lower_tier(req)
        hits, num_cached = kvm.get_computed_blocks(req.kv, count=False)
        if self._next_block_in_progress(req, num_cached):
            return None
        n = min(req.kv.num_tokens - num_cached, most)
        assembled = self._assembles(req)
        if assembled:
            if not self.modules.admit(req, hits, num_cached):
                return None
        elif kvm.allocate_slots(req.kv, n, num_cached, hits) is None:
            return None
        self.waiting.remove(req)
        kvm.count_query(req.kv, num_cached)
        if not req.admitted:
            req.admitted = True
            req.num_cached_tokens = num_cached + (req.assembly.num_reused if req.assembly else 0)
        req.num_computed_tokens = num_cached
        self.running.append(req)
        self.reserved_blocks += need
        if assembled:
            return self._assemble(req, most, step)
        step.add(ScheduledSequence(req, num_cached, n))
        return n

    def _assembles(self, req: EngineRequest) -> bool:
        """A segmented request's KV is assembled from modules (with prefix caching on;
        off, it is computed exactly like any request)."""
        return req.segmented is not None and self.kv_cache_manager.enable_caching

    def _assemble(self, req: EngineRequest, most: int, step: _Step) -> int:
        """Schedule up to ``most`` tokens of a segmented request's assembly
        (:mod:`engine.core.module_assembler`); the tokens scheduled."""
        encodes, copies, runs = self.modules.schedule(req, min(most, step.budget))
        step.out.copies.extend(copies)
        if copies:
            step.requests.add(req)  # its blocks are written this step: never preempted in it
        used = 0
        for token_ids, start, block_ids in encodes:
            step.out.encodes.append(ModuleEncode(req, token_ids, start, block_ids))
            step.requests.add(req)
            used += len(token_ids)
        step.budget -= used
        for start, n in runs:
            step.add(ScheduledSequence(req, start, n))
            used += n
        return used

    def _next_block_in_progress(self, req: EngineRequest, num_cached: int) -> bool:
        """True when the next block ``req`` could hit is one a running request has not
        computed yet (admitting ``req`` now would compute it a second time), or when
        one of its hits is a block a segmented request still assembling cached at
        admission and has not written yet (its exact head or assembled blocks)."""
        if not self.kv_cache_manager.enable_caching:
            return False
        index = num_cached // self.block_size
        hit = req.kv.block_hashes[:index]
        wanted = req.kv.block_hashes[index] if index < (req.kv.num_tokens - 1) // self.block_size else None
        for other in self.running:
            assembling = other.assembly is not None and other.assembly.active
            if other.num_uncomputed_tokens <= 1 and not assembling:
                continue
            pending = other.kv.block_hashes[other.num_computed_tokens // self.block_size :]
            if wanted is not None and wanted in pending:
                return True
            if hit and assembling and not set(pending).isdisjoint(hit):
                return True
        return False

    def _load_from_lower_tier(self, req: EngineRequest) -> None:
        """Before admission: blocks of ``req``'s chain past its RAM hit that the block
        loader (the disk tier) holds become cached blocks, so the hit below takes them."""
        if self.block_loader is not None:
            self.kv_cache_manager.load_blocks(req.kv, self.block_loader)

    def _allocate_or_preempt(self, req: EngineRequest, n: int, step: _Step) -> bool:
        """Reserve ``n`` more slots for a running request, preempting the newest running
        request not scheduled in this step while no block is free. False when ``req``
        itself was preempted."""
        while self.kv_cache_manager.allocate_slots(req.kv, n) is None:
            victim = next(r for r in reversed(self.running) if r is req or r not in step.requests)
            self._preempt(victim)
            step.out.preempted.append(victim)
            if victim is req:
                return False
        return True

    def _drop_blocks(self, req: EngineRequest) -> None:
        """Free ``req``'s blocks; a segmented request still assembling first uncaches
        those past its frontier (cached at admission, not written yet)."""
        if req.assembly is not None and req.assembly.active:
            self.kv_cache_manager.uncache_unwritten_blocks(req.request_id, req.num_computed_tokens)
        self.kv_cache_manager.free(req.request_id)
        self.modules.release(req)

    def _preempt(self, req: EngineRequest) -> None:
        self._drop_blocks(req)
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
        for req in self.running:
            if req.request_id == request_id:
                self._drop_blocks(req)
                self.running.remove(req)
                self.reserved_blocks -= self.reservation(req)
                return req
        self.kv_cache_manager.free(request_id)
        for i, waiting in enumerate(self.waiting):
            if waiting.request_id == request_id:
                del self.waiting[i]
                return waiting
        return None
