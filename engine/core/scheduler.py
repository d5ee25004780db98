"""Scheduler: which tokens of which requests the next forward computes.

The scheduler owns the :class:`~engine.kvcache.kv_cache_manager.KVCacheManager`:
admission, block allocation and preemption are decided here and nowhere else.
Each step (:meth:`Scheduler.schedule`) fills a budget of ``max_num_batched_tokens``:

1. decodes first: one token for every running request with one token left to
   compute, in admission order, plus up to ``speculative_tokens`` draft tokens
   (:mod:`engine.core.ngram_draft`) while the step's decode rows stay within
   :data:`SPECULATIVE_ROWS` and the pool keeps a free block per running request after
   the drafts' slots (drafting never preempts); the engine keeps the drafts that
   equal what it samples and :meth:`Scheduler.settle` gives the other slots back;
2. then prefill, shared between tenants (a request's tenant is its
   ``GenerationRequest.tenant``, else its cache salt; requests with neither share
   one tenant). Each tenant with prefill work (running requests still prefilling,
   then its waiting requests, first come first served) gets an equal share of what
   is left of the budget, water-filled: a tenant needing less than its share
   leaves the rest to the others. Tenants are served least recently served first,
   so a tenant that just arrived is in the very next forward, beside (not behind)
   another tenant's long prompt. Within a tenant, the oldest request takes the
   tenant's share first (its chunk takes all of it until its last chunk).

Each step also has a cost budget, because a forward's time grows with its
contexts: :func:`chunk_cost` counts a token at context ``c`` as ``max(1, c /
context_cost_tokens)`` tokens, and a sequence whose context ``c`` passes
``context_cost_tokens`` one more token per ``sequence_cost_tokens`` past it (reading
its K/V). With the bundled model in bfloat16 on 2 CPU threads (a quiet 2-core VM),
a forward costs about 30 ms plus, per sequence at context 7.5k, 27 ms, plus per
token 0.7 ms at short context, 1.6-1.9 ms at 4k and 2.7 ms at 7.5k;
``CONTEXT_COST_TOKENS`` = 2048 and ``SEQUENCE_COST_TOKENS`` = 160 say 3.7 per token and
34 per sequence at 7.5k (the forward's fixed part is in every step and not counted).
Prefill chunks are cut so that the step's cost (its decodes included) stays within the
cost budget; the step's first prefill chunk gets at least one token, so prefill always
progresses. The cost budget is:

* ``max_num_batched_tokens`` by default: no forward costs much more than a full
  budget of short-context tokens, however long the context (about 120 tokens at 7.5k
  context with the default 512; a request arriving while a lone long prompt
  prefills waits for at most that);
* while a *light* tenant is active (it had prefill work within the last
  ``fair_window_s`` seconds and arrived with a demand costing less than
  ``max_num_batched_tokens``: the smallest such demand, but at least
  ``min(MIN_STEP_COST, max_num_batched_tokens)``) and others prefill: that much for
  the other tenants' work, plus the light tenants' own demand when they have work
  in the step. A short request of a tenant that keeps sending them so waits for at
  most a forward about as costly as its own, then runs in a forward of its own cost
  (alone, or with the others' work of about that cost when its previous request's
  step was a newcomers' step): its time to first token stays within about twice its
  cost alone, while the long prompts keep the forwards in between. (A request
  arriving after a longer pause waits for at most one forward of the default
  budget.) Tenants prefilling side by side share the step's cost equally.

In the step where a tenant arrives (none of its requests had prefill work in the
previous step: also a tenant whose last request just finished) beside tenants
already prefilling, only the newcomers prefill, their chunks first, so that forward
costs about what theirs cost alone (never two such steps in a row: the others keep
at least every other step, first in it).

Anticipation: a light tenant that sends its next request as soon as the previous
one is answered finds a forward of the others under way, however cheap, and waits
for it. So while one of such a tenant's last ``ANTICIPATE_PAUSES`` pauses between
requests (a new request's arrival minus when its previous prefill work ended) was at
most ``ANTICIPATE_S``, :meth:`Scheduler.schedule` plans nothing for up to
``ANTICIPATE_S`` after its prefill work ends, while all the prefill work there is
belongs to tenants that arrived with a whole budget's demand or more and they alone
run (another light or newly arrived tenant's request, decoding or not, is never held
back; their decodes wait with the rest).
:meth:`Scheduler.hold_s` tells the engine loop how long to wait unless a request
arrives. At most one hold per request of the light tenant, so the others lose at
most ``ANTICIPATE_S`` per such request; a tenant pausing longer
(``ANTICIPATE_PAUSES`` times in a row) is not waited for.

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
before the forward), runs (several ``ScheduledSequence`` of one request in one
step, in position order, each charged at its context) and ``cacheblend``'s probe
(``SchedulerOutput.probes``, chunked at its share of a token per position) take their
tenant's prefill share like any prefill; a
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
  ``num_computed_tokens`` (a waiting one holds no block; a step's draft slots are
  given back by :meth:`Scheduler.settle`), except a segmented
  request still assembling, which holds slots for all its tokens;
* the tenants remembered for ordering are those with work (bounded by the requests);
  those remembered for the cost budget and anticipation had prefill work within
  ``fair_window_s``; a hold lasts at most ``ANTICIPATE_S`` and plans nothing;
* a compressed request (``req.packed``) is exact until its prefill ends (with
  progressive packing, until a chunk reaches ``min_tokens``; its later chunks, at
  most ``PyramidSchedule.chunk`` tokens, grow its packed pages; a layer-wise one with
  no prefix-cache hit is packed from admission, :meth:`Scheduler._start_packed`); then
  :meth:`Scheduler.compress` swaps its blocks for packed ones (never holding both
  tables) and its reservation for the packed one; :meth:`Scheduler.reselect` gives
  blocks back as re-selection drops tokens; preempted, it is exact again
  (recomputed, then compressed). Its reservation is what it can hold at most: the
  exact blocks of its prefill or its packed blocks as it grows to its horizon
  (:meth:`~engine.model.pyramid.PyramidSchedule.held_counts`), whichever is more;
  one that stays exact after all takes an exact reservation then (the sum may
  exceed the pool for a while: preemption covers it).
* a step's prefill chunks cost at most what its cost budget leaves after its decodes,
  except a step's first prefill chunk, which gets at least one token.
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from engine.config import DEFAULT_MAX_NUM_BATCHED_TOKENS, DEFAULT_MAX_NUM_SEQS
from engine.core import assembly
from engine.core.assembly import anchor_of
from engine.core.engine_request import EngineRequest
from engine.core.module_assembler import ModuleAssembler
from engine.core.ngram_draft import NgramDraft
from engine.kvcache.kv_cache_manager import BlockLoader, KVCacheManager
from engine.model.kv_shift import KVCopy
from engine.model.packed_kv import PackedKV
from engine.model.pyramid import PyramidSchedule

RESERVE_HORIZON = 1024
"""Output tokens a request's admission reservation covers at most."""
CONTEXT_COST_TOKENS = 2048
"""Past this context a token's forward costs ``context / CONTEXT_COST_TOKENS`` short ones."""
SEQUENCE_COST_TOKENS = 160
"""Past ``CONTEXT_COST_TOKENS`` of context, a sequence in a forward costs one more short
token per ``SEQUENCE_COST_TOKENS`` tokens of context (reading its K/V)."""
MIN_STEP_COST = 32
"""The least cost budget (in short-context tokens) a step gets while tenants share."""
FAIR_WINDOW_S = 10.0
"""How long a tenant counts as active after its last prefill work."""
ANTICIPATE_S = 0.05
"""How long the engine may hold its next forward for a light tenant that sends its requests back to back."""
ANTICIPATE_PAUSES = 4
"""A tenant is anticipated while one of its last this many pauses between requests was at most ``ANTICIPATE_S``."""
SPECULATIVE_ROWS = 8
"""Most decode rows (decoding requests plus their draft tokens) a step drafts up to. A
draft row costs about 0.5 ms of a forward on 2 CPU threads (bundled model, short
context), whether 1 or 8 requests decode: against a lone decode's ~13 ms a kept draft
saves a whole forward, but with 8 requests decoding chat answers (40% of drafts kept)
the rows cost more than the forwards they saved (0.95x the tokens/s without drafts),
so from 8 decoding requests on a step drafts nothing."""


