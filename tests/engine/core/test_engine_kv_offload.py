"""The disk tier on a tiny random Llama: a restarted engine serves prefixes from disk with
the same logits and tokens; a working set larger than RAM hits on disk; damaged files
and other salts never load; KV events and metrics name the disk."""

from __future__ import annotations

import itertools
import os
import queue
import stat
from pathlib import Path

import pytest
import torch

from engine.core.llm_engine import GenerationRequest, SamplingParams
from engine.kvcache.block_hash import hash_block_chain
from engine.kvcache.disk_store import SUFFIX

_ids = itertools.count()
BS = 16


def run(engine, prompt, *, salt=None, max_tokens=8):
    rid = f"disk-{next(_ids)}"
    stream = engine.submit(GenerationRequest(rid, list(prompt), SamplingParams(max_tokens=max_tokens, temperature=0.0,
                                                                                ignore_eos=True), cache_salt=salt))
    out = stream.result(timeout=120)
    return rid, [t for o in out for t in o.new_token_ids], out[-1].num_cached_tokens


def prompt_of(n, offset=0):
    return [100 + ((i * 7 + offset) % 5000) for i in range(n)]


def block_files(path):
    return sorted(n for n in os.listdir(path) if n.endswith(SUFFIX))


@pytest.fixture
def offload_dir(tmp_path):
    return str(tmp_path / "kv")


@pytest.fixture
def make(make_tiny_engine, offload_dir):
    """A tiny engine on ``offload_dir`` that records its first-token logits per request id."""

    def build(**overrides):
        engine = make_tiny_engine(kv_offload_dir=offload_dir, **overrides)
        engine.logits = {}
        engine.first_logits_observer = lambda rid, value: engine.logits.__setitem__(rid, value.clone())
        return engine

    return build


def restart(engine, make, **overrides):
    engine.shutdown()  # finishes queued writes
    return make(**overrides)


def test_a_restarted_engine_serves_the_prefix_from_disk_exactly(make, make_tiny_engine, offload_dir):
    prefix = prompt_of(230, offset=11)
    first = make()
    assert run(first, [*prefix, 1, 2, 3])[2] == 0
    second = restart(first, make)
    assert len(block_files(offload_dir)) == 15  # 233 + 7 computed output tokens = 15 full blocks
    plain = make_tiny_engine(enable_prefix_caching=False)
    plain.logits = {}
    plain.first_logits_observer = lambda rid, value: plain.logits.__setitem__(rid, value.clone())
    for suffix in ([5], [9, 8, 7, 6], list(range(300, 320))):
        prompt = prefix + suffix
        rid_disk, from_disk, cached = run(second, prompt)
        assert cached == 224  # the 14 blocks of the prefix, from disk
        assert second.stats().disk_hits == 14  # later suffixes hit the loaded blocks in RAM
        rid_plain, fresh, _ = run(plain, prompt)
        assert from_disk == fresh
        assert torch.equal(second.logits[rid_disk], plain.logits[rid_plain])  # cached == uncached, bit for bit
    stats = second.stats()
    assert stats.disk_bytes_read > 0 and stats.disk_load_count == 1 and stats.prefix_cache_hits == 3 * 224
    second.kv_cache_manager.check_integrity()


def test_files_are_private(make, offload_dir):
    engine = make()
    run(engine, prompt_of(40))
    engine.offload.store.flush()
    assert stat.S_IMODE(os.stat(offload_dir).st_mode) == 0o700
    files = block_files(offload_dir)
    assert files and all(stat.S_IMODE(os.stat(os.path.join(offload_dir, f)).st_mode) == 0o600 for f in files)


def test_a_working_set_larger_than_ram_hits_on_disk(make):
    # 40 blocks of RAM; 8 prompts of 6 full blocks each cycle through it twice.
    engine = make(kv_cache_memory_gib=40 * BS * 512 / 2**30, max_model_len=200)
    prompts = [prompt_of(100, offset=13 * k + 1) for k in range(8)]
    reference = [run(engine, p) for p in prompts]
    engine.offload.store.flush()
    for p, (_, ref, _) in zip(prompts, reference, strict=True):
        _, tokens, cached = run(engine, p)
        assert tokens == ref and cached == 96
    assert engine.stats().disk_hits >= 6 * 4  # at least half the prompts came back from disk
    engine.kv_cache_manager.check_integrity()


def test_batched_disk_loads_equal_one_at_a_time(make):
    prompts = [prompt_of(70, offset=300 * k) for k in range(4)]
    first = make()
    alone = [run(first, p)[1] for p in prompts]
    second = restart(first, make)
    streams = [second.submit(GenerationRequest(f"batch-{k}", p, SamplingParams(max_tokens=8, temperature=0.0,
                                                                                 ignore_eos=True)))
               for k, p in enumerate(prompts)]
    outs = [s.result(timeout=120) for s in streams]
    assert [[t for o in out for t in o.new_token_ids] for out in outs] == alone
    assert all(out[-1].num_cached_tokens == 64 for out in outs)


