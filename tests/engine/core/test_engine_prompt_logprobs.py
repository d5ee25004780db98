"""prompt_logprobs: every prompt token's logprob under the tokens before it, vLLM's way.

Checked against the engine's own logits of shorter prompts (the engine computes a
token with the same bits alone, in a batch or chunked), against a plain transformers
forward, and for what it must not change: other requests' outputs, prefix reuse.
"""

from __future__ import annotations

import itertools

import pytest
import torch

from engine.core.llm_engine import GenerationRequest, SamplingParams

_ids = itertools.count()


def run(engine, prompt, *, salt=None, **params):
    params.setdefault("max_tokens", 4)
    params.setdefault("temperature", 0.0)
    stream = engine.submit(GenerationRequest(f"plp-{next(_ids)}", list(prompt), SamplingParams(**params),
                                             cache_salt=salt))
    return stream.result(timeout=300)


def prompt_of(n, offset=0):
    return [100 + ((i * 13 + offset) % 5000) for i in range(n)]


def first_logits(engine, prompt):
    """The logits the engine samples the first token of ``prompt`` from."""
    seen = {}
    engine.first_logits_observer = lambda rid, logits: seen.setdefault("x", logits.clone())
    try:
        run(engine, prompt, max_tokens=1)
    finally:
        engine.first_logits_observer = None
    return seen["x"]


def test_entries_equal_the_logits_of_each_shorter_prompt(make_tiny_engine):
    engine = make_tiny_engine(max_num_batched_tokens=32)  # the 70-token prompt runs in 3 chunks
    prompt = prompt_of(70, offset=5)
    out = run(engine, prompt, prompt_logprobs=3)
    entries = out[0].prompt_logprobs
    assert entries is not None and len(entries) == len(prompt) and entries[0] is None
    assert all(o.prompt_logprobs is None for o in out[1:])
    assert out[-1].num_cached_tokens == 0
    for k in (1, 2, 31, 32, 33, 64, 69):
        logp = torch.log_softmax(first_logits(engine, prompt[:k]), dim=-1)
        e = entries[k]
        assert e.token_id == prompt[k]
        assert e.logprob == float(logp[prompt[k]]), k
        assert e.rank == int((logp > logp[prompt[k]]).sum()) + 1
        best = torch.topk(logp, 3)
        assert [t for t, _ in e.top] == best.indices.tolist()
        assert [v for _, v in e.top] == best.values.tolist()


def test_asking_changes_no_output_and_skips_the_prefix_cache(make_tiny_engine):
    engine = make_tiny_engine()
    prompt = prompt_of(50, offset=9)
    plain = run(engine, prompt, max_tokens=6)
    again = run(engine, prompt, max_tokens=6, prompt_logprobs=0)
    assert again[-1].num_cached_tokens == 0  # computed, not reused: reused K/V have no logits
    assert [t for o in again for t in o.new_token_ids] == [t for o in plain for t in o.new_token_ids]
    assert all(e.top == [] for e in again[0].prompt_logprobs[1:])
    after = run(engine, prompt, max_tokens=6)  # its blocks were cached like anyone's
    assert after[-1].num_cached_tokens == 48
    assert [t for o in after for t in o.new_token_ids] == [t for o in plain for t in o.new_token_ids]


def test_a_batch_neighbour_keeps_its_bits(make_tiny_engine):
    engine = make_tiny_engine()
    a, b = prompt_of(40, offset=1), prompt_of(37, offset=2)
    alone = first_logits(engine, a)
    seen = {}
    engine.first_logits_observer = lambda rid, logits: seen.setdefault(rid, logits.clone())
    streams = [engine.submit(GenerationRequest(rid, p, SamplingParams(max_tokens=1, temperature=0.0, **kw),
                                               cache_salt="fresh"))
               for rid, p, kw in (("nb-a", a, {}), ("nb-b", b, {"prompt_logprobs": 5}))]
    for s in streams:
        s.result(timeout=120)
    engine.first_logits_observer = None
    assert torch.equal(seen["nb-a"], alone)


def test_bad_values_are_refused():
    for bad in (-1, 21, 1.5, True):
        with pytest.raises(ValueError, match="prompt_logprobs"):
            SamplingParams(prompt_logprobs=bad)


@pytest.mark.real_model
def test_real_model_matches_a_transformers_forward(real_engine_fp32):
    engine = real_engine_fp32
    text = "The quick brown fox jumps over the lazy dog. " * 6
    prompt = engine.tokenizer(text)["input_ids"]
    out = run(engine, prompt, prompt_logprobs=1, max_tokens=1)
    got = torch.tensor([e.logprob for e in out[0].prompt_logprobs[1:]])
    with torch.inference_mode():
        logits = engine.model(torch.tensor([prompt])).logits[0, :-1].float()
    want = torch.log_softmax(logits, dim=-1).gather(1, torch.tensor(prompt[1:])[:, None])[:, 0]
    assert torch.allclose(got, want, atol=2e-3), (got - want).abs().max()
    assert got[-20:].mean() > got[:10].mean()  # the repeated sentence becomes predictable
