"""KV compression (PyramidInfer-style) on the tiny model: the pool gets blocks back, the
packed tables hold what the schedule says, nothing leaks, no salt crosses, and exact
requests around compressed ones are untouched. Every step is followed by
``check_integrity()`` where the engine is driven by hand."""

from __future__ import annotations

import itertools

import pytest
import torch

from engine.config import EngineConfig
from engine.core.forced_tokens import ForcedTokens
from engine.core.llm_engine import GenerationRequest, SamplingParams
from engine.core.output_stream import OutputStream

_ids = itertools.count()
BS = 16


def prompt_of(n, offset=0):
    return [100 + ((i * 11 + offset) % 4000) for i in range(n)]


def run(engine, prompt, *, salt=None, mode=None, **params):
    params.setdefault("max_tokens", 12)
    params.setdefault("temperature", 0.0)
    stream = engine.submit(GenerationRequest(f"kvc-{next(_ids)}", list(prompt), SamplingParams(**params),
                                             cache_salt=salt, kv_compression=mode))
    return stream.result(timeout=300)


def tokens_of(outputs):
    return [t for o in outputs for t in o.new_token_ids]


def add_by_hand(engine, requests):
    """The engine requests of ``requests``, queued in the scheduler of a stopped engine."""
    reqs = []
    for r in requests:
        req = engine._validate(r)
        req.stream = OutputStream(r.request_id, lambda _rid: None)
        engine.scheduler.add(req)
        reqs.append(req)
    return reqs


def drive(engine, requests):
    """Submit by hand and step the loop here, checking integrity after every step;
    returns, per request, the blocks it held right after compression."""
    held = {}
    reqs = add_by_hand(engine, requests)
    while engine.scheduler.has_work():
        engine.step()
        engine.kv_cache_manager.check_integrity()
        for req in reqs:
            if req.packed is not None and req.request_id not in held:
                held[req.request_id] = (len(engine.kv_cache_manager.get_block_ids(req.request_id)),
                                        list(req.packed.counts))
    return held


