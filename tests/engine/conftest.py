"""Shared engine fixtures: a tiny random Llama engine (fast) and the real bundled model (slow).

``tiny_engine`` wraps a 2-layer randomly initialised Llama with the bundled
tokenizer's vocabulary; ``real_engine`` (session-scoped) serves the bundled
SmolLM2-135M-Instruct in the default dtype; ``real_engine_fp32`` in float32;
``real_engine_q4`` with the GGUF's 4-bit projections (``weights="q4_1"``).
Every engine fixture checks on teardown that all blocks went back to the free queue.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


def _check_all_blocks_free(engine) -> None:
    kv = engine.kv_cache_manager
    kv.check_integrity()
    assert kv.num_free_blocks == kv.num_blocks


@pytest.fixture(scope="session")
def bundled_tokenizer():
    from transformers import AutoTokenizer

    from engine.model_store import ensure_converted_model

    return AutoTokenizer.from_pretrained(str(ensure_converted_model()), local_files_only=True)


@pytest.fixture(scope="session")
def tiny_model(bundled_tokenizer):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=len(bundled_tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        eos_token_id=bundled_tokenizer.eos_token_id,
        bos_token_id=bundled_tokenizer.bos_token_id,
    )
    model = LlamaForCausalLM(config).to(torch.float32)
    model.config._attn_implementation = "sdpa"
    model.eval()
    return model


@pytest.fixture
def engine_factory(bundled_tokenizer):
    """``engine_factory(model, defaults)``: a factory of engines on ``model`` with the
    bundled tokenizer (``make(started=True, **overrides)``, settings over ``defaults``);
    every engine made is shut down and checked for leaked blocks after the test."""
    from engine.config import EngineConfig
    from engine.core.llm_engine import LLMEngine

    engines = []

    def factory(model, defaults):
        def make(started=True, **overrides):
            engine = LLMEngine(model, bundled_tokenizer, EngineConfig(**{**defaults, **overrides}))
            if started:
                engine.start()
            engines.append(engine)
            return engine

        make.engines = engines
        return make

    yield factory
    for engine in engines:
        engine.shutdown()
        _check_all_blocks_free(engine)


@pytest.fixture
def make_tiny_engine(tiny_model, engine_factory):
    """A factory of started tiny engines (settings overridable); all are shut down and
    checked for leaked blocks after the test."""
    return engine_factory(tiny_model, {"kv_cache_memory_gib": 0.002, "served_model_name": "tiny-llama", "seed": 0})


@pytest.fixture
def tiny_engine(make_tiny_engine):
    """A started tiny engine: 2-layer random Llama, block size 16, ~500 blocks."""
    return make_tiny_engine()


def _real_engine(dtype: str, weights: str = "dense"):
    from engine.config import EngineConfig
    from engine.core.llm_engine import LLMEngine

    return LLMEngine.from_config(EngineConfig(dtype=dtype, kv_cache_memory_gib=0.25, seed=0, weights=weights))


@pytest.fixture(scope="session")
def real_engine() -> Iterator:
    engine = _real_engine("auto")
    engine.start()
    yield engine
    engine.shutdown()
    _check_all_blocks_free(engine)


@pytest.fixture(scope="session")
def real_engine_fp32() -> Iterator:
    engine = _real_engine("float32")
    engine.start()
    yield engine
    engine.shutdown()
    _check_all_blocks_free(engine)


@pytest.fixture(scope="session")
def real_engine_q4() -> Iterator:
    """The bundled model with ``weights="q4_1"`` (its GGUF's 4-bit blocks), bfloat16."""
    engine = _real_engine("bfloat16", weights="q4_1")
    engine.start()
    yield engine
    engine.shutdown()
    _check_all_blocks_free(engine)
