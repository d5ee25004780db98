"""Prompt modules (issue 21) on a tiny random Llama: module blocks in the pool, reuse at
other offsets, isolation (salts, exact requests), eviction, preemption, exactness."""

from __future__ import annotations

import asyncio
import itertools

import pytest
import torch

from engine.core.engine_request import EngineRequest
from engine.core.llm_engine import GenerationRequest, SamplingParams
from engine.core.scheduler import chunk_cost
from engine.promptcache.segments import Recovery, Segment, SegmentedPrompt

_ids = itertools.count()


def doc(i: int, n: int = 40) -> tuple[int, ...]:
    return tuple(200 + ((j * 13 + i * 101) % 4000) for j in range(n))


HEAD = tuple(range(50, 62))  # the "system" segment: 12 tokens
QUESTION = (900, 901, 902, 903, 904)


def segmented(order, *, mode="none", head=HEAD, module_names=None, question=QUESTION) -> SegmentedPrompt:
    segs = [Segment(head)] if head else []
    segs += [Segment(doc(i), (module_names or {}).get(i, f"doc{i}")) for i in order]
    segs.append(Segment(question))
    return SegmentedPrompt(tuple(segs), Recovery(mode=mode, first_tokens=4, fraction=0.2))


def submit(engine, sp: SegmentedPrompt | None, prompt=None, *, salt=None, max_tokens=6, rid=None):
    prompt = list(sp.token_ids) if sp is not None else list(prompt)
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    return engine.submit(GenerationRequest(rid or f"m-{next(_ids)}", prompt, params, cache_salt=salt, segmented=sp))


def engine_request(engine, sp: SegmentedPrompt, max_tokens: int = 150) -> EngineRequest:
    gen = GenerationRequest(f"m-{next(_ids)}", list(sp.token_ids), SamplingParams(max_tokens=max_tokens), segmented=sp)
    return EngineRequest(gen, block_size=engine.kv_cache_manager.block_size, max_model_len=1000, tokenizer=None,
                         eos_token_ids=(), fallback_seed=0)


def run(engine, sp, prompt=None, **kw):
    outs = submit(engine, sp, prompt, **kw).result(timeout=120)
    assert outs[-1].error is None, outs[-1].error
    engine.call(engine.kv_cache_manager.check_integrity)
    return [t for o in outs for t in o.new_token_ids], outs[-1]


def test_segmented_tokens_must_equal_the_prompt():
    sp = segmented([0, 1])
    with pytest.raises(ValueError, match="segmented prompt"):
        GenerationRequest("x", [*sp.token_ids, 5], SamplingParams(), segmented=sp)


