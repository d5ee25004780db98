"""KV mirrors (engine/model/kv_mirror.py): attention reads a long request's K/V from a
contiguous copy instead of gathering them; the bits must not change.

Fast tests run the tiny Llama with the mirror threshold lowered; the real-model test
runs the bundled model at a 1.2k-token prompt (above the real threshold), mirrored
and not, batched and alone."""

from __future__ import annotations

import asyncio
import itertools

import pytest
import torch

from engine.config import EngineConfig
from engine.core.llm_engine import GenerationRequest, LLMEngine, SamplingParams
from engine.model import kv_mirror
from engine.model.kv_mirror import KVMirrors
from engine.model.kv_storage import KVLayout, KVStorage
from engine.model.runner import SequenceInput

_ids = itertools.count()


def prompt_of(n, offset=0):
    return [100 + ((i * 13 + offset) % 5000) for i in range(n)]


def check_mirrors(runner, key, table):
    """Every valid position of ``key``'s mirror equals the pool's K/V."""
    entry = runner.mirrors._entries[key]
    storage = runner.storage
    layers = storage.layout.num_layers
    keys, values = entry.view(entry.buf_keys, layers), entry.view(entry.buf_values, layers)
    assert torch.isfinite(keys).all() and torch.isfinite(values).all()
    slots = torch.tensor(storage.slot_ids(table, 0, entry.valid))
    for layer in range(layers):
        k, v = storage.read(layer, slots)
        assert torch.equal(keys[layer, :, : entry.valid], k.transpose(0, 1))
        assert torch.equal(values[layer, :, : entry.valid], v.transpose(0, 1))


@pytest.mark.parametrize("headroom", [0, 1024])  # 0: every growth moves to a new buffer; else stretched in place
def test_mirrored_forwards_give_the_gathered_bits(make_tiny_engine, monkeypatch, headroom):
    monkeypatch.setattr(kv_mirror, "MIN_TOKENS", 64)
    monkeypatch.setattr(kv_mirror, "HEADROOM", headroom)
    engine = make_tiny_engine()
    runner = engine.runner
    ids = prompt_of(200)
    plain, mirrored = list(range(0, 16)), list(range(20, 36))  # two block tables, same tokens
    other = list(range(40, 45))
    # chunks (the first under the threshold), decodes alone and beside another sequence
    steps = [(0, 40), (40, 110), (110, 150), (150, 151), (151, 152), (152, 170), (170, 171), (171, 172)]
    for start, end in steps:
        beside = [SequenceInput(prompt_of(3, start), 0, other, True)] if end - start == 1 and start % 2 else []
        a = engine.call(lambda s=start, e=end, b=beside: runner.execute([SequenceInput(ids[s:e], s, plain, True), *b]))
        b = engine.call(lambda s=start, e=end, b=beside: runner.execute(
            [SequenceInput(ids[s:e], s, mirrored, True, mirror="r"), *b]))
        assert torch.equal(a, b), (start, end)
        if end > 64:
            check_mirrors(runner, "r", mirrored)
    assert len(runner.mirrors) == 1
    # its blocks freed and others given (preempted, re-admitted): refilled from the pool, same bits
    moved = list(range(60, 76))
    engine.call(lambda: runner.execute([SequenceInput(ids[:172], 0, moved, False)]))
    a = engine.call(lambda: runner.execute([SequenceInput(ids[172:173], 172, plain, True)]))
    b = engine.call(lambda: runner.execute([SequenceInput(ids[172:173], 172, moved, True, mirror="r")]))
    assert torch.equal(a, b)
    check_mirrors(runner, "r", moved)
    runner.mirrors.forget("r")
    assert len(runner.mirrors) == 0