def chunk_cost(start: int, n: int, context_cost_tokens: int, sequence_cost_tokens: int = SEQUENCE_COST_TOKENS,
               ) -> float:
    """The estimated cost of computing tokens ``[start, start + n)`` of one sequence, in
    tokens at short context, its context taken as the chunk's end ``e`` (an upper bound):
    each token counts ``max(1, e / context_cost_tokens)``, and the sequence's K/V read
    ``max(0, e - context_cost_tokens) / sequence_cost_tokens``. Nothing (0) for no token;
    exactly ``n`` while ``e <= context_cost_tokens``."""
    if n <= 0:
        return 0.0
    end = start + n
    return n * max(1.0, end / context_cost_tokens) + max(0, end - context_cost_tokens) / sequence_cost_tokens


def tokens_within(start: int, cost: float, context_cost_tokens: int,
                  sequence_cost_tokens: int = SEQUENCE_COST_TOKENS) -> int:
    """The most tokens from ``start`` whose :func:`chunk_cost` is at most ``cost``."""
    if cost < 1:
        return 0
    k, s = context_cost_tokens, sequence_cost_tokens
    # past k: n^2 / k + n (start / k + 1 / s) - (cost - (start - k) / s) <= 0, its positive root
    b, c = start / k + 1 / s, cost - (start - k) / s
    n = int(2 * c / (b + math.sqrt(b * b + 4 * c / k))) if c > 0 else 0
    n = max(n, min(int(cost), k - start))  # short context: one per token
    while n > 0 and chunk_cost(start, n, k, s) > cost:
        n -= 1
    while chunk_cost(start, n + 1, k, s) <= cost:
        n += 1
    return n


