"""Continuous batching on a tiny random Llama: batched outputs equal one-at-a-time outputs.

Every step's forward is observed through a spy around ``ModelRunner.execute`` (the
real forward still runs), so the tests can show that batches really mixed prefill
chunks and decode tokens, and that the token budget held.
"""

from __future__ import annotations

import asyncio
import itertools

import pytest
import torch

from engine.core.llm_engine import GenerationRequest, SamplingParams
from engine.core.scheduler import ANTICIPATE_S, Scheduler
from engine.model.runner import ModelRunner

_ids = itertools.count()


def prompt_of(n, offset=0):
    return [100 + ((i * 7 + offset) % 5000) for i in range(n)]


def tokens_of(outputs):
    return [t for o in outputs for t in o.new_token_ids]


def params(max_tokens=20, **kw):
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, **kw)


def solo(engine, prompt, max_tokens=20):
    stream = engine.submit(GenerationRequest(f"solo-{next(_ids)}", list(prompt), params(max_tokens)))
    return tokens_of(stream.result(timeout=120))


def together(engine, prompts, max_tokens=20, cancel_after=None, tenants=None):
    """Submit all prompts in one go; ``cancel_after = (i, n)`` cancels request i after n outputs;
    ``tenants[i]`` names request i's tenant."""

    async def go():
        streams = [
            engine.submit(GenerationRequest(f"b-{next(_ids)}", list(p), params(max_tokens),
                                            tenant=None if tenants is None else tenants[i]))
            for i, p in enumerate(prompts)
        ]

        async def collect(i, stream):
            outputs = []
            async for out in stream:
                outputs.append(out)
                if cancel_after is not None and cancel_after[0] == i and len(outputs) == cancel_after[1]:
                    stream.cancel()
            return outputs

        return await asyncio.gather(*(collect(i, s) for i, s in enumerate(streams)))

    return asyncio.run(go())


@pytest.fixture
def spy_steps(monkeypatch):
    """Records the sequences of every forward of every engine (token counts, starts)."""
    steps = []
    real = ModelRunner.execute

    def spy(self, sequences):
        steps.append([(len(s.token_ids), s.start, s.sample) for s in sequences])
        return real(self, sequences)

    monkeypatch.setattr(ModelRunner, "execute", spy)
    return steps


def assert_all_free(engine):
    kv = engine.kv_cache_manager
    kv.check_integrity()
    assert kv.num_free_blocks == kv.num_blocks


PROMPTS = [prompt_of(n, offset=n) for n in (5, 40, 17, 90, 33, 64)]


