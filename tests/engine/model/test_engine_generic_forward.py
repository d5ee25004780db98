"""The generic forward: a non-Llama architecture (a tiny random Qwen2, with q/k/v biases)
runs through its own transformers module graph with the paged attention registered."""

from __future__ import annotations

import asyncio

import pytest
import torch

from engine.config import EngineConfig
from engine.core.llm_engine import GenerationRequest, LLMEngine, SamplingParams
from engine.model.runner import SequenceInput


@pytest.fixture(scope="module")
def qwen2_engine(bundled_tokenizer):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(1)
    config = Qwen2Config(
        vocab_size=len(bundled_tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
        eos_token_id=bundled_tokenizer.eos_token_id, bos_token_id=bundled_tokenizer.bos_token_id,
    )
    model = Qwen2ForCausalLM(config).to(torch.float32).eval()
    engine = LLMEngine(model, bundled_tokenizer, EngineConfig(
        kv_cache_memory_gib=0.002, served_model_name="tiny-qwen2", seed=0, max_num_batched_tokens=40,
    ))
    engine.start()
    yield engine
    engine.shutdown()
    engine.kv_cache_manager.check_integrity()
    assert engine.kv_cache_manager.num_free_blocks == engine.kv_cache_manager.num_blocks


def prompt_of(n, offset=0):
    return [100 + ((i * 11 + offset) % 5000) for i in range(n)]


def test_generic_forward_matches_a_stock_transformers_forward(qwen2_engine):
    engine = qwen2_engine
    assert not engine.runner.lean
    ids = prompt_of(70, offset=4)
    logits = engine.runner.execute([SequenceInput(ids, 0, list(range(5)), True)])[0]
    model = engine.model
    own = model.config._attn_implementation
    try:  # the engine is idle and these blocks are free: nothing else touches them
        model.config._attn_implementation = "sdpa"
        with torch.inference_mode():
            stock = model(torch.tensor([ids])).logits[0, -1].float()
    finally:
        model.config._attn_implementation = own
    assert torch.max(torch.abs(logits - stock)).item() <= 1e-4


def test_generic_forward_batched_equals_one_at_a_time(qwen2_engine):
    engine = qwen2_engine
    prompts = [prompt_of(n, offset=n) for n in (9, 33, 50, 18)]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)

    def tokens(outputs):
        return [t for o in outputs for t in o.new_token_ids]

    alone = [tokens(engine.submit(GenerationRequest(f"q-{i}", p, params)).result(timeout=60))
             for i, p in enumerate(prompts)]

    async def go():
        streams = [engine.submit(GenerationRequest(f"qb-{i}", p, params)) for i, p in enumerate(prompts)]
        return await asyncio.gather(*(s.collect() for s in streams))

    batched = asyncio.run(go())
    assert [tokens(o) for o in batched] == alone
    assert [o[-1].num_cached_tokens for o in batched] == [0, 32, 48, 16]  # warm from the solo runs


def test_generic_forward_rows_get_the_same_bits_alone_or_batched(qwen2_engine):
    """Bit for bit, not only the greedy tokens: a decode row's logits alone equal its
    logits next to another decode and a prefill chunk (8 and 40 rows in the call)."""
    runner = qwen2_engine.runner
    prompts = [prompt_of(30, offset=k) for k in range(2)]
    tables = [list(range(10 + 3 * k, 13 + 3 * k)) for k in range(2)]
    for ids, table in zip(prompts, tables, strict=True):  # each table's prefix K/V
        runner.execute([SequenceInput(ids, 0, table, False)])
    decodes = [SequenceInput([7 + k], 30, tables[k], True) for k in range(2)]
    alone = [runner.execute([d])[0] for d in decodes]
    prefill = SequenceInput(prompt_of(35, offset=9), 0, list(range(20, 23)), True)
    together = runner.execute(decodes)
    mixed = runner.execute([*decodes, prefill])
    for k in range(2):
        assert torch.equal(together[k], alone[k])
        assert torch.equal(mixed[k], alone[k])
    # the tiled products are installed for the runner's forward only: the model is left as it was
    linears = [m for m in qwen2_engine.model.modules() if isinstance(m, torch.nn.Linear)]
    assert linears and all("forward" not in m.__dict__ for m in linears)
