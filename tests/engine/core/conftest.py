"""Fixtures of the compressed-KV tests: a 6-layer tiny Llama (deep enough for retention
to fall) and a factory of engines on it, checked for leaked blocks and
mirrors on teardown."""

from __future__ import annotations

import pytest
import torch


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
def make_engine(deep_model, engine_factory):
    """A factory of engines on :func:`deep_model` (compressing by default; started unless
    ``started=False``); after the test, no packed page or packed mirror is left (and
    :func:`engine_factory` checks that all blocks are free)."""
    make = engine_factory(deep_model, {"kv_cache_memory_gib": 0.004, "seed": 0, "kv_compression": "pyramid",
                                       "served_model_name": "tiny"})
    yield make
    for engine in make.engines:
        engine.shutdown()
        assert not engine.kv_cache_manager.packed
        assert not len(engine.runner.packed_mirrors) and not engine.runner.packed_mirrors.nbytes
