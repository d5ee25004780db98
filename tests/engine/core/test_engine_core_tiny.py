"""LLMEngine on a tiny random Llama: prefix reuse, the block rule, salts, abort, failures."""

from __future__ import annotations

import asyncio
import itertools
import time

import pytest
import torch

from engine.core.llm_engine import GenerationRequest, SamplingParams

_ids = itertools.count()
BS = 16


def run(engine, prompt, *, salt=None, rid=None, **params):
    params.setdefault("max_tokens", 8)
    params.setdefault("temperature", 0.0)
    rid = rid or f"req-{next(_ids)}"
    stream = engine.submit(GenerationRequest(rid, list(prompt), SamplingParams(**params), cache_salt=salt))
    outputs = stream.result(timeout=120)
    return outputs


def tokens_of(outputs):
    return [t for o in outputs for t in o.new_token_ids]


def prompt_of(n, offset=0):
    return [100 + ((i * 7 + offset) % 5000) for i in range(n)]


def expected_hit(prompt_len, shared_len):
    """The block rule: whole shared blocks, never covering the last prompt token."""
    return min(shared_len // BS, (prompt_len - 1) // BS) * BS


@pytest.mark.parametrize("length", [5, 16, 17, 40, 48, 63, 64, 65])
def test_cached_tokens_follow_the_block_rule(tiny_engine, length):
    prompt = prompt_of(length, offset=length)
    first = run(tiny_engine, prompt)
    again = run(tiny_engine, prompt)
    assert first[-1].num_cached_tokens == 0
    assert again[-1].num_cached_tokens == expected_hit(length, length)
    assert all(o.num_prompt_tokens == length for o in again)


def test_partial_sharing_hits_only_the_shared_whole_blocks(tiny_engine):
    base = prompt_of(70, offset=3)
    run(tiny_engine, base)
    for shared in (0, 15, 16, 33, 47, 48, 69):
        other = base[:shared] + [7000 + i for i in range(70 - shared)]
        out = run(tiny_engine, other)
        assert out[-1].num_cached_tokens == expected_hit(70, shared), shared


def test_reuse_gives_the_same_tokens_and_logits_as_no_caching(make_tiny_engine):
    cached_engine = make_tiny_engine()
    plain_engine = make_tiny_engine(enable_prefix_caching=False)
    logits = {}
    for name, engine in (("cached", cached_engine), ("plain", plain_engine)):
        engine.first_logits_observer = (
            lambda rid, value, name=name: logits.__setitem__((name, rid), value.clone())
        )
    prefix = prompt_of(230, offset=11)
    run(cached_engine, [*prefix, 1, 2, 3])
    for suffix in ([5], [9, 8, 7, 6], list(range(300, 320))):
        prompt = prefix + suffix
        cached = run(cached_engine, prompt, max_tokens=12, rid="same")
        fresh = run(plain_engine, prompt, max_tokens=12, rid="same")
        assert cached[-1].num_cached_tokens == expected_hit(len(prompt), 224)
        assert fresh[-1].num_cached_tokens == 0
        assert tokens_of(cached) == tokens_of(fresh)
        diff = torch.max(torch.abs(logits[("cached", "same")] - logits[("plain", "same")]))
        assert diff.item() == 0.0


def test_generated_tokens_become_reusable_blocks(tiny_engine):
    prompt = prompt_of(40, offset=5)
    out = run(tiny_engine, prompt, max_tokens=20, ignore_eos=True)
    generated = tokens_of(out)
    assert len(generated) == 20
    # 40 prompt + 19 computed output tokens = 59 tokens with K/V: 3 full blocks.
    follow_up = prompt + generated + [1, 2, 3]
    again = run(tiny_engine, follow_up)
    assert again[-1].num_cached_tokens == 48


def test_a_different_salt_gets_no_cached_tokens(tiny_engine):
    prompt = prompt_of(50, offset=9)
    run(tiny_engine, prompt, salt="tenant-a")
    assert run(tiny_engine, prompt, salt="tenant-a")[-1].num_cached_tokens == 48
    assert run(tiny_engine, prompt, salt="tenant-b")[-1].num_cached_tokens == 0
    assert run(tiny_engine, prompt)[-1].num_cached_tokens == 0


def test_max_tokens_length_and_stop_token_ids(tiny_engine):
    prompt = prompt_of(20, offset=1)
    out = run(tiny_engine, prompt, max_tokens=5, ignore_eos=True)
    assert len(tokens_of(out)) == 5 and out[-1].finish_reason == "length"
    first = tokens_of(out)[0]
    stopped = run(tiny_engine, prompt, max_tokens=5, stop_token_ids=(first,))
    assert tokens_of(stopped) == [first] and stopped[-1].finish_reason == "stop"
    assert stopped[-1].new_text == ""


def test_seeded_sampling_is_reproducible(tiny_engine):
    prompt = prompt_of(30, offset=2)
    a = run(tiny_engine, prompt, temperature=1.0, seed=1234, max_tokens=12, ignore_eos=True)
    b = run(tiny_engine, prompt, temperature=1.0, seed=1234, max_tokens=12, ignore_eos=True)
    c = run(tiny_engine, prompt, temperature=1.0, seed=99, max_tokens=12, ignore_eos=True)
    assert tokens_of(a) == tokens_of(b)
    assert tokens_of(a) != tokens_of(c)


def test_invalid_requests_are_refused(tiny_engine):
    with pytest.raises(ValueError, match="maximum context length"):
        tiny_engine.submit(GenerationRequest("long", [5] * tiny_engine.max_model_len, SamplingParams()))
    with pytest.raises(ValueError, match="vocabulary"):
        tiny_engine.submit(GenerationRequest("vocab", [10**9], SamplingParams()))
    with pytest.raises(ValueError, match="empty"):
        tiny_engine.submit(GenerationRequest("empty", [], SamplingParams()))
    with pytest.raises(ValueError, match="cache_salt"):
        tiny_engine.submit(GenerationRequest("salt", [5, 6], SamplingParams(), cache_salt=""))
    with pytest.raises(ValueError, match="max_tokens"):
        SamplingParams(max_tokens=0)


def test_a_failed_forward_leaves_no_cached_garbage(tiny_engine, monkeypatch):
    prompt = prompt_of(64, offset=21)
    real_execute = tiny_engine.runner.execute

    def broken(*args, **kwargs):
        raise RuntimeError("injected forward failure")

    monkeypatch.setattr(tiny_engine.runner, "execute", broken)
    out = run(tiny_engine, prompt)
    assert out[-1].finish_reason == "error" and "injected" in out[-1].error
    monkeypatch.setattr(tiny_engine.runner, "execute", real_execute)
    assert run(tiny_engine, prompt)[-1].num_cached_tokens == 0
    assert run(tiny_engine, prompt)[-1].num_cached_tokens == 48


def test_burst_of_concurrent_cancelled_and_failing_requests_frees_every_block(tiny_engine):
    engine = tiny_engine
    shared = prompt_of(100, offset=13)

    def observer(rid, logits):
        if rid.startswith("fail"):
            raise RuntimeError("injected failure")

    engine.first_logits_observer = observer

    async def one(kind, i):
        prompt = shared + [200 + i] * (i % 5 + 1)
        long = kind in ("cancel", "drop")
        params = SamplingParams(max_tokens=400 if long else 6, temperature=0.0, ignore_eos=True)
        stream = engine.submit(GenerationRequest(f"{kind}-{i}", prompt, params))
        outputs = []
        async for out in stream:
            outputs.append(out)
            if kind == "cancel" and len(outputs) == 2:
                stream.cancel()
            if kind == "drop" and len(outputs) == 1:
                break  # leaving the iterator early cancels the request
        return kind, outputs

    async def burst():
        kinds = ["ok", "cancel", "fail", "drop"] * 5
        return await asyncio.gather(*(one(k, i) for i, k in enumerate(kinds)))

    results = asyncio.run(burst())
    for kind, outputs in results:
        last = outputs[-1]
        if kind == "ok":
            assert last.finish_reason == "length" and len(tokens_of(outputs)) == 6
        elif kind == "cancel":
            assert last.finish_reason == "abort"
            assert len(tokens_of(outputs)) < 400
        elif kind == "fail":
            assert last.finish_reason == "error" and last.error
    wait_until_idle(engine)
    engine.kv_cache_manager.check_integrity()
    assert engine.kv_cache_manager.num_free_blocks == engine.kv_cache_manager.num_blocks
    stats = engine.stats()
    assert stats.num_finished == 20 and stats.prefix_cache_hits > 0
    assert stats.num_aborted == 10 and stats.num_failed == 5


def wait_until_idle(engine, timeout=60.0):
    """Bounded polling on the engine's own counters (the dropped streams' aborts
    are processed by the loop thread after their consumers are gone)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        stats = engine.stats()
        if stats.num_running == 0 and stats.num_waiting == 0 and not engine._active:
            return
        time.sleep(0.01)
    raise AssertionError(f"engine still busy after {timeout} s: {engine.stats()}")


def test_preempted_requests_finish_with_the_same_tokens(make_tiny_engine):
    # 12 blocks of 16 tokens; two requests growing to 9 blocks each cannot both fit.
    engine = make_tiny_engine(kv_cache_memory_gib=12 * 16 * 512 / 1024**3)
    assert engine.kv_cache_manager.num_blocks == 12
    engine.scheduler.reserve_horizon = 8  # admit both, then run out of blocks while decoding
    prompts = [prompt_of(40, offset=31), prompt_of(40, offset=32)]
    solo = [tokens_of(run(engine, p, max_tokens=100, ignore_eos=True)) for p in prompts]

    async def together():
        params = SamplingParams(max_tokens=100, temperature=0.0, ignore_eos=True)
        streams = [engine.submit(GenerationRequest(f"pre-{i}", p, params)) for i, p in enumerate(prompts)]
        return await asyncio.gather(*(s.collect() for s in streams))

    both = asyncio.run(together())
    assert engine.stats().num_preemptions >= 1
    assert [tokens_of(outs) for outs in both] == solo
    assert all(outs[-1].finish_reason == "length" for outs in both)
    assert all(outs[-1].num_cached_tokens == 32 for outs in both)  # the first prefill's hit
    wait_until_idle(engine)
    engine.kv_cache_manager.check_integrity()
    assert engine.kv_cache_manager.num_free_blocks == 12


def test_computed_and_generated_token_counters(tiny_engine):
    """``prompt_tokens_computed`` counts what ran through the model, not prefix-cache
    hits; ``generation_tokens`` every sampled token."""
    prompt = prompt_of(70)
    before = tiny_engine.stats()
    cold = run(tiny_engine, prompt, max_tokens=5, ignore_eos=True)
    mid = tiny_engine.stats()
    assert mid.prompt_tokens_computed - before.prompt_tokens_computed == 70
    assert mid.generation_tokens - before.generation_tokens == len(tokens_of(cold)) == 5
    warm = run(tiny_engine, prompt, max_tokens=3, ignore_eos=True)
    after = tiny_engine.stats()
    assert warm[-1].num_cached_tokens == 64  # four whole blocks of 16
    assert after.prompt_tokens_computed - mid.prompt_tokens_computed == 70 - 64
    assert after.generation_tokens - mid.generation_tokens == 3
