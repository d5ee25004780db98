"""Packed mirrors (engine/model/packed_mirror.py): compressed decodes read their kept K/V
from contiguous slots instead of gathering their pages. The tokens must not change,
the slots must hold the pages' values after every step, and nothing may stay behind.
The engines are driven by hand here, with ``check_integrity()`` after every step."""

from __future__ import annotations

import itertools

import pytest
import torch
from test_engine_kv_compression import add_by_hand

from engine.core.llm_engine import GenerationRequest, SamplingParams

MODES = [{}, {"kv_progressive": True}, {"kv_layerwise": True}]
MODE_IDS = ["after-prefill", "progressive", "layerwise"]


def prompt_of(n, offset=0):
    return [100 + ((i * 7 + offset) % 3000) for i in range(n)]


def drive(engine, requests, *, gathered=False, on_step=None):
    """Queue ``requests`` in a stopped engine and step it here until all finish, checking
    the pool and the mirrors after every step; returns the tokens per request and how
    many decode steps read the mirrors. ``gathered``: the mirrors are never used."""
    runner = engine.runner
    used = 0
    if gathered:
        runner.packed_mirrors.use = lambda keys, packed: None
    reqs = add_by_hand(engine, requests)
    while engine.scheduler.has_work():
        engine.step()
        engine.kv_cache_manager.check_integrity()
        runner.packed_mirrors.check_integrity()
        used += len(runner.packed_mirrors) > 0
        if on_step is not None:
            on_step(reqs)
    return {r.request_id: list(r.kv.output_token_ids) for r in reqs}, used


def record_uses(mirrors):
    """Replace ``mirrors.use`` (on the instance) by one that records, per call, whether
    the decodes got slots; returns that list."""
    outcomes = []
    use = mirrors.use

    def recording(keys, packed):
        slots = use(keys, packed)
        outcomes.append(slots is not None)
        return slots

    mirrors.use = recording
    return outcomes


def requests(n, tokens=40, length=300):
    return [GenerationRequest(f"m{i}", prompt_of(length + 41 * i, offset=i),
                              SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True))
            for i in range(n)]


@pytest.mark.parametrize("mode", MODES, ids=MODE_IDS)
def test_mirrored_decodes_give_the_gathered_tokens(make_engine, mode):
    settings = {"kv_min_retention": 0.25, "kv_window": 8, "max_num_batched_tokens": 128, **mode}
    mirrored, used = drive(make_engine(started=False, **settings), requests(4))
    gathered, none = drive(make_engine(started=False, **settings), requests(4), gathered=True)
    assert used and not none
    assert mirrored == gathered


def test_slots_stay_dense_as_requests_come_and_go(make_engine):
    engine = make_engine(started=False, kv_min_retention=0.25, kv_window=8, max_num_batched_tokens=128)
    mirrors = engine.runner.packed_mirrors
    seen = []

    def watch(reqs):
        running = {r.request_id for r in engine.scheduler.running if r.packed is not None}
        names = [s.key for s in mirrors._slots]
        assert len(names) == len(set(names)) and set(names) <= {r.request_id for r in reqs}
        assert set(names) <= running  # finished ones left
        seen.append(len(names))

    grown = []
    grow = mirrors._grow

    def counting(rows, caps):
        grown.append((rows, list(caps)))
        return grow(rows, caps)

    mirrors._grow = counting
    short = [GenerationRequest(f"s{i}", prompt_of(200, offset=50 + i),
                               SamplingParams(max_tokens=8 + 9 * i, temperature=0.0, ignore_eos=True))
             for i in range(3)]
    drive(engine, [*requests(2, tokens=50), *short], on_step=watch)
    assert max(seen) >= 3
    # grown for more slots and for longer layers, contents kept (integrity after every step)
    pairs = list(itertools.pairwise(grown))
    assert any(b[0] > a[0] for a, b in pairs) and any(b[0] == a[0] and b[1] != a[1] for a, b in pairs)
    assert not len(mirrors) and not mirrors.nbytes  # freed with the last slot


def test_a_preempted_request_comes_back_to_a_fresh_slot(make_engine):
    engine = make_engine(started=False, kv_min_retention=0.25, kv_window=8)
    sched, mirrors = engine.scheduler, engine.runner.packed_mirrors
    first, other = requests(2, tokens=30)
    preempted = []

    def preempt(reqs):
        req = reqs[0]
        if not preempted and req.packed is not None and len(req.kv.output_token_ids) == 10 and len(mirrors) == 2:
            sched._preempt(req)  # what a running request finding no free block does to the newest
            engine.runner.forget(req.request_id)  # as LLMEngine.step does for work.preempted
            preempted.append(req.request_id)
            assert [s.key for s in mirrors._slots] == [other.request_id]

    tokens, _ = drive(engine, [first, other], on_step=preempt)
    assert preempted and [len(t) for t in tokens.values()] == [30, 30]
    assert engine.num_compressed == 3  # compressed again after its recompute


def test_the_mirrors_stay_within_the_shared_budget(make_engine):
    lay = make_engine(started=False).layout
    per_token = 2 * lay.num_layers * lay.kv_heads * lay.head_dim * torch.empty((), dtype=lay.dtype).element_size()
    budget = 400 * per_token  # one compressed request of ~300 tokens, not three
    engine = make_engine(started=False, kv_min_retention=0.25, kv_window=8, kv_mirror_memory_gib=budget / 2**30)
    runner, mirrors = engine.runner, engine.runner.packed_mirrors
    outcomes = record_uses(mirrors)

    def watch(_reqs):
        assert runner.mirrors.nbytes <= runner.mirrors.budget_bytes
        assert mirrors.nbytes <= runner.mirrors.budget_bytes

    tokens, _ = drive(engine, requests(3, length=250), on_step=watch)
    assert True in outcomes and False in outcomes  # one fitted, three did not
    plain, _ = drive(make_engine(started=False, kv_min_retention=0.25, kv_window=8, kv_mirror_memory_gib=0),
                     requests(3, length=250))
    assert plain == tokens


def test_a_stale_slot_is_filled_again_from_the_pages(make_engine):
    engine = make_engine(started=False, kv_min_retention=0.25, kv_window=8)
    mirrors = engine.runner.packed_mirrors
    refills = []
    fill = mirrors._fill

    def counting(i, p):
        refills.append(i)
        fill(i, p)

    mirrors._fill = counting
    drive(engine, requests(1, tokens=70))
    # once on the first decode, then after each re-selection (every ``window`` decodes)
    assert 2 <= len(refills) <= engine.num_reselections + 1


def test_mirror_slots_hold_the_pages_values(make_engine):
    engine = make_engine(started=False, kv_min_retention=0.25, kv_window=8)
    mirrors = engine.runner.packed_mirrors
    checked = []

    def corrupt_and_check(reqs):
        if len(mirrors) and not checked:
            mirrors.check_integrity()
            kept = mirrors.keys[3][0, 0, 0].clone()
            mirrors.keys[3][0, 0, 0] += 1.0
            with pytest.raises(AssertionError):
                mirrors.check_integrity()
            mirrors.keys[3][0, 0, 0] = kept
            checked.append(True)

    drive(engine, requests(2, tokens=12), on_step=corrupt_and_check)
    assert checked
