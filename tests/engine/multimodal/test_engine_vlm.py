"""Tiny random LLaVA and Idefics3 served by the engine: exactness against transformers'
``generate``, prefix reuse over image blocks, the encoder cache, batching, cancellation."""

from __future__ import annotations

import itertools

import pytest
import torch
from vlm_samples import ARCHS, image_message, picture

from engine.contract.chat import ChatRenderer
from engine.core.llm_engine import GenerationRequest, SamplingParams

_ids = itertools.count()


def render(engine, messages):
    return ChatRenderer(engine.tokenizer, image_processor=engine.image_processor).render(messages)


def request(prompt, *, salt=None, max_tokens=8):
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    return GenerationRequest(f"vlm-{next(_ids)}", list(prompt.token_ids), params, cache_salt=salt,
                             mm_items=prompt.mm_items, mm_inputs=prompt.mm_inputs)


def run(engine, prompt, **kwargs):
    outputs = engine.submit(request(prompt, **kwargs)).result(timeout=120)
    assert outputs[-1].error is None, outputs[-1].error
    return [t for o in outputs for t in o.new_token_ids], outputs[-1].num_cached_tokens


def hf_generate(engine, prompt, max_tokens=8):
    """transformers' own greedy generate over the same token ids and pixels."""
    (image,) = prompt.mm_inputs
    ids = torch.tensor([prompt.token_ids])
    with torch.inference_mode():
        out = engine.model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), **image.pixels,
                                    max_new_tokens=max_tokens, do_sample=False)
    return out[0, ids.shape[1]:].tolist()


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_output_equals_transformers_generate_cached_uncached_and_chunked(make_vlm_engine, arch, dtype):
    cached = make_vlm_engine(arch, dtype=dtype)
    plain = make_vlm_engine(arch, dtype=dtype, enable_prefix_caching=False)
    chunked = make_vlm_engine(arch, dtype=dtype, enable_prefix_caching=False, max_num_batched_tokens=7)
    prompt = render(cached, image_message(picture(1)))
    (item,) = prompt.mm_items
    assert item.length > 7  # the chunked engine splits the image over several steps
    expected = hf_generate(cached, prompt)
    first, hit = run(cached, prompt)
    again, hit_again = run(cached, prompt)
    assert hit == 0 and hit_again > item.offset
    assert first == again == run(plain, prompt)[0] == run(chunked, prompt)[0] == expected
    other = render(cached, image_message(picture(2)))
    assert run(plain, other)[0] == hf_generate(cached, other) != expected  # the model sees the image


@pytest.mark.parametrize("arch", ARCHS)
def test_same_image_reuses_its_blocks_another_image_reuses_none_it_overlaps(make_vlm_engine, arch):
    bs = 4
    engine = make_vlm_engine(arch, block_size=bs)
    cache = engine.embedder.cache
    first = render(engine, image_message(picture(1)))
    (item,) = first.mm_items
    run(engine, first)
    assert (cache.misses, cache.hits) == (1, 0)

    _, hit = run(engine, render(engine, image_message(picture(1), fmt="WEBP")))  # same pixels, lossless WebP
    full = (len(first.token_ids) - 1) // bs * bs
    assert hit == full >= item.end  # every block holding the image is reused...
    assert (cache.misses, cache.hits) == (1, 0)  # ...so the vision tower is not even asked

    other = render(engine, image_message(picture(2)))
    assert other.token_ids == first.token_ids and other.mm_items[0].identifier != item.identifier
    _, hit_other = run(engine, other)
    assert hit_other == item.offset // bs * bs  # nothing from the first block the image touches
    assert cache.misses == 2

    _, hit_salted = run(engine, first, salt="tenant-b")
    assert hit_salted == 0 and cache.misses == 3  # the salt isolates blocks and features


@pytest.mark.parametrize("arch", ARCHS)
def test_a_step_mixing_image_and_text_requests_gives_the_one_at_a_time_outputs(make_vlm_engine, arch):
    solo_engine = make_vlm_engine(arch, enable_prefix_caching=False)
    prompts = [
        render(solo_engine, image_message(picture(3))),
        render(solo_engine, [{"role": "user", "content": "A question without any picture at all."}]),
        render(solo_engine, image_message(picture(4), "Describe it.")),
        render(solo_engine, [{"role": "user", "content": "Hi"}]),
    ]
    solo = [run(solo_engine, p)[0] for p in prompts]
    engine = make_vlm_engine(arch, enable_prefix_caching=False, start=False)
    streams = [engine.submit(request(p)) for p in prompts]
    engine.start()  # all four reach the scheduler in one inbox: one step prefills them all
    together = [s.result(timeout=120) for s in streams]
    assert [[t for o in outs for t in o.new_token_ids] for outs in together] == solo


