"""Scheduler units: the token budget, max_num_seqs, running before waiting, chunked
prefill, FCFS admission within a tenant, prefill shared between tenants, and
preemption of the newest running request (no model)."""

from __future__ import annotations

import itertools
import random

import pytest

from engine.core.engine_request import EngineRequest
from engine.core.output_stream import GenerationRequest
from engine.core.sampling_params import SamplingParams
from engine.core.scheduler import ANTICIPATE_S, MIN_STEP_COST, Scheduler, chunk_cost, tokens_within
from engine.kvcache.kv_cache_manager import KVCacheManager

BS = 4
_ids = itertools.count()


def request(n, max_tokens=8, offset=0, tenant=None, salt=None):
    gen = GenerationRequest(f"r{next(_ids)}", [10 + offset + i for i in range(n)], SamplingParams(max_tokens=max_tokens),
                            cache_salt=salt, tenant=tenant)
    return EngineRequest(gen, block_size=BS, max_model_len=1000, tokenizer=None, eos_token_ids=(), fallback_seed=0)


def make(num_blocks=100, **kw):
    return Scheduler(KVCacheManager(num_blocks, BS), 1000, **kw)


def finish_step(sched, out):
    """What the engine does after a forward: advance, append a token where one is sampled."""
    for s in out.scheduled:
        s.request.num_computed_tokens = s.end
        if s.samples:
            s.request.kv.append_output_token_ids(1)
    sched.kv_cache_manager.check_integrity()


def test_chunked_prefill_under_the_budget_then_decodes_first():
    sched = make(max_num_batched_tokens=10)
    a, b = request(25), request(6, offset=100)
    sched.add(a)
    sched.add(b)
    plan = []
    for _ in range(5):
        out = sched.schedule()
        plan.append([((s.request is a and "a") or "b", s.start, s.num_new_tokens) for s in out.scheduled])
        assert out.num_tokens <= 10
        finish_step(sched, out)
    assert plan == [
        [("a", 0, 10)],
        [("a", 10, 10)],
        [("a", 20, 5), ("b", 0, 5)],  # a's last chunk, then b's first
        [("a", 25, 1), ("b", 5, 1)],  # a decodes; b finishes its prompt
        [("a", 26, 1), ("b", 6, 1)],
    ]


def test_max_num_seqs_bounds_the_running_set():
    sched = make(max_num_seqs=2)
    reqs = [request(5, offset=10 * i) for i in range(3)]
    for r in reqs:
        sched.add(r)
    out = sched.schedule()
    assert [s.request for s in out.scheduled] == reqs[:2]
    finish_step(sched, out)
    sched.finish(reqs[0])
    out = sched.schedule()
    assert [s.request for s in out.scheduled] == [reqs[1], reqs[2]]


def test_out_of_blocks_preempts_the_newest_running_request():
    sched = make(num_blocks=6)
    sched.reserve_horizon = 1  # admit both; they outgrow their reservations
    a, b = request(11, max_tokens=50), request(11, max_tokens=50, offset=100)
    sched.add(a)
    sched.add(b)
    preempted = []
    for _ in range(6):
        out = sched.schedule()
        preempted += out.preempted
        finish_step(sched, out)
    assert preempted and preempted[0] is b
    assert b in sched.waiting and b.num_computed_tokens == 0 and b.num_preemptions == 1
    assert sched.kv_cache_manager.num_slots(b.request_id) == 0
    assert sched.num_preemptions == len(preempted)


def test_a_request_that_does_not_fit_stops_admission():
    sched = make(num_blocks=5)
    big, small = request(17, max_tokens=1), request(3, max_tokens=1, offset=50)
    running = request(9, max_tokens=1, offset=90)
    sched.add(running)
    finish_step(sched, sched.schedule())
    sched.add(big)
    sched.add(small)
    out = sched.schedule()
    assert [s.request for s in out.scheduled] == [running]  # big's 5 blocks do not fit; small waits behind it
    assert list(sched.waiting) == [big, small]


def plan_of(out, names):
    return [(names[s.request], s.start, s.num_new_tokens) for s in out.scheduled]


