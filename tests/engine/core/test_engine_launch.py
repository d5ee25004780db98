"""LLMEngine.launch: the model is loaded on the engine's own thread and the loop runs on
that thread, so one thread does all of torch's parallel work (see ``launch``)."""

from __future__ import annotations

import threading

import pytest

from engine.config import EngineConfig
from engine.core.llm_engine import GenerationRequest, LLMEngine, SamplingParams


@pytest.fixture(scope="module")
def tiny_checkpoint(tmp_path_factory, tiny_model, bundled_tokenizer):
    out = tmp_path_factory.mktemp("tiny-llama")
    tiny_model.save_pretrained(out)
    bundled_tokenizer.save_pretrained(out)
    return out


def _greedy(engine: LLMEngine, prompt: list[int], rid: str) -> list[int]:
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    outputs = engine.submit(GenerationRequest(rid, prompt, params)).result(timeout=120)
    assert outputs[-1].error is None
    return [t for o in outputs for t in o.new_token_ids]


def test_launch_loads_and_loops_on_one_thread_and_serves_the_same_tokens(tiny_checkpoint, monkeypatch):
    config = EngineConfig(model=str(tiny_checkpoint), kv_cache_memory_gib=0.002, seed=0)
    loaded_on: list[int] = []
    real = LLMEngine.from_config.__func__

    def spy(cls, cfg):
        loaded_on.append(threading.get_ident())
        return real(cls, cfg)

    monkeypatch.setattr(LLMEngine, "from_config", classmethod(spy))
    engine = LLMEngine.launch(config)
    try:
        assert engine._thread is not None and engine._thread.is_alive()
        assert loaded_on == [engine._thread.ident] and loaded_on[0] != threading.get_ident()
        prompt = [100 + (i * 7) % 900 for i in range(21)]
        launched = _greedy(engine, prompt, "launched")
    finally:
        engine.shutdown()
    assert engine._thread is None
    kv = engine.kv_cache_manager
    kv.check_integrity()
    assert kv.num_free_blocks == kv.num_blocks

    classic = real(LLMEngine, config)
    classic.start()
    try:
        assert _greedy(classic, prompt, "classic") == launched
    finally:
        classic.shutdown()


def test_a_load_failure_reaches_the_caller_and_leaves_no_thread(tmp_path):
    before = {t.ident for t in threading.enumerate()}
    with pytest.raises(ValueError, match="no-such-model"):
        LLMEngine.launch(EngineConfig(model=str(tmp_path / "no-such-model"), kv_cache_memory_gib=0.002))
    for thread in threading.enumerate():
        if thread.ident not in before and thread.name == "prefixgate-engine":
            thread.join(timeout=10)
            assert not thread.is_alive()


def test_call_runs_on_the_loop_thread_between_steps(tiny_checkpoint):
    engine = LLMEngine.launch(EngineConfig(model=str(tiny_checkpoint), kv_cache_memory_gib=0.002, seed=0))
    try:
        loop_thread = engine._thread
        assert loop_thread is not None
        assert engine.call(threading.current_thread) is loop_thread
        assert engine.call(lambda: engine.call(lambda: 7)) == 7  # from the loop thread itself: run in place
        with pytest.raises(KeyError, match="raised on the loop"):
            engine.call(lambda: {}["raised on the loop"])
        params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
        stream = engine.submit(GenerationRequest("beside", [100 + i for i in range(21)], params))
        free = engine.call(lambda: engine.kv_cache_manager.num_free_blocks)  # between steps: a consistent view
        assert 0 <= free <= engine.kv_cache_manager.num_blocks
        assert stream.result(timeout=120)[-1].error is None  # the loop still serves after the calls
    finally:
        engine.shutdown()
    with pytest.raises(RuntimeError, match="not running"):
        engine.call(lambda: 1)