@pytest.mark.parametrize("damage", ["flip", "truncate", "foreign"])
def test_damaged_files_still_give_correct_answers(make, offload_dir, damage):
    prompt = prompt_of(100, offset=7)
    first = make()
    _, cold, _ = run(first, prompt)
    first.shutdown()
    second = make() if damage != "foreign" else None
    for name in block_files(offload_dir):
        path = os.path.join(offload_dir, name)
        data = bytearray(Path(path).read_bytes())
        if damage == "flip":
            data[len(data) // 2] ^= 0x5A
        elif damage == "truncate":
            data = data[: len(data) // 2]
        Path(path).write_bytes(bytes(data))
    if damage == "foreign":  # same files, another block size: another fingerprint
        second = make(block_size=BS * 2)
    _, warm, cached = run(second, prompt)
    assert warm == cold and cached == 0
    assert second.stats().disk_corrupt >= 1 and second.stats().disk_hits == 0
    second.kv_cache_manager.check_integrity()


def test_another_salt_never_loads_a_tenants_blocks(make):
    prompt = prompt_of(100, offset=11)
    first = make()
    _, cold, _ = run(first, prompt, salt="tenant-a")
    second = restart(first, make)
    cached = run(second, prompt, salt="tenant-b")[2]
    assert cached == 0 and second.stats().disk_hits == 0
    cached = run(second, prompt)[2]
    assert cached == 0 and second.stats().disk_hits == 0
    _, same, cached = run(second, prompt, salt="tenant-a")
    assert cached == 96 and same == cold and second.stats().disk_hits == 6


def test_kv_events_name_the_disk_and_the_gateway_indexes_them(make, offload_dir):
    from engine.server.kv_event_publisher import KvEventRecorder
    from gateway.routing.block_index import ReplicaIndex
    from gateway.routing.kv_events import apply_events

    prompt = prompt_of(100, offset=13)
    first = make()
    events: queue.SimpleQueue = queue.SimpleQueue()
    first.kv_cache_manager.block_pool.event_sink = KvEventRecorder(events)
    run(first, prompt, salt="s")
    first.offload.store.flush()
    seen = [events.get() for _ in range(events.qsize())]
    assert {e["medium"] for e in seen if e["type"] == "BlockStored"} == {"GPU", "DISK"}
    second = restart(first, make)
    restarted: queue.SimpleQueue = queue.SimpleQueue()
    second.kv_cache_manager.block_pool.event_sink = KvEventRecorder(restarted)
    second.offload.announce_existing().join()
    announced = [restarted.get() for _ in range(restarted.qsize())]
    assert [e["medium"] for e in announced] == ["DISK"] * 6
    index = ReplicaIndex()
    apply_events(index, [(e["type"], e) for e in announced])
    keys = hash_block_chain(prompt, BS, cache_salt="s")
    assert index.hit_blocks(keys) == 6  # the router sees the disk blocks of a restarted replica


def test_disk_metrics_on_the_metrics_endpoint(make):
    from prometheus_client.parser import text_string_to_metric_families

    from engine.server.metrics import EngineMetrics

    prompt = prompt_of(60, offset=17)
    first = make()
    run(first, prompt)
    second = restart(first, make)
    run(second, prompt)
    found = {s.name: s.value for f in text_string_to_metric_families(EngineMetrics(second, "tiny").render().decode())
             for s in f.samples}
    assert found["prefixgate_engine_disk_cache_hits_blocks_total"] == 3
    assert found["prefixgate_engine_disk_cache_read_bytes_total"] > 0
    assert found["prefixgate_engine_disk_cache_load_seconds_count"] == 1
    assert found["prefixgate_engine_disk_cache_blocks"] == 4  # 60 + 7 computed tokens


KILLED_CHILD = """
import os, signal, sys, torch
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM
from engine.config import EngineConfig
from engine.core.llm_engine import GenerationRequest, LLMEngine, SamplingParams
from engine.model_store import ensure_converted_model

tok = AutoTokenizer.from_pretrained(str(ensure_converted_model()), local_files_only=True)
torch.manual_seed(0)
config = LlamaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                     eos_token_id=tok.eos_token_id, bos_token_id=tok.bos_token_id)
model = LlamaForCausalLM(config).to(torch.float32)
model.config._attn_implementation = "sdpa"
model.eval()
engine = LLMEngine(model, tok, EngineConfig(kv_cache_memory_gib=0.002, served_model_name="tiny-llama", seed=0,
                                            kv_offload_dir=sys.argv[1]))
engine.start()
prompt = [int(t) for t in sys.argv[2].split(",")]
engine.submit(GenerationRequest("k", prompt, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))).result()
os.kill(os.getpid(), signal.SIGKILL)  # queued block writes may be cut anywhere
"""


def test_after_sigkill_every_block_written_before_the_kill_is_served(make, make_tiny_engine, offload_dir):
    import subprocess
    import sys

    from engine.kvcache.block_hash import hash_block_chain

    prompt = prompt_of(300, offset=19)
    child = subprocess.run([sys.executable, "-c", KILLED_CHILD, offload_dir, ",".join(map(str, prompt))],
                           env={**os.environ, "PYTHONPATH": os.getcwd()}, capture_output=True, timeout=300)
    assert child.returncode == -9, child.stderr.decode()[-2000:]
    chain = hash_block_chain(prompt, BS)
    on_disk = {bytes.fromhex(n[:64]) for n in block_files(offload_dir)}
    written = next((i for i, h in enumerate(chain) if h not in on_disk), len(chain))
    assert on_disk, "the child wrote no block before it was killed"
    engine = make()
    plain = make_tiny_engine(enable_prefix_caching=False)
    _, tokens, cached = run(engine, prompt)
    assert tokens == run(plain, prompt)[1]
    assert cached == min(written, (len(prompt) - 1) // BS) * BS
    assert engine.stats().disk_corrupt == 0
    assert not any(n.startswith(".tmp-") for n in os.listdir(offload_dir))