def test_a_short_request_of_another_tenant_runs_in_the_next_step_beside_a_long_prompt():
    sched = make(max_num_batched_tokens=10)
    long_a, long_b, short = request(60, tenant="A"), request(60, tenant="A", offset=100), request(3, tenant="Q")
    names = {long_a: "a", long_b: "b", short: "q"}
    sched.add(long_a)
    sched.add(long_b)
    finish_step(sched, sched.schedule())
    sched.add(short)
    out = sched.schedule()
    # q first (served least recently), alone: the step costs what q's costs alone
    assert plan_of(out, names) == [("q", 0, 3)]
    finish_step(sched, out)
    out = sched.schedule()
    assert plan_of(out, names) == [("q", 3, 1), ("a", 10, 9)]  # q decodes first; b still waits behind a


def test_newcomers_never_cap_two_steps_in_a_row():
    sched = make(max_num_batched_tokens=10)
    heavy = request(100, tenant="A")
    sched.add(heavy)
    finish_step(sched, sched.schedule())
    sizes = []
    for i in range(4):  # a new tenant every step
        sched.add(request(2, max_tokens=1, offset=200 + 10 * i, tenant=f"Q{i}"))
        out = sched.schedule()
        sizes.append(sum(s.num_new_tokens for s in out.scheduled if s.request is heavy))
        answered = [s.request for s in out.scheduled if s.request is not heavy and s.samples]
        finish_step(sched, out)
        for req in answered:  # max_tokens=1: done after its first token
            sched.finish(req)
    assert sizes == [0, 8, 0, 8]  # the newcomer's 2 tokens alone, then a full share


def test_tenants_with_long_prompts_share_each_step_equally():
    sched = make(max_num_batched_tokens=12)
    reqs = [request(40, tenant=t, offset=100 * i) for i, t in enumerate("ABC")]
    for r in reqs:
        sched.add(r)
    for _ in range(3):
        out = sched.schedule()
        assert sorted(s.num_new_tokens for s in out.scheduled) == [4, 4, 4]
        finish_step(sched, out)


def test_the_salt_is_the_tenant_when_no_tenant_is_named():
    sched = make(max_num_batched_tokens=10)
    a, b = request(40, salt="s1"), request(40, salt="s2", offset=100)
    sched.add(a)
    sched.add(b)
    assert sorted(s.num_new_tokens for s in sched.schedule().scheduled) == [5, 5]
    same = make(max_num_batched_tokens=10)
    c, d = request(40), request(40, offset=100)
    same.add(c)
    same.add(d)
    assert [s.request for s in same.schedule().scheduled] == [c]  # one tenant: FCFS


def test_a_request_that_does_not_fit_stops_admission_for_its_tenant_only():
    sched = make(num_blocks=5)
    running = request(9, max_tokens=1, offset=90, tenant="A")
    sched.add(running)
    finish_step(sched, sched.schedule())
    big, small_a = request(17, max_tokens=1, tenant="A"), request(3, max_tokens=1, offset=50, tenant="A")
    small_q = request(3, max_tokens=1, offset=70, tenant="Q")
    for r in (big, small_a, small_q):
        sched.add(r)
    out = sched.schedule()
    assert [s.request for s in out.scheduled] == [running, small_q]
    assert list(sched.waiting) == [big, small_a]


def test_a_shared_prefix_being_prefilled_by_another_tenant_is_not_computed_twice():
    sched = make(max_num_batched_tokens=8)
    producer = request(30, tenant="A")
    sharer = request(30, tenant="B")  # same tokens, no salt: the same block hashes
    sched.add(producer)
    finish_step(sched, sched.schedule())
    sched.add(sharer)
    computed_by_sharer = []
    for _ in range(12):
        out = sched.schedule()
        computed_by_sharer += [(s.start, s.end) for s in out.scheduled if s.request is sharer]
        finish_step(sched, out)
    # the sharer waited for the producer's blocks: it computed only its last token
    assert sharer.num_cached_tokens == 28
    assert computed_by_sharer[0] == (28, 30)


