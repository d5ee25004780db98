"""The disk tier on the real bundled model: after a restart, a 2k-token prompt is served
from disk (every block but the last prompt token's) with the cold run's greedy text and
first-token logits."""

from __future__ import annotations

import pytest
import torch

from engine.config import EngineConfig
from engine.core.llm_engine import GenerationRequest, LLMEngine, SamplingParams

pytestmark = pytest.mark.real_model


def long_chat(tokenizer, n_tokens):
    rules = " ".join(f"Rule {i}: cite section {i * 7 % 31} of the handbook for case {i}." for i in range(400))
    messages = [{"role": "system", "content": rules}, {"role": "user", "content": "Which rule covers case 12?"}]
    ids = list(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False))
    return ids[:n_tokens - 24] + ids[-24:]  # keep the question and the assistant header


def engine_on(real_engine, path):
    engine = LLMEngine(real_engine.model, real_engine.tokenizer,
                       EngineConfig(kv_cache_memory_gib=0.25, seed=0, kv_offload_dir=path, served_model_name="disk"))
    engine.start()
    return engine


def greedy(engine, rid, prompt):
    out = engine.submit(GenerationRequest(rid, prompt, SamplingParams(max_tokens=24, temperature=0.0))).result(
        timeout=900)
    return engine.tokenizer.decode([t for o in out for t in o.new_token_ids]), out[-1].num_cached_tokens


def test_a_2k_prefix_is_served_from_disk_after_a_restart(real_engine, tmp_path):
    """Disk-warm equals RAM-warm equals cold, bit for bit (first-token logits) and in
    greedy text (bfloat16).

    Cold computes position 2,047 in a prefill chunk of 512 rows, warm in a 16-token
    tail: before attention's probabilities-times-values product ran in tiles of at
    most 16 rows, their logits differed by 0.44 and the greedy text diverged
    (:mod:`engine.model.attention`)."""
    path = str(tmp_path / "kv")
    prompt = long_chat(real_engine.tokenizer, 2048)
    assert len(prompt) == 2048
    logits = {}

    def observe(rid, value):
        logits[rid] = value.clone()

    first = engine_on(real_engine, path)
    first.first_logits_observer = observe
    try:
        cold_text, cold_cached = greedy(first, "cold", prompt)
        ram_text, ram_cached = greedy(first, "ram", prompt)
    finally:
        first.shutdown()
    assert cold_cached == 0
    second = engine_on(real_engine, path)  # a new engine on the same directory: a restart
    second.first_logits_observer = observe
    try:
        disk_text, disk_cached = greedy(second, "disk", prompt)
        stats = second.stats()
    finally:
        second.shutdown()
    bs = second.block_size
    assert disk_cached == ram_cached == (len(prompt) - 1) // bs * bs >= len(prompt) - bs
    assert stats.disk_hits == disk_cached // bs
    assert torch.equal(logits["disk"], logits["ram"])
    assert disk_text == ram_text and disk_text.strip()
    assert torch.equal(logits["cold"], logits["ram"]), (logits["cold"] - logits["ram"]).abs().max()
    assert cold_text == disk_text