def test_modules_are_encoded_once_and_reused_in_another_order(tiny_engine):
    _, first = run(tiny_engine, segmented([0, 1, 2]))
    stats = tiny_engine.stats()
    assert stats.module_tokens_encoded == 3 * 40  # each module alone, at position 0
    assert stats.module_blocks == 3 * -(-40 // 16)
    assert first.num_cached_tokens == 0  # nothing reused yet: every module was encoded here
    _, again = run(tiny_engine, segmented([2, 0, 1]))
    stats2 = tiny_engine.stats()
    assert stats2.module_tokens_encoded == stats.module_tokens_encoded  # nothing encoded again
    assert again.num_cached_tokens == 3 * 40 == stats2.module_tokens_reused
    _, epic = run(tiny_engine, segmented([1, 2, 0], mode="epic"))
    assert epic.num_cached_tokens == 3 * (40 - 4)


def test_all_plain_segments_compute_exactly(make_tiny_engine):
    engine = make_tiny_engine()
    logits: dict[str, torch.Tensor] = {}
    engine.first_logits_observer = lambda rid, row: logits.__setitem__(rid, row.clone())
    plain = SegmentedPrompt((Segment(HEAD), Segment(doc(0)), Segment(QUESTION)))
    out_seg, _ = run(engine, plain, rid="seg")
    out_exact, exact = run(engine, None, plain.token_ids, rid="exact")
    assert out_seg == out_exact and torch.equal(logits["seg"], logits["exact"])
    # No module: every token is exact, so its full blocks are on the exact chain.
    assert exact.num_cached_tokens == (len(plain.token_ids) - 1) // 16 * 16


def test_module_at_its_encode_position_gives_exact_prefill(make_tiny_engine):
    # A module first in the prompt: its K/V are copied with delta 0, bit for bit.
    engine = make_tiny_engine()
    logits: dict[str, torch.Tensor] = {}
    engine.first_logits_observer = lambda rid, row: logits.__setitem__(rid, row.clone())
    sp = segmented([3], head=())
    run(engine, segmented([1, 3], question=(7, 8, 9)), rid="warm")  # encodes doc3 at position 0
    out_seg, seg = run(engine, sp, rid="seg")
    assert seg.num_cached_tokens == 40
    out_exact, _ = run(engine, None, sp.token_ids, rid="exact")
    assert out_seg == out_exact and torch.equal(logits["seg"], logits["exact"])


LONG_HEAD = tuple(range(60, 100))  # 40 tokens: two full blocks before the first module


@pytest.mark.parametrize("exact_first", [True, False])
def test_the_head_before_the_first_module_is_shared_with_exact_requests(make_tiny_engine, exact_first):
    sp = segmented([10, 11], head=LONG_HEAD)
    fresh = make_tiny_engine()
    out_fresh, _ = run(fresh, sp, rid="seg")  # nothing cached: the head is computed
    engine = make_tiny_engine()
    logits: dict[str, torch.Tensor] = {}
    engine.first_logits_observer = lambda rid, row: logits.__setitem__(rid, row.clone())
    if exact_first:
        out_exact, _ = run(engine, None, sp.token_ids, rid="exact")
        out_seg, seg = run(engine, sp, rid="seg")
        assert seg.num_cached_tokens == 32  # the head's two full blocks; the modules were encoded here
        assert out_seg == out_fresh
    else:
        out_seg, _ = run(engine, sp, rid="seg")
        out_exact, exact = run(engine, None, sp.token_ids, rid="exact")
        assert exact.num_cached_tokens == 32  # the head only: never an assembled block
        fresh_exact, _ = run(fresh, None, sp.token_ids, rid="exact-fresh")
        assert out_exact == fresh_exact
    _, other = run(engine, segmented([10, 11], head=(1, *LONG_HEAD[1:])), rid="other")
    assert other.num_cached_tokens == 80  # its modules, not the other head's blocks
    kv = engine.kv_cache_manager
    assert engine.call(lambda: kv.num_free_blocks == kv.num_blocks)
    engine.call(kv.check_integrity)


def test_an_exact_request_waits_for_a_head_a_segmented_one_has_not_written(make_tiny_engine):
    sp = segmented([12, 13], head=LONG_HEAD)
    fresh = make_tiny_engine()
    want_seg, _ = run(fresh, sp, rid="seg")
    want_exact, _ = run(make_tiny_engine(), None, sp.token_ids, rid="exact")
    engine = make_tiny_engine(max_num_batched_tokens=16)  # the modules' encodes take 5 steps
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    futures = [engine.submit(GenerationRequest(rid, list(sp.token_ids), params, segmented=seg, tenant=rid))
               for rid, seg in (("seg", sp), ("exact", None))]  # two tenants: both scheduled each step
    got = [[t for o in f.result(timeout=120) for t in o.new_token_ids] for f in futures]
    assert got == [want_seg, want_exact]
    kv = engine.kv_cache_manager
    assert engine.call(lambda: kv.num_free_blocks == kv.num_blocks)
    engine.call(kv.check_integrity)


def test_exact_requests_never_hit_assembled_blocks_and_equal_ones_share(tiny_engine):
    sp = segmented([4, 5])
    out1, _ = run(tiny_engine, sp)
    out2, again = run(tiny_engine, sp)
    assert out2 == out1
    n = len(sp.token_ids)
    assert again.num_cached_tokens == (n - 1) // 16 * 16  # the assembled chain, exactly
    _, exact = run(tiny_engine, None, sp.token_ids)
    assert exact.num_cached_tokens == 0
    _, other_mode = run(tiny_engine, segmented([4, 5], mode="epic"))
    assert other_mode.num_cached_tokens == 2 * (40 - 4)  # modules, not the other mode's blocks


def test_another_salt_never_hits_a_module(tiny_engine):
    run(tiny_engine, segmented([6, 7]), salt="tenant-a")
    before = tiny_engine.stats()
    _, other = run(tiny_engine, segmented([7, 6]), salt="tenant-b")
    after = tiny_engine.stats()
    assert other.num_cached_tokens == 0
    assert after.module_tokens_encoded - before.module_tokens_encoded == 2 * 40
    _, same = run(tiny_engine, segmented([7, 6]), salt="tenant-a")
    assert same.num_cached_tokens == 80


def test_same_name_other_tokens_is_another_module(tiny_engine):
    run(tiny_engine, segmented([8]))
    _, other = run(tiny_engine, segmented([9], module_names={9: "doc8"}))
    assert other.num_cached_tokens == 0


def test_module_blocks_are_evicted_under_pressure(make_tiny_engine):
    engine = make_tiny_engine(kv_cache_memory_gib=24 * 16 * 512 / 1024**3)
    assert engine.kv_cache_manager.num_blocks == 24
    for i in range(10):  # 10 modules of 3 blocks each cannot all stay
        run(engine, segmented([20 + i]))
    stats = engine.stats()
    assert stats.evictions > 0 and stats.module_blocks < 10 * 3
    _, last = run(engine, segmented([29], question=(7, 8, 9)))
    assert last.num_cached_tokens == 40  # the most recent module survived (LRU)


def test_preempted_segmented_request_reassembles_to_the_same_tokens(make_tiny_engine):
    # 26 blocks: both reservations fit (7 prompt and horizon blocks + 6 module blocks
    # each), their 16 blocks each of decoding do not.
    engine = make_tiny_engine(kv_cache_memory_gib=26 * 16 * 512 / 1024**3)
    engine.scheduler.reserve_horizon = 8
    sps = [segmented([30, 31]), segmented([31, 32])]
    assert [engine.scheduler.reservation(engine_request(engine, sp)) for sp in sps] == [13, 13]
    solo = [run(engine, sp, max_tokens=150)[0] for sp in sps]
    engine.call(engine.kv_cache_manager.reset_prefix_cache)

    async def together():
        streams = [submit(engine, sp, max_tokens=150, rid=f"pre-{i}") for i, sp in enumerate(sps)]
        return await asyncio.gather(*(s.collect() for s in streams))

    both = asyncio.run(together())
    assert engine.stats().num_preemptions >= 1
    assert [[t for o in outs for t in o.new_token_ids] for outs in both] == solo
    engine.call(engine.kv_cache_manager.check_integrity)


@pytest.mark.parametrize("mode", ["none", "cacheblend"])  # cacheblend: step 9 copies and probes
@pytest.mark.parametrize("abort_at_step", [1, 3, 6, 9, 10, 11])
def test_abort_while_assembling_leaves_nothing_findable(make_tiny_engine, abort_at_step, mode):
    engine = make_tiny_engine(max_num_batched_tokens=16)  # many steps per prompt
    sp = segmented([40, 41, 42], mode=mode)
    schedule = engine.scheduler.schedule
    steps = itertools.count(1)

    def schedule_then_abort():  # aborted in the loop thread after a chosen step: deterministic
        out = schedule()
        if next(steps) == abort_at_step:
            engine.abort("abort-me")
        return out

    engine.scheduler.schedule = schedule_then_abort
    outs = submit(engine, sp, rid="abort-me", max_tokens=50).result(timeout=60)
    assert outs[-1].finish_reason == "abort"
    engine.scheduler.schedule = schedule
    engine.call(engine.kv_cache_manager.check_integrity)
    fresh = make_tiny_engine()
    assert run(engine, sp)[0] == run(fresh, sp)[0]


def test_small_budget_chunks_encodes_and_runs_to_the_same_tokens(make_tiny_engine):
    big = make_tiny_engine()
    small = make_tiny_engine(max_num_batched_tokens=16)
    for mode in ("none", "epic", "cacheblend"):
        sp = segmented([50, 51, 52], mode=mode)
        assert run(big, sp)[0] == run(small, sp)[0], mode


def test_modules_encoded_after_an_anchor_are_another_module(make_tiny_engine, monkeypatch):
    from engine.core import assembly

    engine = make_tiny_engine()
    run(engine, segmented([60, 61]))
    monkeypatch.setattr(assembly, "ANCHOR_MAX_TOKENS", 64)
    before = engine.stats().module_tokens_encoded
    logits: dict[str, torch.Tensor] = {}
    engine.first_logits_observer = lambda rid, row: logits.__setitem__(rid, row.clone())
    _, first = run(engine, segmented([61, 60]))
    assert first.num_cached_tokens == 0  # other roots: encoded again, after HEAD
    assert engine.stats().module_tokens_encoded - before == 2 * (len(HEAD) + 40)
    sp = segmented([60], question=(7, 8))  # at its encode position (right after HEAD): exact
    out_seg, seg = run(engine, sp, rid="anchored")
    assert seg.num_cached_tokens == 40
    out_exact, _ = run(engine, None, sp.token_ids, rid="anchored-exact")
    assert out_seg == out_exact and torch.equal(logits["anchored"], logits["anchored-exact"])


def test_concurrent_segmented_and_exact_requests_under_block_pressure(make_tiny_engine):
    # A small pool, several requests at once: hits, module blocks and new blocks compete;
    # every output must equal the same request's output alone on a roomy engine.
    import random

    rng = random.Random(7)
    mixes = []
    for i in range(12):
        order = rng.sample(range(70, 76), 3)
        mode = rng.choice(["none", "epic", "cacheblend"])
        mixes.append((segmented(order, mode=mode, question=(7, 8, 9 + i % 3)), rng.random() < 0.25))
    roomy = make_tiny_engine()
    expected = [run(roomy, None if exact else sp, sp.token_ids)[0] for sp, exact in mixes]
    tight = make_tiny_engine(kv_cache_memory_gib=40 * 16 * 512 / 1024**3)

    async def wave(batch):
        streams = [submit(tight, None if exact else sp, sp.token_ids) for sp, exact in batch]
        return await asyncio.gather(*(s.collect() for s in streams))

    got = []
    for start in range(0, len(mixes), 4):
        got += asyncio.run(wave(mixes[start:start + 4]))
        tight.call(tight.kv_cache_manager.check_integrity)
    assert [[t for o in outs for t in o.new_token_ids] for outs in got] == expected
    assert tight.stats().evictions > 0


def test_a_failed_probe_fails_its_request_and_leaves_nothing_findable(make_tiny_engine, monkeypatch):
    engine = make_tiny_engine()
    sp = segmented([80, 81], mode="cacheblend")
    expected = run(make_tiny_engine(), sp)[0]

    def broken(*args, **kwargs):  # fault injection: the probe's forward fails
        raise RuntimeError("probe exploded")

    monkeypatch.setattr(engine.runner, "probe", broken)
    outs = submit(engine, sp).result(timeout=60)
    assert outs[-1].finish_reason == "error" and "probe exploded" in (outs[-1].error or "")
    engine.call(engine.kv_cache_manager.check_integrity)
    monkeypatch.undo()
    assert run(engine, sp)[0] == expected  # nothing half-written was kept on the assembled chain


def _probed_run(engine, rid: str) -> tuple[list[int], torch.Tensor, list[tuple[int, int]]]:
    """A cacheblend request after its modules were encoded: its tokens, first logits and
    probe chunks ``(start, n)``."""
    run(engine, segmented([90, 91, 92, 93]))  # the modules, encoded once
    chunks: list[tuple[int, int]] = []
    probe = engine.runner.probe

    def recording(token_ids, start, *args, **kwargs):
        chunks.append((start, len(token_ids)))
        return probe(token_ids, start, *args, **kwargs)

    engine.runner.probe = recording
    logits: dict[str, torch.Tensor] = {}
    engine.first_logits_observer = lambda r, row: logits.__setitem__(r, row.clone())
    tokens, _ = run(engine, segmented([93, 91, 90, 92], mode="cacheblend"), rid=rid)
    return tokens, logits[rid], chunks


def test_a_long_probe_is_spread_over_steps_within_the_budget(make_tiny_engine):
    """cacheblend's probe is chunked like a prefill (bounded work per step), in position
    order; the tokens and the first logits are those of one probe over the whole span."""
    one_tokens, one_logits, one = _probed_run(make_tiny_engine(max_num_batched_tokens=1024), "one")
    tokens, first_logits, chunks = _probed_run(make_tiny_engine(max_num_batched_tokens=16), "chunked")
    assert len(one) == 1 and len(chunks) > 5
    span_start, span_end = one[0][0], one[0][0] + one[0][1]
    assert chunks[0][0] == span_start and sum(n for _, n in chunks) == span_end - span_start
    assert all(a + n == b for (a, n), (b, _) in itertools.pairwise(chunks))
    assert max(n for _, n in chunks) <= 16  # 2 layers: a probed position costs a token
    assert tokens == one_tokens and torch.equal(first_logits, one_logits)


def test_runs_are_charged_at_their_context_like_a_prefill_chunk(make_tiny_engine):
    """A segmented request's runs far into its prompt take fewer tokens a step (each run
    costs ``chunk_cost`` at its own context), so no step of it costs more than the step's
    budget, beyond one token; the tokens are those of an engine that counts every run
    token as one."""
    plain = make_tiny_engine(max_num_batched_tokens=64)
    sp = segmented([94, 95, 96, 97], mode="cacheblend")
    run(plain, segmented([94, 95, 96, 97]))
    expected, _ = run(plain, sp)
    engine = make_tiny_engine(max_num_batched_tokens=64)
    run(engine, segmented([94, 95, 96, 97]))
    scheduler = engine.scheduler
    engine.call(lambda: setattr(scheduler, "context_cost_tokens", 16))  # every run past 16 tokens costs more
    costs: list[float] = []
    schedule = scheduler.schedule

    def recording():
        out = schedule()
        runs = [s for s in out.scheduled if s.request.request_id == "costed"]
        if runs:
            costs.append(sum(chunk_cost(s.start, s.num_new_tokens, 16, scheduler.sequence_cost_tokens) for s in runs))
        return out

    scheduler.schedule = recording
    tokens, _ = run(engine, sp, rid="costed")
    scheduler.schedule = schedule
    assert tokens == expected
    one_token = chunk_cost(len(sp.token_ids) - 1, 1, 16, scheduler.sequence_cost_tokens)  # the least progress
    assert len(costs) > 3 and max(costs) <= 64 + one_token