def test_a_request_cancelled_mid_image_leaks_nothing_and_a_retry_is_exact(make_vlm_engine):
    reference = make_vlm_engine("idefics3", enable_prefix_caching=False)
    engine = make_vlm_engine("idefics3", block_size=4, max_num_batched_tokens=8, start=False)
    prompt = render(engine, image_message(picture(5)))
    (item,) = prompt.mm_items
    req = request(prompt)
    stream = engine.submit(req)
    for queued in engine._inbox:  # drive the loop by hand: one 8-token chunk, inside the image
        engine.scheduler.add(queued)
    engine._inbox.clear()
    while engine.scheduler.running == [] or engine.scheduler.running[0].num_computed_tokens <= item.offset:
        engine.step()
    assert engine.scheduler.running[0].num_computed_tokens < item.end
    engine.abort(req.request_id)
    engine.start()
    assert stream.result(timeout=120)[-1].finish_reason == "abort"
    assert engine.embedder.cache.misses == 1
    tokens, hit = run(engine, prompt)  # reuses the blocks the cancelled request had filled
    assert hit > item.offset
    assert tokens == run(reference, prompt)[0]


def test_the_encoder_cache_is_bounded_and_least_recently_used():
    from engine.multimodal.encoder_cache import EncoderCache

    cache = EncoderCache(max_bytes=3 * 64)  # three 4x4 float32 entries
    calls = []

    def compute(value):
        return lambda: calls.append(value) or torch.full((4, 4), float(value))

    for key in "abc":
        cache.get_or_compute((None, key), compute(ord(key)))
    assert cache.get_or_compute((None, "a"), compute(0))[0, 0] == ord("a")  # a hit moves "a" last
    cache.get_or_compute((None, "d"), compute(ord("d")))  # evicts "b", the least recently used
    assert (None, "b") not in cache and (None, "a") in cache and len(cache) == 3 and cache.bytes == 192
    assert (cache.hits, cache.misses, cache.evictions) == (1, 4, 1)
    huge = cache.get_or_compute((None, "huge"), lambda: torch.zeros(100, 100))
    assert huge.shape == (100, 100) and (None, "huge") not in cache and cache.bytes <= cache.max_bytes
    assert cache.get_or_compute(("salt", "a"), compute(1))[0, 0] == 1  # another salt, another entry
    assert calls == [ord("a"), ord("b"), ord("c"), ord("d"), 1]


def test_preempted_image_requests_recompute_the_same_tokens(make_vlm_engine):
    # 12 blocks of 16 tokens: two image requests growing to 9-10 blocks each cannot both fit.
    engine = make_vlm_engine("idefics3", kv_cache_memory_gib=12 * 16 * 512 / 1024**3, start=False)
    assert engine.kv_cache_manager.num_blocks == 12
    engine.scheduler.reserve_horizon = 8  # admit both, then run out of blocks while decoding
    prompts = [render(engine, image_message(picture(6))), render(engine, image_message(picture(7)))]
    engine.start()

    def params():
        return SamplingParams(max_tokens=100, temperature=0.0, ignore_eos=True)

    def submit(prompt, rid):
        return engine.submit(GenerationRequest(rid, list(prompt.token_ids), params(),
                                               mm_items=prompt.mm_items, mm_inputs=prompt.mm_inputs))

    solo = [[t for o in submit(p, f"solo-{i}").result(timeout=120) for t in o.new_token_ids]
            for i, p in enumerate(prompts)]
    streams = [submit(p, f"both-{i}") for i, p in enumerate(prompts)]
    both = [[t for o in s.result(timeout=120) for t in o.new_token_ids] for s in streams]
    assert engine.stats().num_preemptions >= 1
    assert both == solo


def test_images_the_processor_cannot_place_are_400s_naming_the_part(make_vlm_engine):
    from engine.contract.errors import APIError

    engine = make_vlm_engine("llava", start=False)
    bad = [{"role": "user", "content": [{"type": "text", "text": "look"},
                                        {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]}]
    with pytest.raises(APIError) as info:
        render(engine, bad)
    assert info.value.status_code == 400 and info.value.param == "messages[0].content[1].image_url"
    typed = image_message(picture(1), "a placeholder typed as text: <image>")
    with pytest.raises(APIError) as info:
        render(engine, typed)
    assert info.value.status_code == 400 and info.value.param == "messages"
    prompt = render(engine, image_message(picture(1)))
    smuggled = GenerationRequest("smuggled", list(prompt.token_ids), SamplingParams(max_tokens=1))
    with pytest.raises(ValueError, match="image tokens"):
        engine.submit(smuggled)  # image token ids without their images (e.g. /v1/completions ids)


def test_idefics3_placeholder_count_follows_the_image_size_and_stays_exact(make_vlm_engine):
    engine = make_vlm_engine("idefics3", enable_prefix_caching=False)
    square = render(engine, image_message(picture(8, (32, 32))))
    wide = render(engine, image_message(picture(8, (64, 16))))
    assert wide.mm_items[0].length != square.mm_items[0].length  # tiles: 2x2 + global vs 1x2 + global
    for prompt in (square, wide):
        assert prompt.mm_inputs[0].positions.numel() == prompt.mm_inputs[0].pixels["pixel_values"].shape[1] * 4
        assert run(engine, prompt)[0] == hf_generate(engine, prompt)
