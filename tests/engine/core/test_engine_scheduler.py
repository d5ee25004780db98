"""Scheduler units: the token budget, max_num_seqs, running before waiting, chunked
prefill, FCFS admission and preemption of the newest running request (no model)."""

from __future__ import annotations

import itertools

from engine.core.engine_request import EngineRequest
from engine.core.output_stream import GenerationRequest
from engine.core.sampling_params import SamplingParams
from engine.core.scheduler import Scheduler
from engine.kvcache.kv_cache_manager import KVCacheManager

BS = 4
_ids = itertools.count()


def request(n, max_tokens=8, offset=0):
    gen = GenerationRequest(f"r{next(_ids)}", [10 + offset + i for i in range(n)], SamplingParams(max_tokens=max_tokens))
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