def test_preemption_never_takes_a_request_already_scheduled_in_the_step():
    sched = make(num_blocks=8, max_num_batched_tokens=64)
    sched.reserve_horizon = 1
    old = request(15, max_tokens=50, tenant="A")
    new = request(3, max_tokens=50, offset=100, tenant="B")
    sched.add(old)
    sched.add(new)
    finish_step(sched, sched.schedule())
    seen = []
    for _ in range(30):
        out = sched.schedule()
        scheduled = {s.request for s in out.scheduled}
        assert not scheduled & set(out.preempted)
        seen += out.preempted
        finish_step(sched, out)
    assert seen  # the pool ran out and someone was preempted


@pytest.mark.parametrize("seed", range(6))
def test_random_tenants_keep_every_invariant(seed):
    rng = random.Random(seed)
    sched = make(num_blocks=rng.choice([12, 30, 100]), max_num_seqs=rng.choice([2, 4, 64]),
                 max_num_batched_tokens=rng.choice([3, 8, 32]))
    sched.reserve_horizon = rng.choice([1, 4, 1024])
    done = 0
    for _ in range(200):
        if rng.random() < 0.3:
            sched.add(request(rng.randint(1, 40), max_tokens=rng.randint(1, 12), offset=rng.choice([0, 500]),
                              tenant=rng.choice(["A", "B", "C", None])))
        computed_before = {r: r.num_computed_tokens for r in sched.running}
        out = sched.schedule()
        assert out.num_tokens <= sched.max_num_batched_tokens
        assert len(out.scheduled) == len({s.request for s in out.scheduled})
        assert len(sched.running) <= sched.max_num_seqs
        assert sched.reserved_blocks <= sched.num_blocks
        tenants = {r.tenant for r in sched.all_requests()}
        assert set(sched._last_served) <= tenants  # bounded by the work
        assert sched._prefilling_before <= set(sched.all_requests())
        for s in out.scheduled:
            assert s.request in sched.running and s.start == s.request.num_computed_tokens
            assert s.start == computed_before.get(s.request, s.start)
            assert sched.kv_cache_manager.num_slots(s.request.request_id) == s.end
        finish_step(sched, out)
        for r in list(sched.running):
            if len(r.kv.output_token_ids) >= r.params.max_tokens:
                sched.finish(r)
                done += 1
    for r in sched.all_requests():
        sched.finish(r)
    sched.kv_cache_manager.check_integrity()
    assert sched.kv_cache_manager.num_free_blocks == sched.num_blocks
    assert done > 0


def test_a_tenant_that_cannot_be_admitted_is_a_newcomer_once():
    sched = make(max_num_batched_tokens=10, max_num_seqs=1)
    heavy = request(100, tenant="A")
    sched.add(heavy)
    finish_step(sched, sched.schedule())
    sched.add(request(2, tenant="Q"))  # cannot run: max_num_seqs is taken
    sizes = []
    for _ in range(4):
        out = sched.schedule()
        sizes.append(out.num_tokens)
        finish_step(sched, out)
    assert sizes == [1, 10, 10, 10]  # a newcomers' step once (A's one token: prefill always progresses)


def step_cost(out, k):
    return sum(chunk_cost(s.start, s.num_new_tokens, k) for s in out.scheduled)


def test_chunk_cost_and_tokens_within_agree():
    for k in (1, 8, 512, 2048):
        for s in (1, 160, 10**6):
            for start in (0, 5, 100, 2000, 8000):
                for cost in (0.5, 1, 7, 32, 512):
                    n = tokens_within(start, cost, k, s)
                    assert chunk_cost(start, n, k, s) <= cost < chunk_cost(start, n + 1, k, s)
    assert chunk_cost(0, 16, 16, 8) == 16  # short context: one per token
    assert chunk_cost(16, 16, 16, 8) == 32 + 2  # past k: context / k per token, (end - k) / s per sequence
    assert chunk_cost(100, 0, 16) == 0


def test_a_lone_long_prompt_gets_chunks_of_bounded_cost():
    sched = make(max_num_batched_tokens=16, context_cost_tokens=16)
    req = request(100, max_tokens=1)
    sched.add(req)
    chunks = []
    while req.num_uncomputed_tokens > 0 and not req.kv.output_token_ids:
        out = sched.schedule()
        chunks.append(out.scheduled[0].num_new_tokens)
        assert step_cost(out, 16) <= 16
        finish_step(sched, out)
    assert chunks[:3] == [16, 9, 7]  # 16 at short context, then fewer as the context grows
    assert sum(chunks) == 100 and min(chunks[:-1]) >= 2