def test_a_compressed_request_holds_fewer_blocks_by_the_schedule(make_engine):
    engine = make_engine(started=False, kv_min_retention=0.25, kv_window=16)
    n = 600
    held = drive(engine, [GenerationRequest("c1", prompt_of(n), SamplingParams(max_tokens=8, temperature=0.0))])
    blocks, counts = held["c1"]
    assert counts[0] == n  # layer 0 keeps everything
    assert counts == sorted(counts, reverse=True) and counts[-1] == 150  # 0.25 * 600 at the last layer
    assert counts == engine.pyramid.keep_counts(n, 6)
    exact_blocks = -(-n // BS)
    assert blocks == -(-sum(-(-c // BS) for c in counts) // 6) < 0.6 * exact_blocks
    kv = engine.kv_cache_manager
    assert kv.num_free_blocks == kv.num_blocks and engine.num_compressed == 1


def test_full_retention_decodes_like_exact(make_engine):
    engine = make_engine(kv_min_retention=1.0)
    prompt = prompt_of(300, offset=4)
    exact = run(engine, prompt, mode="none", max_tokens=20, logprobs=0, salt="a")
    packed = run(engine, prompt, mode="pyramid", max_tokens=20, logprobs=0, salt="b")
    assert engine.num_compressed == 1
    assert tokens_of(packed) == tokens_of(exact)
    a = torch.tensor([e.logprob for o in exact for e in o.logprobs])
    b = torch.tensor([e.logprob for o in packed for e in o.logprobs])
    assert torch.allclose(a, b, atol=1e-4), (a - b).abs().max()


def test_exact_requests_never_read_compressed_kv(make_engine):
    reference = make_engine(kv_compression="none")
    engine = make_engine()
    prompt = prompt_of(400, offset=8)
    want = tokens_of(run(reference, prompt, max_tokens=16))
    squeezed = run(engine, prompt, max_tokens=16)  # compressed; its exact blocks stay cached
    again = run(engine, prompt, max_tokens=16, mode="none")
    assert engine.num_compressed == 1
    assert again[-1].num_cached_tokens == (400 - 1) // BS * BS  # the exact prefix blocks it left behind
    assert tokens_of(again) == want
    assert len(tokens_of(squeezed)) == 16


def test_salts_stay_apart_and_a_compressed_prefill_reuses_its_own_salt(make_engine):
    engine = make_engine()
    prompt = prompt_of(320, offset=2)
    run(engine, prompt, salt="tenant-a", mode="none")
    other = run(engine, prompt, salt="tenant-b")
    same = run(engine, prompt, salt="tenant-a")
    assert other[-1].num_cached_tokens == 0
    assert same[-1].num_cached_tokens == (320 - 32) // BS * BS  # its last window is computed
    assert engine.num_compressed == 2


def test_teacher_forced_scoring_under_compression(make_engine):
    engine = make_engine()
    prompt, continuation = prompt_of(400, offset=5), prompt_of(24, offset=77)
    outs = run(engine, prompt, max_tokens=len(continuation), logprobs=0,
               constraint=ForcedTokens(continuation))
    assert tokens_of(outs) == continuation
    assert all(e.logprob <= 0 for o in outs for e in o.logprobs)


@pytest.mark.parametrize("mode", [{}, {"kv_progressive": True, "max_num_batched_tokens": 128},
                                  {"kv_layerwise": True, "max_num_batched_tokens": 128}],
                         ids=["after-prefill", "progressive", "layerwise"])
def test_many_compressed_requests_under_pressure_leak_nothing(make_engine, mode):
    engine = make_engine(kv_cache_memory_gib=0.0015, **{"max_num_batched_tokens": 256, **mode})
    kv = engine.kv_cache_manager
    prompts = [prompt_of(200 + 37 * i, offset=i) for i in range(8)]
    streams = [engine.submit(GenerationRequest(f"p{i}", p, SamplingParams(max_tokens=60, temperature=0.0,
                                                                           ignore_eos=True)))
               for i, p in enumerate(prompts)]
    results = [s.result(timeout=600) for s in streams]
    assert all(r[-1].finish_reason == "length" and len(tokens_of(r)) == 60 for r in results)
    assert engine.num_compressed >= 8
    exact_need = sum(-(-(len(p) + 60) // BS) for p in prompts)
    assert kv.num_blocks < exact_need / 2  # a real squeeze: admission waits, maybe preemption
    engine.call(kv.check_integrity)
    assert kv.num_free_blocks == kv.num_blocks


def test_short_prompts_and_bad_modes(make_engine):
    engine = make_engine()
    run(engine, prompt_of(40))
    assert engine.num_compressed == 0  # below min_tokens: stays exact
    with pytest.raises(ValueError, match="kv_compression"):
        engine.submit(GenerationRequest("bad", prompt_of(4), SamplingParams(), kv_compression="zip"))
    with pytest.raises(ValueError, match="kv_compression"):
        EngineConfig(kv_compression="zip")


def test_the_last_chunk_keeps_the_window_whatever_the_chunking_and_hits(make_engine):
    engine = make_engine(started=False, kv_window=32, max_num_batched_tokens=128)
    prompt = prompt_of(256 + 5, offset=3)  # 128-token chunks would end with a 5-token chunk
    chunks = []
    schedule = engine.scheduler.schedule

    def recording():
        work = schedule()
        chunks.extend((s.request.request_id, s.start, s.num_new_tokens) for s in work.scheduled)
        return work

    engine.scheduler.schedule = recording
    held = drive(engine, [GenerationRequest("cold", prompt, SamplingParams(max_tokens=2, temperature=0.0))])
    assert [c for c in chunks if c[0] == "cold"][:3] == [("cold", 0, 128), ("cold", 128, 101), ("cold", 229, 32)]
    again = drive(engine, [GenerationRequest("warm", prompt, SamplingParams(max_tokens=2, temperature=0.0))])
    hit = (261 - 32) // BS * BS  # the hit stops short of the last window
    assert next(c for c in chunks if c[0] == "warm") == ("warm", hit, 261 - hit)
    assert "cold" in held and "warm" in again  # both compressed


def test_selection_keeps_the_window_and_the_most_attended_tokens():
    from engine.model.pyramid import AttentionCapture, PyramidSchedule, select

    schedule = PyramidSchedule(min_retention=0.25, window=4)
    capture = AttentionCapture(window=4)
    n = 40
    for layer in range(3):
        probs = torch.zeros((1, 1, 4, n))
        probs[..., [3, 17, 20]] = torch.tensor([0.5, 0.3, 0.2])
        capture.add(layer, probs, first_row=0, num_rows=4)
    keep = select(capture, schedule, n, 3)
    assert [k.numel() for k in keep] == schedule.keep_counts(n, 3) == [40, 18, 10]  # 1.0, 0.4375, 0.25
    deepest = keep[2].tolist()
    assert {3, 17, 20} <= set(deepest) and set(range(36, 40)) <= set(deepest)
    assert deepest == sorted(deepest)
    pooled = select(capture, PyramidSchedule(0.25, 4, pool=3), n, 3)[2].tolist()
    assert {2, 3, 4, 16, 17, 18} <= set(pooled)  # neighbours of the most attended come along
    with pytest.raises(ValueError, match="min_retention"):
        PyramidSchedule(min_retention=0.0)


def test_decode_reselection_bounds_each_layer_and_gives_blocks_back(make_engine):
    engine = make_engine(started=False, kv_min_retention=0.25, kv_window=16)
    kv, sched = engine.kv_cache_manager, engine.scheduler
    n, new = 400, 120
    req = engine._validate(GenerationRequest("r1", prompt_of(n), SamplingParams(max_tokens=new, temperature=0.0,
                                                                                ignore_eos=True)))
    req.stream = OutputStream("r1", lambda _rid: None)
    sched.add(req)
    freed_at, held = [], []
    while sched.has_work():
        before = len(kv.get_block_ids("r1"))
        engine.step()
        kv.check_integrity()
        assert sched.reserved_blocks <= sched.num_blocks
        packed = req.packed
        if packed is None or req not in sched.running:
            continue
        length = req.num_computed_tokens
        targets = engine.pyramid.keep_counts(length, 6)
        assert packed.counts[0] == length  # layer 0 keeps everything
        assert all(c <= t + 16 for c, t in zip(packed.counts, targets, strict=True))
        if packed.since_selection == 0 and length > n:  # re-selected after this step
            assert packed.counts == targets
            blocks = len(kv.get_block_ids("r1"))
            if blocks < before:
                freed_at.append(length)
        held.append(len(kv.get_block_ids("r1")))
        assert held[-1] <= req.reserved
    assert engine.num_reselections >= new // 16 - 1
    assert freed_at  # blocks went back to the pool while decoding
    without = engine.pyramid.keep_counts(n, 6)  # what the prefill's selection plus every decode token needs
    assert max(held) < -(-sum(-(-(c + new) // BS) for c in without) // 6)
    assert kv.num_free_blocks == kv.num_blocks


def test_reselection_with_full_retention_decodes_like_exact(make_engine):
    engine = make_engine(kv_min_retention=1.0, kv_window=8)
    prompt = prompt_of(300, offset=6)
    exact = run(engine, prompt, mode="none", max_tokens=40, logprobs=0, salt="a")
    packed = run(engine, prompt, mode="pyramid", max_tokens=40, logprobs=0, salt="b")
    assert engine.num_compressed == 1 and engine.num_reselections >= 4  # every page repacked 4 times
    assert tokens_of(packed) == tokens_of(exact)
    a = torch.tensor([e.logprob for o in exact for e in o.logprobs])
    b = torch.tensor([e.logprob for o in packed for e in o.logprobs])
    assert torch.allclose(a, b, atol=1e-4), (a - b).abs().max()


def test_reselection_keeps_the_recent_window_and_the_most_attended():
    from types import SimpleNamespace

    from engine.model.pyramid import PyramidSchedule, reselect

    schedule = PyramidSchedule(min_retention=0.25, window=4)
    counts = [50, 30, 20]  # what the layers hold at a sequence length of 50
    scores = torch.zeros((3, 64))
    scores[2, [1, 7, 9]] = torch.tensor([3.0, 2.0, 1.0])
    keep = reselect(SimpleNamespace(counts=counts, scores=scores, num_layers=3), schedule, 50)
    targets = schedule.keep_counts(50, 3)  # [50, 22, 13]
    assert [k.numel() for k in keep] == [50, min(30, targets[1]), 13]
    assert keep[0].tolist() == list(range(50))
    deepest = keep[2].tolist()
    assert {1, 7, 9, 16, 17, 18, 19} <= set(deepest) and deepest == sorted(deepest)
    assert PyramidSchedule(0.25, 4).held_counts(40, 50, 3) == [50, 26, 17]
    assert PyramidSchedule(0.25, 4, reselect=False).held_counts(40, 50, 3) == [50, 28, 20]
    # an 8-token chunk ending at 40 starts at 32, where layer 2 kept 8: 16 < 13 + 4 decoded
    assert PyramidSchedule(0.25, 4, progressive=True, chunk=8).held_counts(40, 50, 3) == [50, 26, 17]


def test_compressed_requests_are_admitted_by_what_they_hold(make_engine):
    """A pool that fits two exact requests runs more compressed ones at once; every step
    stays within the pool's reservations and nothing leaks."""
    n, new = 480, 48
    exact_blocks = -(-(n + new) // BS)
    engine = make_engine(started=False, kv_min_retention=0.2, kv_window=16, max_num_batched_tokens=512)
    per_block = engine.layout.bytes_per_block
    engine = make_engine(started=False, kv_min_retention=0.2, kv_window=16, max_num_batched_tokens=512,
                         kv_cache_memory_gib=(2 * exact_blocks + 2) * per_block / 2**30)
    sched = engine.scheduler
    assert sched.num_blocks // exact_blocks == 2
    reqs = [GenerationRequest(f"m{i}", prompt_of(n, offset=40 * i),
                              SamplingParams(max_tokens=new, temperature=0.0, ignore_eos=True)) for i in range(6)]
    most = 0
    step = sched.schedule

    def watching():
        nonlocal most
        work = step()
        most = max(most, len(sched.running))
        assert sched.reserved_blocks <= sched.num_blocks
        return work

    sched.schedule = watching
    drive(engine, reqs)
    assert engine.num_compressed == 6 and sched.num_preemptions == 0
    assert most >= 3  # exact mode: 2


def progressive(engine, **overrides):
    from engine.model.pyramid import PyramidSchedule

    settings = {"min_retention": engine.pyramid.min_retention, "window": engine.pyramid.window,
                "progressive": True, "chunk": 48}
    settings.update(overrides)
    engine.pyramid = PyramidSchedule(**settings)
    return engine


@pytest.mark.parametrize("layerwise", [False, True], ids=["progressive", "layerwise"])
def test_progressive_prefill_with_full_retention_decodes_like_exact(make_engine, layerwise):
    engine = progressive(make_engine(kv_min_retention=1.0, kv_window=8, max_num_batched_tokens=64), min_tokens=64,
                         layerwise=layerwise)
    prompt = prompt_of(300, offset=9)
    exact = run(engine, prompt, mode="none", max_tokens=24, logprobs=0, salt="a")
    packed = run(engine, prompt, mode="pyramid", max_tokens=24, logprobs=0, salt="b")
    assert engine.num_compressed == 1 and engine.num_reselections >= 5  # chunks of 48 after the first
    assert tokens_of(packed) == tokens_of(exact)
    a = torch.tensor([e.logprob for o in exact for e in o.logprobs])
    b = torch.tensor([e.logprob for o in packed for e in o.logprobs])
    assert torch.allclose(a, b, atol=1e-4), (a - b).abs().max()


def test_progressive_prefill_never_holds_the_whole_prompt_exactly(make_engine):
    engine = progressive(make_engine(started=False, kv_min_retention=0.2, kv_window=16,
                                     max_num_batched_tokens=128))
    kv, sched = engine.kv_cache_manager, engine.scheduler
    n = 700
    req = engine._validate(GenerationRequest("g1", prompt_of(n, offset=3), SamplingParams(max_tokens=40,
                                                                                          temperature=0.0)))
    req.stream = OutputStream("g1", lambda _rid: None)
    sched.add(req)
    most, chunks = 0, []
    schedule = sched.schedule

    def recording():
        work = schedule()
        chunks.extend(s.num_new_tokens for s in work.scheduled if s.request is req and req.packed is not None)
        return work

    sched.schedule = recording
    while sched.has_work():
        engine.step()
        kv.check_integrity()
        assert sched.reserved_blocks <= sched.num_blocks
        if req in sched.running:
            most = max(most, len(kv.get_block_ids("g1")))
            assert most <= req.reserved
    assert engine.num_compressed == 1 and max(chunks) <= 48
    assert most < 0.6 * -(-n // BS)
    assert req.reserved < -(-n // BS)  # admitted by what it holds, not by its prompt
    assert kv.num_free_blocks == kv.num_blocks


def layerwise_chunks(monkeypatch):
    """Record, per layer-wise chunk after its forward, the tokens each layer computed."""
    from engine.model.packed_attention import PackedChunk

    seen = []
    advance = PackedChunk.advance

    def recording(self):
        if self.layerwise:
            seen.append(list(self.added))
        advance(self)

    monkeypatch.setattr(PackedChunk, "advance", recording)
    return seen


def test_layerwise_prefill_computes_fewer_rows_in_deeper_layers(make_engine, monkeypatch):
    """A layer's dropped chunk tokens are not computed below it: the rows per layer are
    the schedule's (the chunk's window plus about the layer's retention of the rest),
    and no layer holds more than its selection keeps."""
    seen = layerwise_chunks(monkeypatch)
    engine = progressive(make_engine(started=False, kv_min_retention=0.2, kv_window=8,
                                     max_num_batched_tokens=64), min_tokens=64, layerwise=True)
    n = 400
    req = engine._validate(GenerationRequest("lw", prompt_of(n, offset=5), SamplingParams(max_tokens=4,
                                                                                          temperature=0.0)))
    req.stream = OutputStream("lw", lambda _rid: None)
    engine.scheduler.add(req)
    while engine.scheduler.has_work():
        engine.step()
        engine.kv_cache_manager.check_integrity()
        if req.packed is not None and req.num_computed_tokens <= n:
            targets = engine.pyramid.keep_counts(req.num_computed_tokens, 6)
            assert req.packed.counts[0] == req.num_computed_tokens
            assert all(c <= t for c, t in zip(req.packed.counts, targets, strict=True))
    assert len(seen) >= 5
    for added in seen:
        assert added == engine.pyramid.chunk_rows(added[0], 6)  # what the scheduler reserved pages for
    assert all(added[-1] < added[0] / 2 for added in seen if added[0] >= 32)
    assert all(added[-1] >= 8 for added in seen)  # the window reaches the last layer
    assert len(req.kv.output_token_ids) == 4



def test_a_layerwise_request_without_a_hit_is_packed_from_admission(make_engine, monkeypatch):
    """No prefix-cache hit: a layer-wise request never holds an exact block. Its first
    chunk is computed over empty packed pages, layer-wise like the later ones (its rows
    per layer what the scheduler reserved pages for); it is counted compressed once its
    prompt is computed, and gives everything back."""
    seen = layerwise_chunks(monkeypatch)
    engine = progressive(make_engine(started=False, kv_min_retention=0.2, kv_window=8,
                                     max_num_batched_tokens=64), min_tokens=64, layerwise=True)
    kv, sched = engine.kv_cache_manager, engine.scheduler
    n = 300
    [req] = add_by_hand(engine, [GenerationRequest("fresh", prompt_of(n, offset=17),
                                                   SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))])
    engine.step()
    kv.check_integrity()
    assert req.packed is not None and req.packed_from_start and "fresh" in kv.packed
    assert seen[0] == engine.pyramid.chunk_rows(seen[0][0], 6) and seen[0][-1] < seen[0][0]
    assert req.packed.counts == engine.pyramid.keep_counts(req.num_computed_tokens, 6)
    assert engine.num_compressed == 0  # counted once its prompt is computed
    while sched.has_work():
        assert req.packed is not None and len(kv.get_block_ids("fresh")) <= req.reserved
        engine.step()
        kv.check_integrity()
    assert len(req.kv.output_token_ids) == 6 and engine.num_compressed == 1
    assert engine.compressed_tokens == n and engine.retained_tokens < n / 2
    assert kv.num_free_blocks == kv.num_blocks and not kv.packed


def test_a_layerwise_request_with_a_prefix_hit_reuses_it_then_packs(make_engine):
    """A cached exact prefix is reused: the request starts exact from its hit, its next
    chunk computed exactly selects what the packed pages keep, and it goes on packed."""
    engine = progressive(make_engine(kv_min_retention=0.2, kv_window=8, max_num_batched_tokens=64), min_tokens=64,
                         layerwise=True)
    prefix = prompt_of(160, offset=23)
    run(engine, prefix, mode="none", max_tokens=2, salt="s")
    engine.shutdown()
    kv = engine.kv_cache_manager
    [req] = add_by_hand(engine, [GenerationRequest("hit", prefix + prompt_of(140, offset=29),
                                                   SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True),
                                                   cache_salt="s", kv_compression="pyramid")])
    engine.step()
    kv.check_integrity()
    assert req.num_cached_tokens == 160 and req.packed is not None and not req.packed_from_start
    while engine.scheduler.has_work():
        engine.step()
        kv.check_integrity()
    assert len(req.kv.output_token_ids) == 4 and engine.num_compressed == 1
    assert kv.num_free_blocks == kv.num_blocks and not kv.packed


def layerwise_pair(make_engine, first, second, first_mode, budget):
    """``first`` and ``second`` admitted together into a layer-wise engine and driven to
    the end; each one's output tokens."""
    engine = progressive(make_engine(started=False, kv_min_retention=0.2, kv_window=8,
                                     max_num_batched_tokens=budget), min_tokens=64, layerwise=True)
    reqs = [GenerationRequest(f"pair-{next(_ids)}", list(first), SamplingParams(max_tokens=40, temperature=0.0),
                              kv_compression=first_mode),
            GenerationRequest(f"pair-{next(_ids)}", list(second), SamplingParams(max_tokens=12, temperature=0.0))]
    validated = add_by_hand(engine, reqs)
    while engine.scheduler.has_work():
        engine.step()
        engine.kv_cache_manager.check_integrity()
    return [list(req.kv.output_token_ids) for req in validated]


def test_layerwise_chunks_leave_their_batch_neighbours_alone(make_engine, monkeypatch):
    """Dropping a chunk's rows mid-forward changes nothing for the other rows of the
    batch, nor theirs for it: an exact request decoding beside layer-wise chunks gets
    the tokens it gets alone, and the compressed request the same tokens whichever
    exact request (same lengths, other tokens) runs beside it."""
    seen = layerwise_chunks(monkeypatch)
    packed_prompt = prompt_of(360, offset=7)
    neighbours = [prompt_of(40, offset=2), prompt_of(40, offset=3)]
    alone = make_engine(kv_compression="none")
    exact_alone = [tokens_of(run(alone, p, max_tokens=40)) for p in neighbours]
    results = [layerwise_pair(make_engine, neighbour, packed_prompt, "none", 96) for neighbour in neighbours]
    assert any(a[-1] < a[0] for a in seen)
    assert [exact for exact, _ in results] == exact_alone
    assert results[0][1] == results[1][1]


def test_two_layerwise_chunks_in_one_forward_keep_their_own_rows(make_engine, monkeypatch):
    """Two compressed requests prefilling chunk by chunk in the same forwards (a budget
    of two chunks): the second one's tokens do not depend on the first one's prompt."""
    seen = layerwise_chunks(monkeypatch)
    subject = prompt_of(330, offset=21)
    results = [layerwise_pair(make_engine, prompt_of(330, offset=k), subject, "pyramid", 96) for k in (4, 5)]
    assert any(a[-1] < a[0] for a in seen)
    assert results[0][0] != results[1][0]
    assert results[0][1] == results[1][1]


@pytest.mark.parametrize("fused", [False, True], ids=["products", "fused"])
def test_a_layerwise_chunk_computes_what_a_reference_loop_computes(make_engine, deep_model, monkeypatch, fused):
    """One layer-wise chunk against a plain loop over the transformers layers: per layer,
    the chunk's surviving tokens attend the kept K/V plus the chunk causally, the last
    ``window`` queries' attention picks what the layer keeps (the chunk about the
    layer's retention of itself, the older tokens the rest), and only the chunk's kept
    tokens go on. The K/V every layer holds afterwards are the loop's. ``fused``: the
    chunk is attended as a long one is (torch's fused attention, the capture from the
    window's queries alone)."""
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    from engine.model import packed_attention
    from engine.model.pyramid import keep_chunk

    calls = []
    if fused:
        monkeypatch.setattr(packed_attention, "SDPA_ROWS", 1)
        fused_attend = packed_attention.PackedChunk._attend_fused
        monkeypatch.setattr(packed_attention.PackedChunk, "_attend_fused",
                            lambda self, *a: calls.append(self.m) or fused_attend(self, *a))

    engine = progressive(make_engine(started=False, kv_min_retention=0.2, kv_window=8,
                                     max_num_batched_tokens=64), min_tokens=64, layerwise=True)
    n = 300
    tokens = prompt_of(n, offset=11)
    req = engine._validate(GenerationRequest("ref", tokens, SamplingParams(max_tokens=2, temperature=0.0)))
    req.stream = OutputStream("ref", lambda _rid: None)
    engine.scheduler.add(req)
    while req.packed is None or req.num_computed_tokens < 160:
        engine.step()
    packed, layers = req.packed, deep_model.model.layers
    old = [packed.read(layer, torch.arange(c)) for layer, c in enumerate(packed.counts)]
    start = req.num_computed_tokens
    engine.step()
    end = req.num_computed_tokens
    assert end - start == 48 and end < n

    schedule, window = engine.pyramid, engine.pyramid.window
    targets = schedule.keep_counts(end, len(layers))
    heads, kv_heads = deep_model.config.num_attention_heads, deep_model.config.num_key_value_heads
    d = deep_model.config.hidden_size // heads
    with torch.no_grad():
        h = deep_model.model.embed_tokens(torch.tensor(tokens[start:end]))
        cos, sin = deep_model.model.rotary_emb(h[None], torch.arange(start, end)[None])
        dropped = False
        for layer, block in enumerate(layers):
            m, c = h.shape[0], old[layer][0].shape[0]
            x = block.input_layernorm(h)
            attn = block.self_attn
            q = attn.q_proj(x).view(m, heads, d).transpose(0, 1)[None]
            k = attn.k_proj(x).view(m, kv_heads, d).transpose(0, 1)[None]
            v = attn.v_proj(x).view(m, kv_heads, d)
            q, k = apply_rotary_pos_emb(q, k, cos, sin)
            keys = torch.cat([old[layer][0], k[0].transpose(0, 1)])  # [c + m, kv_heads, d]
            values = torch.cat([old[layer][1], v])
            kk = keys.transpose(0, 1).repeat_interleave(heads // kv_heads, 0)  # [heads, c + m, d]
            scores = q[0] @ kk.transpose(1, 2) * d**-0.5  # [heads, m, c + m]
            hidden = torch.arange(c + m)[None, :] > (c + torch.arange(m))[:, None]
            probs = torch.softmax(scores.masked_fill(hidden, float("-inf")), dim=-1)
            out = probs @ values.transpose(0, 1).repeat_interleave(heads // kv_heads, 0)  # [heads, m, d]
            h = h + attn.o_proj(out.transpose(0, 1).reshape(m, heads * d))
            quota = schedule.chunk_quota(layer, end - start, len(layers))
            keep = keep_chunk(probs[:, max(0, m - window):].sum((0, 1)), c, m, targets[layer], min(m, quota),
                              schedule)
            held = packed.read(layer, torch.arange(packed.counts[layer]))
            assert packed.counts[layer] == keep.numel()
            torch.testing.assert_close(held[0], keys[keep], atol=1e-4, rtol=1e-4)
            torch.testing.assert_close(held[1], values[keep], atol=1e-4, rtol=1e-4)
            survivors = keep[keep >= c] - c
            dropped |= survivors.numel() < m
            h, cos, sin = h[survivors], cos[:, survivors], sin[:, survivors]
            h = h + block.mlp(block.post_attention_layernorm(h))
    assert dropped
    assert bool(calls) == fused
    while engine.scheduler.has_work():
        engine.step()


def test_layerwise_selection_keeps_the_chunks_quota_and_the_best_older_tokens():
    from engine.model.pyramid import PyramidSchedule, keep_chunk

    schedule = PyramidSchedule(min_retention=0.25, window=4, progressive=True, layerwise=True, chunk=40)
    assert [schedule.chunk_quota(layer, 40, 3) for layer in range(3)] == [40, 18, 10]  # 1.0, 0.4375, 0.25
    assert schedule.chunk_rows(40, 3) == [40, 40, 18]
    assert schedule.chunk_rows(6, 3) == [6, 6, 4]  # never below the window, never above the chunk
    # while prefilling, a layer holds its kept tokens plus the rows it computes of a chunk:
    # layer 1 at most the 40 of a chunk from 0; layer 2 the 4 it keeps at 4 + 16 of a 36-token chunk
    assert schedule.held_counts(40, 50, 3) == [50, 40, 20]
    scores = torch.tensor([5.0, 0.0, 9.0, 1.0, 7.0, 0.5] + [3.0, 8.0, 0.0, 0.0, 2.0, 0.0] + [0.0] * 4)
    keep = keep_chunk(scores, 6, 10, 8, 5, schedule)
    assert keep.tolist() == [0, 2, 4, 7, 12, 13, 14, 15]  # 3 best old, the chunk's best + its window
    assert keep_chunk(scores, 6, 10, 20, 5, schedule).tolist() == [0, 1, 2, 3, 4, 5, 7, 12, 13, 14, 15]
    assert keep_chunk(scores, 6, 10, 20, 10, schedule).tolist() == list(range(16))


def test_a_layerwise_request_preempted_mid_prefill_starts_again_and_leaks_nothing(make_engine):
    engine = progressive(make_engine(started=False, kv_min_retention=0.2, kv_window=8,
                                     max_num_batched_tokens=64), min_tokens=64, layerwise=True)
    kv, sched = engine.kv_cache_manager, engine.scheduler
    [req] = add_by_hand(engine, [GenerationRequest("pre", prompt_of(400, offset=13),
                                                   SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True))])
    while req.packed is None or req.num_computed_tokens < 250:
        engine.step()
    sched._preempt(req)  # what a running request finding no free block does to the newest
    kv.check_integrity()
    assert req.packed is None and req.num_computed_tokens == 0
    while sched.has_work():
        engine.step()
        kv.check_integrity()
        assert req.packed is not None or not sched.running  # packed again from its readmission
    # counted once: a request packed from admission counts when its prompt is computed
    assert len(req.kv.output_token_ids) == 10 and engine.num_compressed == 1 and req.packed_from_start
    assert kv.num_free_blocks == kv.num_blocks and not kv.packed


@pytest.mark.parametrize("layerwise", [False, True], ids=["progressive", "layerwise"])
@pytest.mark.parametrize(("retention", "window", "chunk"), [(0.2, 32, 512), (0.25, 16, 48), (0.5, 8, 128), (1.0, 4, 64)])
def test_chunk_peaks_are_the_most_any_chunk_makes_a_layer_hold(layerwise, retention, window, chunk):
    from engine.model.pyramid import PyramidSchedule

    schedule = PyramidSchedule(retention, window, progressive=True, layerwise=layerwise, chunk=chunk)
    for prefill in (window, 200, 1000, 2048, 2049):
        by_hand = [0] * 6
        for n in range(1, min(max(window, chunk), prefill) + 1):  # a chunk of n tokens starting at prefill - n
            rows = schedule.chunk_rows(n, 6) if layerwise else [n] * 6
            before = schedule.keep_counts(prefill - n, 6)
            by_hand = [max(p, b + r) for p, b, r in zip(by_hand, before, rows, strict=True)]
        assert schedule.chunk_peaks(prefill, 6) == by_hand, prefill
        # never more than the prefill's selection plus a whole chunk (the bound before)
        assert all(p <= k + max(window, chunk) for p, k in zip(by_hand, schedule.keep_counts(prefill, 6), strict=True))


@pytest.mark.parametrize("layerwise", [False, True], ids=["progressive", "layerwise"])
def test_progressive_requests_hold_no_more_than_they_reserved(make_engine, monkeypatch, layerwise):
    engine = progressive(make_engine(started=False, kv_min_retention=0.2, kv_window=8, max_num_batched_tokens=64),
                         min_tokens=64, layerwise=layerwise, chunk=64)
    kv, sched, runner = engine.kv_cache_manager, engine.scheduler, engine.runner
    reqs = add_by_hand(engine, [GenerationRequest(f"res{i}", prompt_of(500 + 90 * i, offset=7 * i),
                                                  SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
                                for i in range(3)])
    execute, seen = runner.execute, []

    def checked(inputs):  # the pages of this step's chunks are taken: the most a request holds
        for req in reqs:
            if req in sched.running and req.packed is not None:
                seen.append(len(req.packed.blocks) / req.reserved)
                assert len(kv.get_block_ids(req.request_id)) <= req.reserved
                held = engine.pyramid.held_counts(req.num_prompt_tokens, req.num_prompt_tokens + 4, 6)
                assert all(len(pages) <= -(-h // BS) for pages, h in zip(req.packed.pages, held, strict=True))
        return execute(inputs)

    monkeypatch.setattr(runner, "execute", checked)
    while sched.has_work():
        engine.step()
        kv.check_integrity()
        assert sched.reserved_blocks <= sched.num_blocks
    assert engine.num_compressed == 3
    assert max(seen) > 0.9  # the reservation is what a chunk needs, not much more
