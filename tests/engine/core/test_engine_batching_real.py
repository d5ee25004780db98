"""Batching exactness on the real bundled SmolLM2-135M-Instruct, in bfloat16 and float32,
and with the GGUF's 4-bit projections (``weights="q4_1"``).

Greedy outputs of requests run together (chunked prefill mixed with decodes,
prefix cache cold and warm) equal the outputs of the same requests run one at a
time on an engine without prefix caching.
"""

from __future__ import annotations

import asyncio
import itertools

import pytest

from engine.config import EngineConfig
from engine.core.llm_engine import GenerationRequest, LLMEngine, SamplingParams

pytestmark = pytest.mark.real_model

_ids = itertools.count()
SYSTEM = "You are a terse assistant of a bicycle shop. " * 12
QUESTIONS = [
    "When are you open?",
    "Do you fix cargo bikes?",
    "How much is a new chain?",
    "Can I rent an e-bike for a day, and what does it cost?",
    "Hi",
    "Which tyres do you recommend for winter commuting in a city with snow?",
]
MAX_TOKENS = 24


def chat_ids(engine, question):
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]
    return list(
        engine.tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=True, return_dict=False
        )
    )


def params():
    return SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)


def tokens_of(outputs):
    return [t for o in outputs for t in o.new_token_ids]


def twin(engine, **settings):
    config = EngineConfig(kv_cache_memory_gib=0.1, served_model_name="twin", weights=engine.config.weights, **settings)
    other = LLMEngine(engine.model, engine.tokenizer, config)
    other.start()
    return other


def together(engine, prompts):
    async def go():
        streams = [engine.submit(GenerationRequest(f"rb-{next(_ids)}", p, params())) for p in prompts]
        return await asyncio.gather(*(s.collect() for s in streams))

    return asyncio.run(go())


def check_batched_equals_one_at_a_time(engine):
    prompts = [chat_ids(engine, q) for q in QUESTIONS]
    alone = twin(engine, enable_prefix_caching=False, max_num_seqs=1)
    batched_cold = twin(engine, enable_prefix_caching=False, max_num_batched_tokens=128)
    try:
        expected = [
            tokens_of(alone.submit(GenerationRequest(f"ra-{next(_ids)}", p, params())).result(timeout=300))
            for p in prompts
        ]
        assert [tokens_of(o) for o in together(batched_cold, prompts)] == expected
        together(engine, prompts[:1])  # the shared system prompt is now cached
        warm = together(engine, prompts)
        assert all(o[-1].num_cached_tokens >= 128 for o in warm)
        assert [tokens_of(o) for o in warm] == expected
    finally:
        alone.shutdown()
        batched_cold.shutdown()
    for e in (alone, batched_cold):
        e.kv_cache_manager.check_integrity()
        assert e.kv_cache_manager.num_free_blocks == e.kv_cache_manager.num_blocks


def test_batched_greedy_equals_one_at_a_time_in_the_default_dtype(real_engine):
    check_batched_equals_one_at_a_time(real_engine)


def test_batched_greedy_equals_one_at_a_time_in_float32(real_engine_fp32):
    check_batched_equals_one_at_a_time(real_engine_fp32)


def test_batched_greedy_equals_one_at_a_time_with_4bit_weights(real_engine_q4):
    check_batched_equals_one_at_a_time(real_engine_q4)