def test_the_first_prefill_chunk_gets_a_token_whatever_it_costs():
    sched = make(max_num_batched_tokens=4, context_cost_tokens=1)
    req = request(30, max_tokens=1)
    sched.add(req)
    sizes = []
    for _ in range(6):
        out = sched.schedule()
        sizes.append(out.num_tokens)
        finish_step(sched, out)
    assert sizes == [1] * 6  # past the first, one token costs more than 4: one per step, never 0


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def test_a_quiet_tenant_waits_for_forwards_about_as_costly_as_its_own():
    """While tenant Q keeps sending short requests beside tenant A's long prompt (its
    context costing far more per token), every forward costs at most about what Q's
    request costs (at least MIN_STEP_COST), Q's own forward costs no more than Q's
    request, and A gets the forwards in between; once Q has been away for the window,
    A's forwards take the whole budget again."""
    k, budget = 8, 128
    clock = Clock()
    sched = make(num_blocks=400, max_num_batched_tokens=budget, context_cost_tokens=k, clock=clock)
    heavy = request(1000, max_tokens=1, tenant="A")
    sched.add(heavy)
    for _ in range(3):
        out = sched.schedule()
        assert step_cost(out, k) <= budget
        finish_step(sched, out)
    quiet_cost = chunk_cost(0, 12, k)  # 18: a 12-token prompt, past k
    heavy_between = []
    for i in range(4):
        quiet = request(12, max_tokens=1, offset=3000 + 100 * i, tenant="Q")
        sched.add(quiet)
        out = sched.schedule()  # Q's arrival: Q alone, its whole prompt
        assert [(s.request, s.num_new_tokens) for s in out.scheduled] == [(quiet, 12)]
        assert step_cost(out, k) == quiet_cost
        finish_step(sched, out)
        sched.finish(quiet)
        for _ in range(1 + i % 2):  # until Q's next request: A alone, in forwards of Q's size
            out = sched.schedule()
            assert [s.request for s in out.scheduled] == [heavy]
            assert step_cost(out, k) <= max(quiet_cost, MIN_STEP_COST)
            heavy_between.append(out.num_tokens)
            finish_step(sched, out)
            clock.now += 1
    assert all(n >= 1 for n in heavy_between)  # A always progresses
    clock.now += sched.fair_window_s + 1  # Q gone for the window: A alone again
    out = sched.schedule()
    assert step_cost(out, k) > budget - heavy.num_computed_tokens / k - 1 > MIN_STEP_COST
    assert set(sched._active) == {"A"}  # Q forgotten after the window


def test_tenants_with_long_prompts_are_not_slowed_by_each_other():
    k, budget = 8, 64
    sched = make(num_blocks=400, max_num_batched_tokens=budget, context_cost_tokens=k)
    a, b = request(600, max_tokens=1, tenant="A"), request(600, max_tokens=1, offset=1000, tenant="B")
    sched.add(a)
    sched.add(b)
    for _ in range(8):  # both arrived with long prompts: the full cost budget, shared
        out = sched.schedule()
        assert budget - 2 * (a.num_computed_tokens + 64) / k <= step_cost(out, k) <= budget
        assert {s.request for s in out.scheduled} == {a, b}
        finish_step(sched, out)