@dataclass(frozen=True)
class ScheduledSequence:
    """Compute ``request``'s tokens ``[start, start + num_new_tokens)`` this step."""

    request: EngineRequest
    start: int
    num_new_tokens: int
    drafts: tuple[int, ...] = ()
    """Draft tokens computed after the decode's token (their slots are reserved as
    lookahead); the engine keeps those equal to what it samples, in order."""

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


@dataclass(frozen=True)
class ModuleProbe:
    """After this step's copies, measure the layer-1 KV deviation of ``request``'s
    positions ``[start, end)`` (``cacheblend``); the result goes to
    :meth:`Scheduler.probed`, which chooses the tokens the request recomputes."""

    request: EngineRequest
    start: int
    end: int


@dataclass
class SchedulerOutput:
    """One step's work, in batch order, and the requests preempted to make room.
    ``copies`` (module K/V moved into segmented requests' blocks) are done before the
    forward, in order, then ``probes``; ``encodes`` (module K/V computed) are part of the forward."""

    scheduled: list[ScheduledSequence] = field(default_factory=list)
    preempted: list[EngineRequest] = field(default_factory=list)
    encodes: list[ModuleEncode] = field(default_factory=list)
    copies: list[KVCopy] = field(default_factory=list)
    probes: list[ModuleProbe] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled) + sum(len(e.token_ids) for e in self.encodes)


class _Step:
    """One step being planned: its output, the budget left, who is already scheduled."""

    def __init__(self, budget: int, context_cost_tokens: int, sequence_cost_tokens: int) -> None:
        self.out = SchedulerOutput()
        self.budget = budget
        self.cost = float(budget)  # the cost budget left
        self.context_cost_tokens = context_cost_tokens
        self.sequence_cost_tokens = sequence_cost_tokens
        self.requests: set[EngineRequest] = set()
        self.num_decodes = 0  # set once the decodes are scheduled

    def most_tokens(self, start: int, cost: float) -> int:
        """The most tokens from ``start`` costing at most ``cost`` (at least one for the
        step's first prefill chunk)."""
        n = tokens_within(start, cost, self.context_cost_tokens, self.sequence_cost_tokens)
        return n if n or len(self.out.scheduled) > self.num_decodes else 1

    def add(self, seq: ScheduledSequence) -> None:
        self.out.scheduled.append(seq)
        self.requests.add(seq.request)
        n = seq.num_new_tokens + len(seq.drafts)
        self.budget -= n
        self.cost -= chunk_cost(seq.start, n, self.context_cost_tokens, self.sequence_cost_tokens)