def test_batched_greedy_equals_one_at_a_time_cached_and_uncached(make_tiny_engine, spy_steps):
    reference = make_tiny_engine(enable_prefix_caching=False, max_num_seqs=1)
    expected = [solo(reference, p) for p in PROMPTS]
    assert all(len(step) == 1 for step in spy_steps)  # one sequence per forward
    spy_steps.clear()
    uncached = make_tiny_engine(enable_prefix_caching=False, max_num_batched_tokens=48)
    assert [tokens_of(o) for o in together(uncached, PROMPTS)] == expected
    mixed = [step for step in spy_steps if any(n == 1 for n, _, _ in step) and any(n > 1 for n, _, _ in step)]
    assert mixed, "no step mixed decode tokens with prefill chunks"
    assert max(len(step) for step in spy_steps) >= 4
    assert all(sum(n for n, _, _ in step) <= 48 for step in spy_steps)
    cached = make_tiny_engine(max_num_batched_tokens=48)
    together(cached, PROMPTS)  # fills the prefix cache
    second = together(cached, PROMPTS)
    assert [tokens_of(o) for o in second] == expected
    assert [o[-1].num_cached_tokens for o in second] == [(len(p) - 1) // 16 * 16 for p in PROMPTS]
    for engine in (uncached, cached):
        assert_all_free(engine)


def test_a_request_cancelled_mid_batch_leaves_the_others_unchanged(make_tiny_engine):
    engine = make_tiny_engine(max_num_batched_tokens=64)
    prompts = PROMPTS[:4]
    expected = [solo(engine, p, max_tokens=30) for p in prompts]
    outputs = together(engine, prompts, max_tokens=30, cancel_after=(1, 3))
    assert outputs[1][-1].finish_reason == "abort" and len(tokens_of(outputs[1])) < 30
    for i in (0, 2, 3):
        assert tokens_of(outputs[i]) == expected[i]
        assert outputs[i][-1].finish_reason == "length"
    engine.shutdown()
    assert_all_free(engine)


def test_preemption_mid_batch_recomputes_to_the_same_tokens(make_tiny_engine, spy_steps):
    # 14 blocks of 16 tokens; three requests growing to 5-6 blocks each cannot all fit.
    engine = make_tiny_engine(kv_cache_memory_gib=14 * 16 * 512 / 1024**3, max_num_batched_tokens=32)
    engine.scheduler.reserve_horizon = 4  # admit all three, then run out while decoding
    prompts = [prompt_of(40, offset=51 + i) for i in range(3)]
    expected = [solo(engine, p, max_tokens=50) for p in prompts]
    spy_steps.clear()
    outputs = together(engine, prompts, max_tokens=50)
    assert engine.stats().num_preemptions >= 1
    assert [tokens_of(o) for o in outputs] == expected
    assert max(len(step) for step in spy_steps) >= 2
    engine.shutdown()
    assert_all_free(engine)


def test_a_failed_batched_forward_fails_its_requests_and_caches_nothing(make_tiny_engine, monkeypatch):
    engine = make_tiny_engine()
    prompts = [prompt_of(64, offset=71), prompt_of(64, offset=71)[:48] + [9] * 20]
    real = engine.runner.execute

    def broken(sequences):
        raise RuntimeError("injected batch failure")

    monkeypatch.setattr(engine.runner, "execute", broken)
    outputs = together(engine, prompts)
    assert all(o[-1].finish_reason == "error" and "injected" in o[-1].error for o in outputs)
    monkeypatch.setattr(engine.runner, "execute", real)
    assert_all_free(engine)
    again = together(engine, prompts)
    assert [o[-1].num_cached_tokens for o in again] == [0, 48]  # the second shares the first's blocks


@pytest.mark.parametrize("tenants", [None, ("A", "B")])
@pytest.mark.parametrize("budget", [32, 512])
def test_a_prefix_being_prefilled_is_computed_once(make_tiny_engine, spy_steps, budget, tenants):
    """Policy (engine/core/scheduler.py): a request arriving while another prefills the
    same prefix waits for the producer's last chunk and hits every full block of it,
    whether or not both are the same tenant's; with a large budget both run in the
    same forward, the second reading blocks the first is writing."""
    engine = make_tiny_engine(max_num_batched_tokens=budget)
    shared = prompt_of(200, offset=81)
    prompts = [[*shared, 7, 8, 9], [*shared, 11, 12]]
    expected = [solo(make_tiny_engine(enable_prefix_caching=False), p) for p in prompts]
    spy_steps.clear()
    outputs = together(engine, prompts, tenants=tenants)
    assert [tokens_of(o) for o in outputs] == expected
    assert outputs[0][-1].num_cached_tokens == 0
    assert outputs[1][-1].num_cached_tokens == 192  # every full block of the shared prefix
    prefill = [(n, start) for step in spy_steps for n, start, _ in step if start < 200]
    assert sum(n for n, _ in prefill) == 203 + (202 - 192)  # the prefix was computed once
    assert (202 - 192, 192) in prefill
    if budget == 512:
        assert len(spy_steps[0]) == 2  # both prefills in the first forward
    assert_all_free(engine)


def test_tenants_share_prefill_and_batched_greedy_still_equals_one_at_a_time(make_tiny_engine, spy_steps):
    reference = make_tiny_engine(enable_prefix_caching=False, max_num_seqs=1)
    prompts = [prompt_of(150, offset=3), prompt_of(140, offset=5), prompt_of(9, offset=7)]
    expected = [solo(reference, p) for p in prompts]
    spy_steps.clear()
    engine = make_tiny_engine(max_num_batched_tokens=32)
    outputs = together(engine, prompts, tenants=["heavy", "heavy", "quiet"])
    assert [tokens_of(o) for o in outputs] == expected
    # the quiet tenant's whole prompt is in the first forward, beside the heavy tenant's first chunk
    assert sorted(spy_steps[0]) == [(9, 0, True), (23, 0, False)]
    assert all(sum(n for n, _, _ in step) <= 32 for step in spy_steps)
    assert_all_free(engine)


def test_a_quiet_tenant_sending_back_to_back_is_anticipated_and_answers_stay_exact(make_tiny_engine, monkeypatch):
    """A quiet tenant's requests one after another beside a heavy tenant's long prompt:
    the engine loop holds for the quiet tenant's next request (``Scheduler.hold_s``) and
    every answer equals the one it gets alone."""
    reference = make_tiny_engine(enable_prefix_caching=False, max_num_seqs=1)
    heavy_prompt = prompt_of(600, offset=11)
    quiet = [prompt_of(6, offset=100 + 10 * i) for i in range(6)]
    expected_heavy = solo(reference, heavy_prompt, 2)
    expected_quiet = [solo(reference, p, 1) for p in quiet]
    holds = []
    real_hold_s = Scheduler.hold_s

    def spy(self):
        hold = real_hold_s(self)
        if hold > 0:
            holds.append(hold)
        return hold

    monkeypatch.setattr(Scheduler, "hold_s", spy)
    engine = make_tiny_engine(max_num_batched_tokens=8)
    heavy = engine.submit(GenerationRequest(f"h-{next(_ids)}", heavy_prompt, params(2), tenant="heavy"))
    answers = [tokens_of(engine.submit(GenerationRequest(f"q-{next(_ids)}", p, params(1), tenant="quiet"))
                         .result(timeout=120)) for p in quiet]
    assert answers == expected_quiet
    assert tokens_of(heavy.result(timeout=120)) == expected_heavy
    assert holds and max(holds) <= ANTICIPATE_S
    assert_all_free(engine)


def test_requests_sharing_blocks_while_running_hold_them_by_ref_count(make_tiny_engine):
    engine = make_tiny_engine()
    shared = prompt_of(100, offset=91)
    solo(engine, [*shared, 1])  # cache the prefix
    seen = {}

    def observer(rid, logits):
        kv = engine.kv_cache_manager
        seen[rid] = [kv.block_pool.blocks[b].ref_cnt for b in kv.get_block_ids(rid)[:6]]

    engine.first_logits_observer = observer
    together(engine, [[*shared, 2, 3], [*shared, 4, 5]], max_tokens=3)
    engine.first_logits_observer = None
    # Both requests are admitted in the same step and sample together: 6 shared blocks, 2 holders.
    assert list(seen.values()) == [[2] * 6, [2] * 6]
    assert_all_free(engine)


def test_lean_and_generic_llama_forwards_agree(tiny_model, make_tiny_engine):
    engine = make_tiny_engine(enable_prefix_caching=False)
    generic = ModelRunner(tiny_model, engine.storage, lean=False)
    from engine.model.runner import SequenceInput

    try:
        ids = prompt_of(37, offset=3)
        block_ids = list(range(3))
        inputs = [SequenceInput(ids, 0, block_ids, True)]
        lean = engine.runner.execute(inputs)
        general = generic.execute(inputs)
        with torch.inference_mode():
            own = tiny_model.config._attn_implementation
            tiny_model.config._attn_implementation = "sdpa"
            stock = tiny_model(torch.tensor([ids])).logits[0, -1].float()
            tiny_model.config._attn_implementation = own
        assert torch.max(torch.abs(lean[0] - general[0])).item() <= 1e-5
        assert torch.max(torch.abs(lean[0] - stock)).item() <= 1e-4
    finally:
        tiny_model.config._attn_implementation = "sdpa"


def test_decode_rows_apart_or_together_get_the_same_bits(make_tiny_engine):
    """Decodes whose rows are consecutive are read and written through slices; decodes
    split by a prefill chunk are gathered and scattered. Both give each sequence the
    bits it gets alone."""
    from engine.model.attention import DecodeGroup
    from engine.model.runner import SequenceInput

    engine = make_tiny_engine(enable_prefix_caching=False)
    runner, bs = engine.runner, engine.config.block_size
    prompts = [prompt_of(2 * bs, offset=k) for k in range(3)]
    tables = [list(range(k * 4, k * 4 + 4)) for k in range(3)]
    for ids, table in zip(prompts, tables, strict=True):  # fill each table's prefix K/V
        runner.execute([SequenceInput(ids, 0, table, False)])
    decode = [SequenceInput([7 + k], 2 * bs, tables[k], True) for k in (0, 2)]
    prefill = SequenceInput(prompt_of(5, offset=9), 0, list(range(12, 14)), True)
    alone = [runner.execute([d])[0] for d in decode]
    built = []
    real_build = DecodeGroup.build.__func__

    def spy(cls, *args):
        group = real_build(cls, *args)
        built.append(group.first_row)
        return group

    DecodeGroup.build = classmethod(spy)
    try:
        together = runner.execute(decode)
        apart = runner.execute([decode[0], prefill, decode[1]])
        after = runner.execute([prefill, *decode])
    finally:
        DecodeGroup.build = classmethod(real_build)
    assert built == [0, None, 5]  # rows 0-1; rows 0 and 6; rows 5-6
    for k in range(2):
        assert torch.equal(together[k], alone[k])
        assert torch.equal(after[1 + k], alone[k])
    assert torch.equal(apart[0], alone[0]) and torch.equal(apart[2], alone[1])