def test_a_quiet_request_arriving_right_after_its_previous_one_shares_a_step_of_bounded_cost():
    """Q sends its next request as soon as the previous one is answered, so it is there
    for the step after its newcomers' step, which is not a newcomers' step (never two in
    a row): Q's whole request is in it, and A's part costs no more than in the steps
    between Q's requests (not the rest of the full budget)."""
    k, budget = 64, 128
    sched = make(num_blocks=400, max_num_batched_tokens=budget, context_cost_tokens=k, clock=Clock())
    heavy = request(1000, max_tokens=1, tenant="A")
    sched.add(heavy)
    for _ in range(3):
        finish_step(sched, sched.schedule())
    quiet_cost = chunk_cost(0, 12, k)
    first = request(12, max_tokens=1, offset=3000, tenant="Q")
    sched.add(first)
    out = sched.schedule()
    assert [s.request for s in out.scheduled] == [first]  # Q's arrival: Q alone
    finish_step(sched, out)
    sched.finish(first)
    second = request(12, max_tokens=1, offset=3100, tenant="Q")
    sched.add(second)  # back at once
    out = sched.schedule()
    assert [(s.request, s.num_new_tokens) for s in out.scheduled if s.request.tenant == "Q"] == [(second, 12)]
    heavy_part = [s for s in out.scheduled if s.request is heavy]
    assert heavy_part and sum(chunk_cost(s.start, s.num_new_tokens, k) for s in heavy_part) <= max(
        quiet_cost, MIN_STEP_COST)


def test_the_engine_holds_a_forward_for_a_light_tenant_that_comes_back_at_once():
    """Q sends its requests back to back (a pause of 5 ms) beside A's long prompt: once a
    pause at most ANTICIPATE_S is seen, the step after Q's request ends holds (no work,
    :meth:`hold_s` says how long) until Q's next request, which then runs at once (with
    a share of A's of bounded cost when the step before was Q's newcomers' step); a hold
    never outlasts ANTICIPATE_S (A goes on), and a tenant whose pauses are longer is
    never waited for."""
    clock = Clock()
    sched = make(num_blocks=400, max_num_batched_tokens=64, context_cost_tokens=16, clock=clock)
    heavy = request(1000, max_tokens=1, tenant="A")
    sched.add(heavy)
    finish_step(sched, sched.schedule())

    def quiet_round(pause, tenant="Q"):
        """One of ``tenant``'s requests arriving ``pause`` seconds after the last step; its step."""
        clock.now += pause
        quiet = request(6, max_tokens=1, offset=3000 + next(_ids) * 10, tenant=tenant)
        quiet.arrival_time = clock.now
        sched.add(quiet)
        out = sched.schedule()
        assert (quiet, 6) in [(s.request, s.num_new_tokens) for s in out.scheduled]  # Q's whole request
        others = [s for s in out.scheduled if s.request is not quiet]
        assert all(s.request is heavy for s in others)
        assert sum(chunk_cost(s.start, s.num_new_tokens, 16) for s in others) <= max(chunk_cost(0, 6, 16), MIN_STEP_COST)
        finish_step(sched, out)
        sched.finish(quiet)
        return bool(others)

    quiet_round(0.0)
    held, shared = [], []
    for _ in range(5):
        out = sched.schedule()  # Q's request ended: hold while Q is expected
        held.append(not out.scheduled)
        if out.scheduled:
            finish_step(sched, out)
        shared.append(quiet_round(0.005))
    assert held == [False, True, True, True, True]  # no pause seen before the first: no hold then
    # held, Q's requests alternate between newcomers' steps (Q alone) and steps that A shares
    # (never two newcomers' steps in a row): A still progresses
    assert shared == [False, True, False, True, False]
    assert sched.hold_s() == 0  # Q's request came: the hold is over
    out = sched.schedule()
    assert not out.scheduled and 0 < sched.hold_s() <= ANTICIPATE_S + 1e-9
    clock.now += ANTICIPATE_S  # Q does not come back in time: A goes on
    out = sched.schedule()
    assert [s.request for s in out.scheduled] == [heavy] and sched.hold_s() == 0
    finish_step(sched, out)
    clock.now += 0.01
    assert sched.schedule().scheduled  # one hold per request of Q, never two
    for _ in range(2):  # R pauses 0.2 s between its requests: never waited for
        quiet_round(0.2, tenant="R")
        out = sched.schedule()
        assert [s.request for s in out.scheduled] == [heavy]
        finish_step(sched, out)
    quiet_round(0.2)  # one long pause of Q's: one of its last ANTICIPATE_PAUSES was short
    assert not sched.schedule().scheduled and sched.hold_s() > 0
    newcomer = request(6, max_tokens=1, offset=9000, tenant="N")
    newcomer.arrival_time = clock.now
    sched.add(newcomer)  # another tenant's short request while held for Q: never held back
    out = sched.schedule()
    assert newcomer in [s.request for s in out.scheduled] and sched.hold_s() == 0
    finish_step(sched, out)
    sched.finish(newcomer)
    clock.now += 0.005
    talk = request(6, max_tokens=3, offset=9100, tenant="Q")  # an answer of 3 tokens
    talk.arrival_time = clock.now
    sched.add(talk)
    out = sched.schedule()
    assert talk in [s.request for s in out.scheduled]
    finish_step(sched, out)
    out = sched.schedule()  # Q's prefill ended, its request decodes: no hold
    assert talk in [s.request for s in out.scheduled] and sched.hold_s() == 0


