"""Speculative decoding on the real bundled model: drafts change the number of forwards,
never a token or a log-probability (bfloat16, float32 and 4-bit weights).

The engine under test drafts (the default ``speculative_tokens``); its twin on the
same weights does not. Prompts: the batching benchmark's English-like text (the
model's output repeats: drafts are often kept), chat questions (they rarely are),
and a request that quotes its document back.
"""

from __future__ import annotations

import pytest
from support.engine_runs import tokens_and_logprobs

from engine.config import DEFAULT_SPECULATIVE_TOKENS, EngineConfig
from engine.core.llm_engine import LLMEngine

pytestmark = pytest.mark.real_model

DOCUMENT = ("The shop opens at eight on weekdays and at ten on Saturdays. Chains cost twelve euros, "
            "tyres twenty, and a full service forty-five. Cargo bikes are repaired on Tuesdays only.")


def prompts_for(engine):
    tok = engine.tokenizer
    words = ["the", "shop", "repairs", "bikes", "and", "sells", "parts", "for", "city", "riders"]
    text = [" ".join(f"{words[(i * 7 + s) % len(words)]} {(i * 31 + s) % 997}" for i in range(12)) for s in range(3)]
    chats = [[{"role": "user", "content": "Which tyres do you recommend for winter?"}],
             [{"role": "user", "content": f"{DOCUMENT}\n\nRepeat the text above word for word."}]]
    return ([tok.encode(t, add_special_tokens=False) for t in text]
            + [list(tok.apply_chat_template(c, add_generation_prompt=True, tokenize=True, return_dict=False))
               for c in chats])




def check(engine, **params):
    assert engine.config.speculative_tokens == DEFAULT_SPECULATIVE_TOKENS > 0
    plain = LLMEngine(engine.model, engine.tokenizer,
                      EngineConfig(kv_cache_memory_gib=0.1, served_model_name="plain", weights=engine.config.weights,
                                   speculative_tokens=0, seed=0))
    plain.start()
    try:
        prompts = prompts_for(engine)
        expected = tokens_and_logprobs(plain, prompts, **params)
        before = engine.stats()
        assert tokens_and_logprobs(engine, prompts, **params) == expected
        after = engine.stats()
    finally:
        plain.shutdown()
    plain.kv_cache_manager.check_integrity()
    assert plain.kv_cache_manager.num_free_blocks == plain.kv_cache_manager.num_blocks
    assert plain.stats().spec_draft_tokens == 0
    return after.spec_draft_tokens - before.spec_draft_tokens, after.spec_accepted_tokens - before.spec_accepted_tokens


def test_drafts_keep_greedy_tokens_and_logprobs_in_the_default_dtype(real_engine):
    drafted, kept = check(real_engine, max_tokens=64, temperature=0.0, ignore_eos=True, logprobs=2)
    assert kept > 0.3 * drafted > 0  # the text prompts' outputs repeat


def test_drafts_keep_seeded_samples(real_engine):
    drafted, _ = check(real_engine, max_tokens=48, temperature=0.6, seed=5, ignore_eos=True, logprobs=1)
    assert drafted > 0


def test_drafts_keep_greedy_tokens_in_float32(real_engine_fp32):
    _, kept = check(real_engine_fp32, max_tokens=48, temperature=0.0, ignore_eos=True, logprobs=1)
    assert kept > 0


def test_drafts_keep_greedy_tokens_with_4bit_weights(real_engine_q4):
    _, kept = check(real_engine_q4, max_tokens=48, temperature=0.0, ignore_eos=True, logprobs=1)
    assert kept > 0