def test_the_budget_bounds_the_mirrors_least_recently_used_first():
    layout = KVLayout(num_layers=2, kv_heads=1, head_dim=4, block_size=16, dtype=torch.float32)
    storage = KVStorage(layout, 400)
    one = 2 * 2 * 1 * (kv_mirror.MIN_TOKENS + kv_mirror.HEADROOM) * 4 * 4  # a new buffer for MIN_TOKENS positions
    mirrors = KVMirrors(storage, 2 * one)
    table = list(range(kv_mirror.MIN_TOKENS // 16))
    n = kv_mirror.MIN_TOKENS
    assert mirrors.use("a", table, 0, 0, n, n) is not None
    assert mirrors.use("b", table, 0, 0, n, n) is not None
    assert mirrors.use("a", table, 0, n - 1, n, n) is not None  # "a" used last
    assert mirrors.use("c", table, 0, 0, n, n) is not None
    assert set(mirrors._entries) == {"a", "c"} and mirrors.nbytes <= mirrors.budget_bytes
    assert mirrors.use("d", table * 4, 0, 0, 4 * n, 4 * n) is None  # larger than the budget
    assert mirrors.use("e", table, 0, 0, n // 2, n // 2) is None  # short: gathered
    assert set(mirrors._entries) == {"a", "c"}
    mirrors.forget("a")  # its buffer is kept and taken by the next mirror
    held = mirrors.nbytes
    assert mirrors.use("f", table, 0, 0, n, n) is not None and mirrors.nbytes == held
    with pytest.raises(ValueError, match="-1"):
        KVMirrors(storage, -1)


def generate(engine, prompts, max_tokens=12):
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)

    async def go():
        streams = [engine.submit(GenerationRequest(f"m-{next(_ids)}", p, params)) for p in prompts]
        return await asyncio.gather(*(s.collect() for s in streams))

    return [[t for o in outs for t in o.new_token_ids] for outs in asyncio.run(go())]


def test_an_engine_with_mirrors_answers_as_one_without(make_tiny_engine, monkeypatch):
    monkeypatch.setattr(kv_mirror, "MIN_TOKENS", 64)
    prompts = [prompt_of(150, 1), prompt_of(90, 2), prompt_of(20, 3)]
    without = make_tiny_engine(kv_mirror_memory_gib=0, max_num_batched_tokens=48)
    with_ = make_tiny_engine(max_num_batched_tokens=48)
    assert generate(with_, prompts) == generate(without, prompts)
    assert len(with_.runner.mirrors) == 0  # forgotten as their requests finished
    assert len(without.runner.mirrors) == 0


@pytest.mark.real_model
def test_mirrors_keep_the_real_models_greedy_tokens(real_engine):
    tok = real_engine.tokenizer
    text = "The history of the bicycle shop on the corner, told by its owner. " * 90
    long_prompt = tok.encode(text)[:1200]
    prompts = [long_prompt, long_prompt[:600] + tok.encode(" A different ending about trains.")]
    twin = LLMEngine(real_engine.model, tok, EngineConfig(kv_cache_memory_gib=0.2, served_model_name="twin",
                                                         kv_mirror_memory_gib=0, enable_prefix_caching=False,
                                                         max_num_seqs=1))
    twin.start()
    try:
        expected = [generate(twin, [p])[0] for p in prompts]
    finally:
        twin.shutdown()
    assert real_engine.runner.mirrors.budget_bytes > 0
    assert generate(real_engine, prompts) == expected  # batched, mirrored
    assert generate(real_engine, prompts[:1]) == expected[:1]  # warm prefix, mirrored from the pool


@pytest.mark.parametrize("bad", [-1, float("inf"), float("nan"), True, "1"])
def test_the_mirror_budget_must_be_a_finite_number_of_gib(bad):
    with pytest.raises(ValueError, match="kv_mirror_memory_gib"):
        EngineConfig(kv_mirror_memory_gib=bad)


@pytest.mark.parametrize("bad", ["-1", "inf", "nan", "abc"])
def test_the_cli_refuses_a_bad_mirror_budget_in_one_line(bad, capsys):
    from gateway.cli import build_parser

    with pytest.raises(SystemExit) as exit_:
        build_parser().parse_args(["engine", "--kv-mirror-memory", bad])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "--kv-mirror-memory" in err and "Traceback" not in err