def test_a_long_prompt_keeps_every_other_step_when_one_of_its_tokens_costs_more_than_its_share():
    """At a long context one token of A's costs more than A's share of a step beside a
    light tenant's request, so A progresses only through the guaranteed first chunk of a
    step: in the step after Q's newcomers' step, A's chunk comes first (Q's request ran
    alone in the step before), whatever order the tenants were last served in. Q sends
    back to back (holds between its requests): A still gets a token every other step."""
    clock = Clock()
    k = 16
    sched = make(num_blocks=400, max_num_batched_tokens=64, context_cost_tokens=k, clock=clock)
    heavy = request(1000, max_tokens=1, tenant="A")
    sched.add(heavy)
    while heavy.num_computed_tokens < 900:
        finish_step(sched, sched.schedule())
    start = heavy.num_computed_tokens
    assert chunk_cost(start, 1, k) > MIN_STEP_COST + chunk_cost(0, 6, k)  # a token exceeds any share of A's
    shared = []
    for _ in range(6):
        clock.now += 0.005
        quiet = request(6, max_tokens=1, offset=3000 + next(_ids) * 10, tenant="Q")
        quiet.arrival_time = clock.now
        sched.add(quiet)
        out = sched.schedule()
        assert (quiet, 6) in [(s.request, s.num_new_tokens) for s in out.scheduled]
        shared.append([s.num_new_tokens for s in out.scheduled if s.request is heavy])
        finish_step(sched, out)
        sched.finish(quiet)
        out = sched.schedule()  # held for Q's next request (nothing planned), else A's step
        if out.scheduled:
            finish_step(sched, out)
    assert sum(1 for part in shared if part) >= 2 and all(part in ([], [1]) for part in shared)
    assert heavy.num_computed_tokens > start


def test_drafts_take_lookahead_slots_only_while_blocks_stay_free_and_settle_gives_them_back():
    """Speculative decoding: a decode of a repeating request gets draft tokens, whose
    slots come from free blocks only (never by preempting), and settle() trims the
    rejected ones'."""
    sched = make(num_blocks=5, speculative_tokens=4, max_num_batched_tokens=64)
    loop = request(9, max_tokens=20)
    loop.kv._all_token_ids[:] = [1, 2, 3, 1, 2, 3, 1, 2, 3]
    sched.add(loop)
    finish_step(sched, sched.schedule())  # the prompt, then a sampled 1
    (s,) = sched.schedule().scheduled
    assert s.num_new_tokens == 1 and s.drafts == (2, 3, 1, 2)  # what followed [2, 3, 1] last
    kv = sched.kv_cache_manager
    assert kv.num_slots(loop.request_id) == s.end + 4 == 14
    s.request.num_computed_tokens = s.end + 1  # the first draft (2) was sampled, then 7, not 3
    s.request.kv.append_output_token_ids([2, 7])
    sched.settle(loop)
    kv.check_integrity()
    assert kv.num_slots(loop.request_id) == loop.num_computed_tokens == 11
    # a pool with no block to spare beyond one per running request: no drafts
    tight = make(num_blocks=4, speculative_tokens=4, max_num_batched_tokens=64)
    other = request(12, max_tokens=20)
    other.kv._all_token_ids[:] = [1, 2, 3] * 4
    tight.add(other)
    finish_step(tight, tight.schedule())
    (s,) = tight.schedule().scheduled
    assert s.drafts == () and tight.num_preemptions == 0
