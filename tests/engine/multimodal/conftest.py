"""Tiny random LLaVA and Idefics3 checkpoints (built once per session) and engines serving them.

Every engine made here is shut down after the test and checked: all KV blocks back
in the free queue, the encoder cache within its bound.
"""

from __future__ import annotations

import pytest
from tiny_vlm import build_tiny_idefics3, build_tiny_llava


@pytest.fixture(scope="session")
def vlm_dirs(tmp_path_factory):
    from engine.model_store import ensure_converted_model

    tokenizer_dir = str(ensure_converted_model())
    return {
        "llava": build_tiny_llava(tokenizer_dir, tmp_path_factory.mktemp("tiny-llava")),
        "idefics3": build_tiny_idefics3(tokenizer_dir, tmp_path_factory.mktemp("tiny-idefics3")),
    }


@pytest.fixture
def make_vlm_engine(vlm_dirs):
    """``make(arch, **settings)``: a started engine over the tiny checkpoint (float32)."""
    from engine.config import EngineConfig
    from engine.core.llm_engine import LLMEngine

    engines = []

    def make(arch, start=True, **overrides):
        settings = {"model": str(vlm_dirs[arch]), "dtype": "float32", "kv_cache_memory_gib": 0.002,
                    "seed": 0, "served_model_name": f"tiny-{arch}"}
        settings.update(overrides)
        engine = LLMEngine.from_config(EngineConfig(**settings))
        if start:
            engine.start()
        engines.append(engine)
        return engine

    yield make
    for engine in engines:
        engine.shutdown()
        kv = engine.kv_cache_manager
        kv.check_integrity()
        assert kv.num_free_blocks == kv.num_blocks
        cache = engine.embedder.cache
        assert cache.bytes <= cache.max_bytes