def _water_fill(demands: dict[str | None, int], budget: int) -> dict[str | None, int]:
    """Equal shares of ``budget``; a demand below its share leaves the rest to the others."""
    shares: dict[str | None, int] = {}
    left = len(demands)
    for tenant, demand in sorted(demands.items(), key=lambda kv: kv[1]):
        shares[tenant] = min(demand, -(-budget // left) if left else 0)
        budget -= shares[tenant]
        left -= 1
    return shares


def _last_chunk_guard(req: EngineRequest, n: int, computed: int | None = None) -> int:
    """``n`` tokens, or fewer so that the request's last prefill chunk keeps at least
    ``req.capture_tail`` tokens (a compressed request selects its KV from the attention
    of its last tokens, computed together in that chunk)."""
    left = req.kv.num_tokens - (req.num_computed_tokens if computed is None else computed)
    if 0 < left - n < req.capture_tail < left:
        return left - req.capture_tail
    return n


def _cost_shares(costs: dict[str | None, float], budget: float, only: set[str | None]) -> dict[str | None, float]:
    """Equal shares of the cost ``budget``, water-filled, between the tenants in ``only``
    (all of them when empty); the others get none."""
    shares = dict.fromkeys(costs, 0.0)
    left = len(only or costs)
    for tenant in sorted(only or costs, key=lambda t: costs[t]):
        shares[tenant] = min(costs[tenant], budget / left)
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
        context_cost_tokens: int = CONTEXT_COST_TOKENS,
        sequence_cost_tokens: int = SEQUENCE_COST_TOKENS,
        fair_window_s: float = FAIR_WINDOW_S,
        speculative_tokens: int = 0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if min(max_num_seqs, max_num_batched_tokens, context_cost_tokens, sequence_cost_tokens) < 1:
            raise ValueError(
                f"max_num_seqs, max_num_batched_tokens, context_cost_tokens and sequence_cost_tokens must be "
                f">= 1, got {max_num_seqs!r}, {max_num_batched_tokens!r}, {context_cost_tokens!r} and "
                f"{sequence_cost_tokens!r}"
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
        self.pyramid: PyramidSchedule | None = None
        """The compression schedule (set by the engine), for compressed requests' reservations."""
        self.new_packed: Callable[[], PackedKV] | None = None
        """Empty packed tables over the engine's KV storage (set by the engine): a layer-wise
        request with no prefix-cache hit is packed from its first token (:meth:`_start_packed`)."""
        self.num_layers = 1
        self.reserve_horizon = RESERVE_HORIZON
        self.num_preemptions = 0
        self.block_loader: BlockLoader | None = None
        self.modules = ModuleAssembler(kv_cache_manager, model)
        self.num_steps = 0
        self._last_served: dict[str | None, int] = {}  # tenant -> step of its last prefill tokens
        self._late: set[str | None] = set()  # newcomers right after a newcomers' step: after the others
        self._capped_last = False  # only newcomers prefilled in the previous step
        self._prefilling_before: set[EngineRequest] = set()  # requests with prefill work in the previous step
        self.context_cost_tokens = context_cost_tokens
        self.sequence_cost_tokens = sequence_cost_tokens
        self.fair_window_s = fair_window_s
        self.speculative_tokens = speculative_tokens
        self.clock = clock
        # tenant -> (the cost of the demand it arrived with, when it last had prefill work)
        self._active: dict[str | None, tuple[float, float]] = {}
        self._left: dict[str | None, float] = {}  # active tenant -> when its prefill work last ended
        self._gaps: dict[str | None, deque[float]] = {}  # active tenant -> its last pauses between requests
        self._hold_until = 0.0

    def reservation(self, req: EngineRequest, hit_tokens: int = 0) -> int:
        """Blocks set aside for a request at admission: its prompt and horizon, and for
        a segmented request the module blocks it may hold until its copies (each
        module's, whether cached or not); never more than the pool. A compressed one's:
        the most it holds, exact during its prefill or packed up to its horizon
        (:meth:`packed_blocks`; its exact part is at most its prefill, or with progressive
        compression its prefix-cache hit ``hit_tokens`` plus a chunk or two). Fixed from
        admission to removal (``req.reserved``), except where :meth:`compress` changes it."""
        if req.packed_reservation is not None:
            return req.packed_reservation
        prompt = req.num_prompt_tokens
        tokens = min(prompt + req.params.max_tokens, prompt + self.reserve_horizon, self.max_model_len)
        if self._compresses(req):
            return min(max(-(-self._exact_tokens(req, hit_tokens) // self.block_size),
                           self.packed_blocks(req.kv.num_tokens, tokens)), self.num_blocks)
        blocks = -(-tokens // self.block_size)
        if req.segmented is not None and self._assembles(req):
            anchor = len(anchor_of(req.segmented))
            blocks += sum(-(-(anchor + len(s.token_ids)) // self.block_size)
                          for s in req.segmented.segments if s.module is not None)
        return min(blocks, self.num_blocks)

    def _compresses(self, req: EngineRequest) -> bool:
        """``req`` will be compressed at the end of its prefill (it asks and is long enough)."""
        return (req.compress and not req.stays_exact and self.pyramid is not None and req.segmented is None
                and req.kv.num_tokens >= self.pyramid.min_tokens)

    def _starts_packed(self, req: EngineRequest, hit_tokens: int) -> bool:
        """``req`` is computed layer-wise from its first token: it compresses, layer-wise,
        and has no prefix-cache hit (a hit's exact blocks are reused and the chunk after
        them, computed exactly, selects what the packed pages keep of them)."""
        return hit_tokens == 0 and req.layerwise and self.new_packed is not None and self._compresses(req)

    def _exact_tokens(self, req: EngineRequest, hit_tokens: int) -> int:
        """The most tokens a compressed request holds exactly, before it is packed."""
        assert self.pyramid is not None
        if self._starts_packed(req, hit_tokens):
            return 0
        if not self.pyramid.progressive:
            return req.kv.num_tokens
        return min(req.kv.num_tokens, max(hit_tokens, self.pyramid.min_tokens) + self.max_num_batched_tokens)

    def packed_blocks(self, prefill_tokens: int, total_tokens: int) -> int:
        """The most blocks a request compressed at ``prefill_tokens`` holds up to
        ``total_tokens`` (one more for how blocks are added as layers fill)."""
        assert self.pyramid is not None
        counts = self.pyramid.held_counts(prefill_tokens, max(prefill_tokens, total_tokens), self.num_layers)
        return PackedKV.blocks_for(counts, self.block_size) + 1

    def add(self, req: EngineRequest) -> None:
        self.waiting.append(req)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def all_requests(self) -> list[EngineRequest]:
        return [*self.running, *self.waiting]

    # ------------------------------------------------------------------ a step
    def hold_s(self) -> float:
        """Seconds the engine waits (unless a request arrives) before the next :meth:`schedule`
        (0: none): while it anticipates a light tenant's next request."""
        return max(0.0, self._hold_until - self.clock())

    def schedule(self) -> SchedulerOutput:
        """Choose this step's work and reserve its slots (see the module docstring); no
        work while anticipating a light tenant's next request (:meth:`hold_s`)."""
        if self._anticipating():  # forget only what finished meanwhile
            live = set(self.all_requests())
            self._prefilling_before = {r for r in self._prefilling_before if r in live}
            working = self._prefill_queues()
            for tenant in [t for t in self._last_served if t not in working]:
                del self._last_served[tenant]
            return SchedulerOutput()
        self.num_steps += 1
        step = _Step(self.max_num_batched_tokens, self.context_cost_tokens, self.sequence_cost_tokens)
        spare = SPECULATIVE_ROWS - sum(1 for r in self.running if r.num_uncomputed_tokens == 1)
        for req in list(self.running):
            if step.budget <= 0:
                break
            if req.num_uncomputed_tokens == 1 and req in self.running:
                drafts = self._drafts(req, min(self.speculative_tokens, spare, step.budget - 1))
                if self._run(req, 1, step, drafts):
                    spare -= len(step.out.scheduled[-1].drafts)
        step.num_decodes = len(step.out.scheduled)
        queues = self._prefill_queues()
        order = sorted(queues, key=lambda t: self._last_served.get(t, -1))
        demands = {t: sum(r.num_uncomputed_tokens for r in queues[t]) for t in order}
        costs = {t: sum(chunk_cost(r.num_computed_tokens, r.num_uncomputed_tokens, self.context_cost_tokens,
                                   self.sequence_cost_tokens) for r in queues[t]) for t in order}
        decodes_cost = self.max_num_batched_tokens - step.cost
        cap, newcomers = self._cost_budget(queues, costs)
        # a newcomers' step's first chunk is theirs; in the step after it, the others' are first
        order.sort(key=lambda t: (t not in newcomers, t in self._late))
        step.cost = cap - decodes_cost
        shares = _water_fill(demands, step.budget)
        cost_shares = _cost_shares(costs, step.cost, newcomers)
        carry, cost_carry = 0, 0.0
        for tenant in order:
            allowance = min(shares[tenant] + carry, step.budget)
            cost_allowance = cost_shares[tenant] + (cost_carry if not newcomers or tenant in newcomers else 0.0)
            cost_before = step.cost
            used = self._prefill_tenant(queues[tenant], allowance, cost_allowance, step)
            carry = allowance - used
            cost_carry = max(0.0, cost_allowance - (cost_before - step.cost))
            if used:
                self._last_served[tenant] = self.num_steps
        for tenant in [t for t in self._last_served if t not in queues]:
            del self._last_served[tenant]
        return step.out

    def _anticipating(self) -> bool:
        """Whether to hold this step for a light tenant whose prefill work just ended and
        one of whose last ``ANTICIPATE_PAUSES`` pauses between requests was at most
        ``ANTICIPATE_S`` (see the module docstring). Remembers when tenants' prefill work
        ends and their pauses."""
        now = self.clock()
        present: dict[str | None, float] = {}  # tenant with prefill work -> its first arrival
        for req in [*(r for r in self.running if r.num_uncomputed_tokens > 1), *self.waiting]:
            present[req.tenant] = min(present.get(req.tenant, req.arrival_time), req.arrival_time)
        for tenant in [t for t in self._left if t in present]:
            pauses = self._gaps.setdefault(tenant, deque(maxlen=ANTICIPATE_PAUSES))
            pauses.append(present[tenant] - self._left.pop(tenant))
        for tenant in {r.tenant for r in self._prefilling_before} - present.keys():
            self._left.setdefault(tenant, now)
        for tenant in [t for t in self._left if t not in self._active]:
            del self._left[tenant]
        for tenant in [t for t in self._gaps if t not in self._active]:
            del self._gaps[tenant]
        budget = self.max_num_batched_tokens
        heavy = {t for t, (cost, _) in self._active.items() if cost >= budget}
        waits = [left + ANTICIPATE_S for t, left in self._left.items()
                 if t not in heavy and min(self._gaps.get(t, [math.inf])) <= ANTICIPATE_S]
        # only the work of tenants that arrived with a whole budget's demand is held back
        held = bool(present) and present.keys() <= heavy and {r.tenant for r in self.running} <= heavy
        self._hold_until = max((w for w in waits if w > now), default=0.0) if held else 0.0
        return self._hold_until > 0

    def _cost_budget(self, queues: dict[str | None, list[EngineRequest]], costs: dict[str | None, float],
                     ) -> tuple[float, set[str | None]]:
        """This step's cost budget (decodes included) and the tenants that alone may
        prefill in it (none: all of them), from each tenant's prefill demand, cost counted
        (see the module docstring). Remembers who arrived and who is active."""
        now = self.clock()
        new = {t for t, queue in queues.items() if self._prefilling_before.isdisjoint(queue)}
        newcomers_only = bool(new) and len(new) < len(costs) and not self._capped_last
        self._late = new if new and len(new) < len(costs) and not newcomers_only else set()
        self._capped_last = newcomers_only
        for tenant, cost in costs.items():
            arrived = tenant in new or tenant not in self._active
            self._active[tenant] = (cost if arrived else self._active[tenant][0], now)
        for tenant in [t for t, (_, seen) in self._active.items() if now - seen > self.fair_window_s]:
            del self._active[tenant]
        self._prefilling_before = {r for queue in queues.values() for r in queue}
        budget = float(self.max_num_batched_tokens)
        light = {t: cost for t, (cost, _) in self._active.items() if cost < budget}
        if light and costs:  # the others' work costs at most the least such demand, the light ones' comes on top
            own = sum(costs[t] for t in light if t in costs)
            budget = min(budget, max(min(light.values()), min(MIN_STEP_COST, budget)) + own)
        return budget, new if newcomers_only else set()

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

    def _prefill_tenant(self, queue: list[EngineRequest], allowance: int, cost_allowance: float,
                        step: _Step) -> int:
        """Give up to ``allowance`` tokens costing up to ``cost_allowance`` to one tenant's
        queue, oldest first; the tokens used."""
        used = 0
        cost_end = step.cost - cost_allowance  # the step's cost left once this tenant is done
        for req in queue:
            if used >= allowance or step.budget <= 0:
                break
            n = min(req.num_uncomputed_tokens, allowance - used, step.budget)
            if req.packed is not None and self.pyramid is not None:  # a progressive chunk over packed pages
                n = min(n, self.pyramid.chunk)
            n = _last_chunk_guard(req, n)
            if req in self.running:
                n = _last_chunk_guard(req, min(n, step.most_tokens(req.num_computed_tokens, step.cost - cost_end)))
                if n <= 0:
                    break
                if self._run(req, n, step, cost=step.cost - cost_end):
                    used += n
            elif req in self.waiting:
                admitted = self._admit(req, n, step, step.cost - cost_end)
                if admitted is None:
                    break  # stops admission for this tenant (FCFS within a tenant)
                used += admitted
        return used

    def _run(self, req: EngineRequest, n: int, step: _Step, drafts: list[int] | None = None,
             cost: float | None = None) -> bool:
        """Schedule ``n`` more tokens of a running request (a decode: with ``drafts``
        when their lookahead slots fit, see :meth:`_drafts`; a segmented request still
        assembling: costing at most ``cost``, see :meth:`_assemble`); False when it was
        preempted (or got nothing)."""
        if req.assembly is not None and req.assembly.active:
            return self._assemble(req, n, step, cost) > 0
        kv = self.kv_cache_manager
        if (drafts and kv.num_free_blocks - kv.num_new_blocks(req.request_id, n + len(drafts)) >= len(self.running)
                and kv.allocate_slots(req.kv, n, lookahead=len(drafts)) is not None):
            step.add(ScheduledSequence(req, req.num_computed_tokens, n, tuple(drafts)))
            return True
        if not self._allocate_or_preempt(req, n, step):
            return False
        step.add(ScheduledSequence(req, req.num_computed_tokens, n))
        return True

    def _drafts(self, req: EngineRequest, most: int) -> list[int]:
        """Up to ``most`` draft tokens for a decoding exact request (none for a compressed
        or segmented one, nor while its prompt log-probabilities are pending), never past
        its ``max_tokens`` or ``max_model_len``."""
        most = min(most, req.params.max_tokens - len(req.kv.output_token_ids) - 1,
                   req.max_model_len - req.kv.num_tokens - 1)
        if (most < 1 or req.packed is not None or req.compress or req.assembly is not None
                or req.prompt_logprobs is not None):  # the last prompt token's rows score the prompt
            return []
        if req.draft is None:
            req.draft = NgramDraft()
        return req.draft.propose(req.kv.all_token_ids, most)

    def settle(self, req: EngineRequest) -> None:
        """After a step that verified ``req``'s drafts: give back the slots past its
        computed tokens (the rejected drafts'). Nothing for a request that no longer runs."""
        if req in self.running and req.packed is None:
            self.kv_cache_manager.trim_slots(req.request_id, req.num_computed_tokens)

    def _admit(self, req: EngineRequest, most: int, step: _Step, cost: float) -> int | None:
        """Admit a waiting request with a first chunk of at most ``most`` tokens beyond its
        hit, costing at most ``cost``; the tokens scheduled, or None when it cannot be
        admitted in this step."""
        if len(self.running) >= self.max_num_seqs:
            return None
        need = self.reservation(req)
        if self.reserved_blocks + need > self.num_blocks:
            return None
        kvm = self.kv_cache_manager
        self._load_from_lower_tier(req)
        hits, num_cached = kvm.get_computed_blocks(req.kv, count=False)
        if req.prompt_logprobs is not None:  # reused K/V have no logits to score the prompt with
            hits, num_cached = [], 0
        while hits and req.kv.num_tokens - num_cached < req.capture_tail:  # its last tokens are computed
            hits, num_cached = hits[:-1], num_cached - self.block_size
        if self._next_block_in_progress(req, num_cached):
            return None
        if self._compresses(req):  # its exact part depends on its hit
            need = self.reservation(req, num_cached)
            if self.reserved_blocks + need > self.num_blocks:
                return None
        n = _last_chunk_guard(req, min(req.kv.num_tokens - num_cached, most, step.most_tokens(num_cached, cost)),
                              num_cached)
        packs = self._starts_packed(req, num_cached)
        if packs:  # a chunk over packed pages, as every later one
            assert self.pyramid is not None
            n = _last_chunk_guard(req, min(n, self.pyramid.chunk), num_cached)
        if n <= 0:
            return None
        assembled = self._assembles(req)
        if assembled:
            if not self.modules.admit(req, hits, num_cached):
                return None
        elif packs:
            if not self._start_packed(req, n):
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
        req.reserved = need
        if assembled:
            return self._assemble(req, most, step, cost)
        step.add(ScheduledSequence(req, num_cached, n))
        return n

    def _start_packed(self, req: EngineRequest, n: int) -> bool:
        """Make a waiting request packed before its first chunk of ``n`` tokens and give
        that chunk its pages (its reservation is the packed one); False, changing
        nothing, when the pool cannot give them."""
        assert self.new_packed is not None
        kvm = self.kv_cache_manager
        kvm.start_packed(req.request_id)
        req.packed = self.new_packed()
        prompt = req.num_prompt_tokens
        total = min(prompt + req.params.max_tokens, prompt + self.reserve_horizon, self.max_model_len)
        req.packed_reservation = self.packed_blocks(req.kv.num_tokens, total)
        req.packed_from_start = True
        if self._reserve(req, n):
            return True
        kvm.free(req.request_id)
        req.packed, req.packed_reservation, req.packed_from_start = None, None, False
        return False

    def _assembles(self, req: EngineRequest) -> bool:
        """A segmented request's KV is assembled from modules (with prefix caching on;
        off, it is computed exactly like any request)."""
        return req.segmented is not None and self.kv_cache_manager.enable_caching

    def _assemble(self, req: EngineRequest, most: int, step: _Step, cost: float | None = None) -> int:
        """Schedule up to ``most`` tokens of a segmented request's assembly
        (:mod:`engine.core.module_assembler`) costing at most ``cost`` (default: the
        step's cost left); the tokens scheduled. Each run is charged at its own
        context (:func:`chunk_cost`), so runs far into a long prompt take fewer tokens
        a step, as a prefill chunk there would; the first run gets at least one. A run is
        charged as a chunk of its own although a request's runs are attended as one
        slice (its K/V read once): every run token attends over the slice, and charged
        so the runs measured closer to a full-budget step (a ~4k-token ``cacheblend``
        request, bundled model, ``benchmarks/prompt_module_steps.py``: its longest step
        690-872 ms, against 1,119-1,168 ms charged a token each, its TTFT 1.75-1.92 s
        against 1.51-1.67 s in more steps; charged as one slice, 1,118 ms in one
        earlier ad-hoc run)."""
        allowance = min(most, step.budget)
        left = step.cost if cost is None else min(cost, step.cost)
        k, s = self.context_cost_tokens, self.sequence_cost_tokens

        def take(start: int, n: int, first: bool) -> int:
            nonlocal left
            m = min(n, tokens_within(start, left, k, s))
            if m <= 0 and first:
                m = min(n, 1)
            left -= chunk_cost(start, m, k, s)
            return m

        encodes, copies, runs, probe = self.modules.schedule(req, allowance, take)
        step.out.copies.extend(copies)
        used = 0
        if probe:
            used = self._probe_chunk(req, min(float(allowance), left), step)
        if copies or probe:
            step.requests.add(req)  # its blocks are written this step: never preempted in it
        for token_ids, start, block_ids in encodes:
            step.out.encodes.append(ModuleEncode(req, token_ids, start, block_ids))
            step.requests.add(req)
            used += len(token_ids)
        step.budget -= used
        for start, n in runs:
            step.add(ScheduledSequence(req, start, n))
            used += n
        return used

    def _probe_chunk(self, req: EngineRequest, cost: float, step: _Step) -> int:
        """Schedule the next chunk of ``req``'s probe (``cacheblend``) costing at most
        ``cost`` (at least one position); the tokens it is charged. A probed position runs
        ``PROBE_DEPTH`` layers and one layer's K/V of ``num_layers``, so it costs that
        share of a token at its context (:func:`chunk_cost`): a long prompt's probe is
        spread over steps like a long prefill, in position order (each chunk's layer 0
        attends to the exact layer-0 K/V the earlier chunks wrote)."""
        asm = req.assembly
        assert asm is not None
        share = self.num_layers / (assembly.PROBE_DEPTH + 1)
        most = tokens_within(asm.probed, cost * share, self.context_cost_tokens, self.sequence_cost_tokens)
        start, end = asm.next_probe(most)
        step.out.probes.append(ModuleProbe(req, start, end))
        charged = chunk_cost(start, end - start, self.context_cost_tokens, self.sequence_cost_tokens) / share
        step.cost -= charged
        return max(1, math.ceil(charged))

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
            if (other.num_uncomputed_tokens <= 1 and not assembling) or other.packed is not None:
                continue  # (a packed request's prefill caches nothing)
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
        while not self._reserve(req, n):
            victim = next(r for r in reversed(self.running) if r is req or r not in step.requests)
            self._preempt(victim)
            step.out.preempted.append(victim)
            if victim is req:
                return False
        return True

    def _reserve(self, req: EngineRequest, n: int) -> bool:
        """Room for ``n`` more tokens: slots of an exact request, pages in every layer of
        a packed one (whole blocks from the pool when its spare pages run out)."""
        packed = req.packed
        if packed is None:
            return self.kv_cache_manager.allocate_slots(req.kv, n) is not None
        new: int | list[int] = n
        if req.layerwise and n > 1 and self.pyramid is not None:  # each layer writes the rows it computes
            new = self.pyramid.chunk_rows(n, self.num_layers)
        need = packed.blocks_needed(new)
        if need:
            ids = self.kv_cache_manager.grow_packed(req.request_id, need)
            if ids is None:
                return False
            packed.add_blocks(ids)
        packed.fill(new)
        return True

    def compress(self, req: EngineRequest, packed: PackedKV, read: Callable[[list[int]], None],
                 write: Callable[[list[int]], None]) -> bool:
        """Make a running request compressed between steps: ``read(old_block_ids)``
        copies out its kept K/V, its exact blocks go back to the pool, ``packed`` (empty
        tables with its layers' counts) takes fresh blocks and ``write(new_ids)`` fills
        them (:meth:`KVCacheManager.repack`); its reservation becomes the packed one.
        False when the pool cannot give the packed blocks (blocks it shares stay held):
        it stays exact, with an exact reservation from now on. If ``write`` raises, the
        request is preempted (recomputed later) before the error goes on."""
        bs = self.block_size

        def fill(new: list[int]) -> None:
            packed.add_blocks(new)
            packed.fill()
            write(new)

        n = packed.blocks_for(packed.counts, bs)
        try:
            done = self.kv_cache_manager.repack(req.request_id, n, read, fill) is not None
        except BaseException:
            if req.request_id in self.kv_cache_manager.packed:
                self._preempt(req)
            raise
        req.stays_exact = not done
        old = req.reserved
        if done:
            req.packed = packed
            prompt = req.num_prompt_tokens
            total = min(prompt + req.params.max_tokens, prompt + self.reserve_horizon, self.max_model_len)
            req.packed_reservation = self.packed_blocks(req.kv.num_tokens, total)
        req.reserved = self.reservation(req)
        self.reserved_blocks += req.reserved - old
        return done

    def reselect(self, req: EngineRequest, keep: list[torch.Tensor]) -> int:
        """Between steps: a packed request keeps only the tokens ``keep`` says per layer
        (:meth:`PackedKV.reselect`), and the blocks its pages no longer need go back to
        the pool at once. Returns how many. If that fails half way, the request is
        preempted (recomputed later) before the error goes on."""
        assert req.packed is not None
        try:
            released = req.packed.reselect(keep)
        except BaseException:  # its pages may be half rewritten: recompute it
            self._preempt(req)
            raise
        if released:
            self.kv_cache_manager.release_packed(req.request_id, released)
        return len(released)

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
        self.reserved_blocks -= req.reserved
        req.packed, req.packed_reservation, req.stays_exact = None, None, False  # compressed again
        req.packed_from_start = False
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(req)

    # ---------------------------------------------------------- after a step
    def probed(self, req: EngineRequest, start: int, deviation: list[tuple[float, float]] | None) -> None:
        """A probe chunk of this step (from position ``start``) is done; once ``req``'s
        whole probe is, its recovery tokens are chosen from the deviations (None: none
        measured, chosen at once), its runs scheduled from the next step."""
        self.modules.probed(req, start, deviation)

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
                self.reserved_blocks -= req.reserved
                return req
        self.kv_cache_manager.free(request_id)
        for i, waiting in enumerate(self.waiting):
            if waiting.request_id == request_id:
                del self.waiting[i]
                return waiting
        return None
