"""Fixtures of the compressed-KV tests: a 6-layer tiny Llama (deep enough for retention
to fall) and a factory of engines on it, checked for leaked blocks and
mirrors on teardown."""

from __future__ import annotations

import pytest
import torch

from engine.config import EngineConfig
from engine.core.llm_engine import LLMEngine


@pytest.fixture(scope="session")
def deep_model(bundled_tokenizer):
    """A 6-layer tiny Llama: enough depth for retention to fall."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(1)
    config = LlamaConfig(vocab_size=len(bundled_tokenizer), hidden_size=64, intermediate_size=128,
                         num_hidden_layers=6, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=4096, eos_token_id=bundled_tokenizer.eos_token_id)
    return LlamaForCausalLM(config).to(torch.float32).eval()


@pytest.fixture
def make_engine(deep_model, bundled_tokenizer):
    """A factory of engines on :func:`deep_model` (compressing by default; started unless
    ``started=False``); after the test, all blocks are free and no packed mirror is left."""
    engines = []

    def make(started=True, **overrides):
        settings = {"kv_cache_memory_gib": 0.004, "seed": 0, "kv_compression": "pyramid",
                    "served_model_name": "tiny"}
        settings.update(overrides)
        engine = LLMEngine(deep_model, bundled_tokenizer, EngineConfig(**settings))
        if started:
            engine.start()
        engines.append(engine)
        return engine

    yield make
    for engine in engines:
        engine.shutdown()
        kv = engine.kv_cache_manager
        kv.check_integrity()
        assert kv.num_free_blocks == kv.num_blocks and not kv.packed
        assert not len(engine.runner.packed_mirrors) and not engine.runner.packed_mirrors.nbytes
