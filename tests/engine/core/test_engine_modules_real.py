"""Prompt modules (issue 21) on the bundled model: the copy and re-rotation are exact
where they must be, and recovery brings the output distribution closer to full prefill."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
import torch

from engine.core.llm_engine import GenerationRequest, SamplingParams
from engine.promptcache.segments import Recovery, Segment, SegmentedPrompt

_ids = itertools.count()
LICENSES = Path("/usr/share/common-licenses")


@pytest.fixture(scope="module")
def texts(real_engine):
    tok = real_engine.tokenizer
    names = ["Apache-2.0", "GPL-3", "MPL-2.0", "Artistic", "BSD"]
    out = []
    for name in names:
        words = (LICENSES / name).read_text(errors="replace").split()
        out.append(tuple(tok.encode(" ".join(words[200:300]) + "\n\n", add_special_tokens=False)))
    marker = "\x00C\x00"
    rendered = tok.apply_chat_template([{"role": "user", "content": marker}], tokenize=False, add_generation_prompt=True)
    head, tail = rendered.split(marker)
    enc = lambda s: tuple(tok.encode(s, add_special_tokens=False))  # noqa: E731
    return {"docs": out, "head": enc(head), "tail": lambda q: enc(f"Question: {q}" + tail)}


def prompt(texts, order, question, recovery, head=True):
    segs = [Segment(texts["head"])] if head else []
    segs += [Segment(texts["docs"][i], f"lic{i}") for i in order]
    segs.append(Segment(texts["tail"](question)))
    return SegmentedPrompt(tuple(segs), recovery)


def generate(engine, sp, segmented, logits, max_tokens=8):
    rid = f"real-mod-{next(_ids)}"
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    outs = engine.submit(GenerationRequest(rid, sp.token_ids, params, segmented=sp if segmented else None)).result(600)
    assert outs[-1].error is None
    return [t for o in outs for t in o.new_token_ids], logits[rid], outs[-1].num_cached_tokens


@pytest.fixture
def logits(real_engine):
    seen: dict[str, torch.Tensor] = {}
    real_engine.first_logits_observer = lambda rid, row: seen.__setitem__(rid, row.float().clone())
    yield seen
    real_engine.first_logits_observer = None


def test_module_at_its_encode_position_is_exact_prefill(real_engine, texts, logits):
    none = Recovery("none")
    generate(real_engine, prompt(texts, [1, 0], "Warm up.", none), True, logits, 1)  # encodes lic0 at position 0
    sp = prompt(texts, [0], "What does it say?", none, head=False)
    seg_tokens, seg_logits, cached = generate(real_engine, sp, True, logits)
    assert cached == len(texts["docs"][0])  # the module was reused, not computed
    exact_tokens, exact_logits, _ = generate(real_engine, sp, False, logits)
    assert seg_tokens == exact_tokens and torch.equal(seg_logits, exact_logits)


def test_recomputing_every_module_token_is_exact_prefill(real_engine, texts, logits):
    sp = prompt(texts, [2, 0, 1], "Which is the most permissive?", Recovery("epic", first_tokens=10**6))
    exact_tokens, exact_logits, _ = generate(real_engine, sp, False, logits)
    seg_tokens, seg_logits, cached = generate(real_engine, sp, True, logits)
    bs = real_engine.kv_cache_manager.block_size
    assert cached == len(texts["head"]) // bs * bs  # the exact request's head blocks; no module reused
    assert seg_tokens == exact_tokens and torch.equal(seg_logits, exact_logits)


def test_re_rotation_matches_rope_at_the_new_position(real_engine):
    shifter = real_engine.shifter
    keys = torch.randn(3, 40, real_engine.layout.head_dim, dtype=torch.float32)
    positions = torch.arange(5, 45)
    cos, sin = shifter.angles(positions)
    from engine.model.kv_shift import _rotate

    at = _rotate(keys, cos, sin)
    for delta in (1, 300, 4000):
        cos_d, sin_d = shifter.angles(torch.full((40,), delta))
        cos_t, sin_t = shifter.angles(positions + delta)
        moved = _rotate(at, cos_d, sin_d)
        # float32 angles of large positions carry ~position * 6e-8 of error; bfloat16 keys 4e-3
        assert torch.allclose(moved, _rotate(keys, cos_t, sin_t), atol=2e-3), delta


def test_recovery_brings_the_first_distribution_closer_to_full_prefill(real_engine, texts, logits):
    orders = [[1, 3, 0, 4], [4, 2, 1, 0], [3, 0, 2, 1], [0, 4, 3, 2]]
    kl: dict[str, list[float]] = {"none": [], "cacheblend": []}
    generate(real_engine, prompt(texts, [0, 1, 2, 3, 4], "Warm up.", Recovery("none")), True, logits, 1)
    for i, order in enumerate(orders):
        question = f"Summarize the obligations. ({i})"
        _, full, _ = generate(real_engine, prompt(texts, order, question, Recovery()), False, logits, 1)
        for mode in kl:
            sp = prompt(texts, order, question, Recovery(mode, fraction=0.3))
            _, got, cached = generate(real_engine, sp, True, logits, 1)
            assert cached > 0
            p, q = torch.log_softmax(full, -1), torch.log_softmax(got, -1)
            kl[mode].append(float((p.exp() * (p - q)).sum()))
    assert sum(kl["cacheblend"]) < sum(kl["none"]), kl


def _benchmark():
    """benchmarks/prompt_modules.py, for its workload (documents, prompts)."""
    import importlib.util

    path = Path(__file__).resolve().parents[3] / "benchmarks" / "prompt_modules.py"
    spec = importlib.util.spec_from_file_location("prompt_modules_benchmark", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _benchmark_prompts(engine, logits, indices):
    """The prompts ``indices`` of benchmarks/prompt_modules.py (4 documents, ~1k tokens),
    its modules encoded first."""
    bench = _benchmark()
    tok = engine.tokenizer
    docs = bench.documents(tok, 8)
    rng = __import__("random").Random(0)
    orders = [rng.sample(range(8), 4) for _ in range(max(indices) + 1)]
    generate(engine, bench.build(tok, docs, list(range(8)), "Warm-up.", Recovery("none")), True, logits, 1)
    return [bench.build(tok, docs, orders[i], f"{bench.QUESTIONS[i % len(bench.QUESTIONS)]} (#{i})", Recovery())
            for i in indices]


def test_recomputing_two_tokens_of_each_module_agrees_where_none_did_not(real_engine, logits):
    """The benchmark's prompts 7 and 75 (full prefill's top-2 logit gap 1.375 each): with
    the modules' K/V as they are (``none``) the first token differs from full prefill's;
    ``epic`` with each module's first 2 tokens recomputed (no module's first token stays
    an attention sink) gets it right, reusing all but those tokens."""
    for sp in _benchmark_prompts(real_engine, logits, [7, 75]):
        full, _, _ = generate(real_engine, sp, False, logits, 1)
        none, _, _ = generate(real_engine, SegmentedPrompt(sp.segments, Recovery("none")), True, logits, 1)
        default, _, cached = generate(real_engine, SegmentedPrompt(sp.segments, Recovery("epic", first_tokens=2)),
                                      True, logits, 1)
        assert none != full and default == full, (full, none, default)
        module_tokens = sum(len(s.token_ids) for s in sp.segments if s.module is not None)
        bs = real_engine.kv_cache_manager.block_size
        head = len(sp.segments[0].token_ids) // bs * bs  # the chat head's full blocks, on the exact chain
        assert cached == head + module_tokens - 4 * 2  # every module token reused but the 2 recomputed of each


def test_default_recovery_agrees_with_full_prefill_where_epic_16_did_not(real_engine, logits):
    """The benchmark's prompts 1 and 70 (full prefill's top-2 logit gaps 0.875, 0.375):
    ``epic`` with 16 tokens misses full prefill's first token; the default,
    ``cacheblend`` 0.1 (tokens chosen by their layer-1 KV deviation), gets it right."""
    assert Recovery() == Recovery("cacheblend", fraction=0.1)
    for sp in _benchmark_prompts(real_engine, logits, [1, 70]):
        full, _, _ = generate(real_engine, sp, False, logits, 1)
        epic, _, _ = generate(real_engine, SegmentedPrompt(sp.segments, Recovery("epic", first_tokens=16)), True,
                              logits, 1)
        blend, _, cached = generate(real_engine, SegmentedPrompt(sp.segments, Recovery("cacheblend", fraction=0.1)),
                                    True, logits, 1)
        assert epic != full and blend == full, (full, epic, blend)
        assert cached > len(sp.token_ids) // 2  # most module tokens reused


def test_a_probe_spread_over_steps_gives_the_same_output(real_engine, texts, logits):
    """cacheblend's probe in chunks (a small step budget: bounded work per step) gives the
    bits one probe over the prompt gives, bfloat16 included."""
    sp = prompt(texts, [3, 1, 4, 0], "Which text allows sublicensing?", Recovery("cacheblend", fraction=0.1))
    warm = prompt(texts, [0, 1, 2, 3, 4], "Warm up.", Recovery("none"))
    probes: list[int] = []
    probe = real_engine.runner.probe
    scheduler = real_engine.scheduler
    budget = scheduler.max_num_batched_tokens

    def generate_salted(segmented, salt, max_tokens):  # each salt its own modules and assembled chain
        rid = f"real-mod-{next(_ids)}"
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        request = GenerationRequest(rid, segmented.token_ids, params, cache_salt=salt, segmented=segmented)
        outs = real_engine.submit(request).result(600)
        assert outs[-1].error is None
        return [t for o in outs for t in o.new_token_ids], logits[rid]

    real_engine.runner.probe = lambda token_ids, *a, **kw: probes.append(len(token_ids)) or probe(token_ids, *a, **kw)
    try:
        generate_salted(warm, "one-probe", 1)
        one_tokens, one_logits = generate_salted(sp, "one-probe", 8)
        generate_salted(warm, "chunked", 1)
        real_engine.call(lambda: setattr(scheduler, "max_num_batched_tokens", 16))
        tokens, first_logits = generate_salted(sp, "chunked", 8)
    finally:
        real_engine.call(lambda: setattr(scheduler, "max_num_batched_tokens", budget))
        real_engine.runner.probe = probe
    assert len(probes) > 2 and probes[0] == sum(probes[1:])  # one probe, then the same span in chunks
    assert tokens == one_tokens and torch.equal(first_logits, one_logits)
