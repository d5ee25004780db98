"""SamplingParams validation, the sampler, and the stop-string-aware detokenizer."""

from __future__ import annotations

import pytest
import torch

from engine.core.detokenizer import Detokenizer
from engine.core.sampler import make_generator, sample
from engine.core.sampling_params import SamplingParams


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("max_tokens", 0),
        ("max_tokens", 1.5),
        ("temperature", -0.1),
        ("temperature", "hot"),
        ("top_p", 0.0),
        ("top_p", 1.5),
        ("top_k", 0),
        ("seed", 1.0),
        ("stop", ["x"]),
        ("stop", ("",)),
        ("stop_token_ids", (-1,)),
    ],
)
def test_bad_sampling_params_name_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})


def logits_of(values):
    return torch.tensor(values, dtype=torch.float32)


def test_greedy_takes_the_argmax():
    params = SamplingParams(temperature=0.0)
    assert sample(logits_of([0.1, 3.0, 2.9, -1.0]), params, make_generator(params, 0)) == 1


def test_top_k_one_and_tiny_top_p_behave_like_greedy():
    logits = logits_of([0.5, 1.0, 4.0, 3.9, -2.0])
    for params in (SamplingParams(temperature=5.0, top_k=1), SamplingParams(temperature=5.0, top_p=1e-6)):
        gen = make_generator(params, 7)
        assert {sample(logits, params, gen) for _ in range(50)} == {2}


def test_top_p_keeps_the_smallest_set_reaching_p():
    # probabilities 0.5, 0.3, 0.2: top_p=0.6 keeps the first two only.
    logits = torch.log(logits_of([0.5, 0.3, 0.2]))
    params = SamplingParams(temperature=1.0, top_p=0.6, seed=3)
    gen = make_generator(params, 0)
    seen = {sample(logits, params, gen) for _ in range(300)}
    assert seen == {0, 1}


def test_top_k_limits_the_candidates():
    logits = logits_of([1.0, 1.1, 1.2, 1.3, 1.4])
    params = SamplingParams(temperature=1.0, top_k=2)
    gen = make_generator(params, 0)
    assert {sample(logits, params, gen) for _ in range(300)} == {3, 4}


def test_a_seed_reproduces_the_draws_whatever_the_fallback():
    logits = torch.randn(1000, generator=torch.Generator().manual_seed(0))
    params = SamplingParams(temperature=1.0, seed=42)
    a = [sample(logits, params, g) for g in [make_generator(params, 1)] for _ in range(20)]
    b = [sample(logits, params, g) for g in [make_generator(params, 2)] for _ in range(20)]
    assert a == b
    unseeded = SamplingParams(temperature=1.0)
    c = [sample(logits, unseeded, g) for g in [make_generator(unseeded, 1)] for _ in range(20)]
    d = [sample(logits, unseeded, g) for g in [make_generator(unseeded, 2)] for _ in range(20)]
    assert c != d


def detokenize(tokenizer, text, **params):
    """Feed ``text``'s tokens one by one; returns the deltas and the finish reason."""
    detok = Detokenizer(tokenizer, SamplingParams(**params), eos_token_ids={tokenizer.eos_token_id})
    deltas, reason = [], None
    for token in tokenizer.encode(text, add_special_tokens=False):
        reason = detok.add(token)
        deltas.append(detok.take_new_text(reason is not None))
        if reason:
            break
    if reason is None:
        deltas.append(detok.take_new_text(True))
    return deltas, reason


def test_stop_string_is_cut_and_never_streamed(bundled_tokenizer):
    deltas, reason = detokenize(bundled_tokenizer, "Hello world. END of story", stop=("END",))
    assert reason == "stop"
    assert "".join(deltas) == "Hello world. "
    assert all("E" not in d for d in deltas)


def test_text_that_may_start_a_stop_string_is_held_back(bundled_tokenizer):
    tok = bundled_tokenizer
    detok = Detokenizer(tok, SamplingParams(stop=("STOP HERE",)), eos_token_ids=set())
    streamed = ""
    for token in tok.encode("go STOP now", add_special_tokens=False):
        detok.add(token)
        streamed += detok.take_new_text(False)
        assert not streamed.endswith("STOP")  # "STOP" could begin "STOP HERE"
    streamed += detok.take_new_text(True)
    assert streamed == "go STOP now"


def test_full_text_without_stops_round_trips(bundled_tokenizer):
    text = "Caf\u00e9 \u2603 snowmen, \U0001f600 emoji and plain words."
    deltas, reason = detokenize(bundled_tokenizer, text)
    assert reason is None
    assert "".join(deltas) == text
    assert all("\ufffd" not in d for d in deltas)


def test_stop_token_ids_and_eos_stop(bundled_tokenizer):
    tok = bundled_tokenizer
    detok = Detokenizer(tok, SamplingParams(stop_token_ids=(42,)), eos_token_ids={tok.eos_token_id})
    assert detok.add(42) == "stop"
    detok = Detokenizer(tok, SamplingParams(), eos_token_ids={tok.eos_token_id})
    assert detok.add(tok.eos_token_id) == "stop"
    detok = Detokenizer(tok, SamplingParams(ignore_eos=True), eos_token_ids={tok.eos_token_id})
    assert detok.add(tok.eos_token_id) is None


@pytest.mark.parametrize("temperature", [1e-320, 1e-300, 1e-45, 1e-6])
def test_temperatures_too_small_to_divide_by_are_greedy(temperature):
    """Below 1e-5 sampling is greedy (as in vLLM); dividing by 1e-45 would give inf logits."""
    logits = torch.tensor([1.0, 30.0, 29.0, -5.0])
    params = SamplingParams(temperature=temperature, seed=3)
    assert params.greedy
    assert all(sample(logits, params, make_generator(params, 0)) == 1 for _ in range(5))
    assert not SamplingParams(temperature=1e-5).greedy
    assert sample(logits, SamplingParams(temperature=1e-5), make_generator(SamplingParams(), 0)) == 1


def _streamed(tokenizer, token_ids, finish=True):
    detok = Detokenizer(tokenizer, SamplingParams(ignore_eos=True), eos_token_ids=set())
    deltas = []
    for token in token_ids:
        detok.add(token)
        deltas.append(detok.take_new_text(False))
    if finish:
        deltas.append(detok.take_new_text(True))
    return deltas, detok


def test_windowed_decoding_streams_exactly_the_whole_decode(bundled_tokenizer):
    """Random token sequences (multi-byte pieces, special tokens, ids that decode to
    partial UTF-8) stream, delta by delta, exactly what one whole decode gives, and
    nothing streamed before the end holds an incomplete character."""
    import random

    tok = bundled_tokenizer
    rng = random.Random(7)
    text = "Caf\u00e9 \u2603 \U0001f600\U0001f680 \u4e2d\u6587 na\u00efve  spaces\tand\nlines"
    pieces = tok.encode(text, add_special_tokens=False)
    specials = sorted(set(tok.all_special_ids))
    for trial in range(60):
        ids = []
        while len(ids) < rng.randrange(1, 120):
            kind = rng.random()
            if kind < 0.5:
                start = rng.randrange(len(pieces))
                ids.extend(pieces[start : start + rng.randrange(1, 6)])
            elif kind < 0.9:
                ids.append(rng.randrange(len(tok)))
            else:
                ids.append(rng.choice(specials))
        deltas, detok = _streamed(tok, ids)
        whole = tok.decode(ids, skip_special_tokens=True)
        assert "".join(deltas) == whole, (trial, ids)
        assert detok.text == whole
        assert all(not d.endswith("\ufffd") for d in deltas[:-1]) or "\ufffd" in whole


def test_an_incomplete_character_is_flushed_once_at_the_end(bundled_tokenizer):
    tok = bundled_tokenizer
    ids = tok.encode("ok \U0001f600", add_special_tokens=False)
    # byte-level pieces of the emoji: every prefix but the full one ends incomplete
    deltas, detok = _streamed(tok, ids[:-1])
    assert "".join(deltas) == tok.decode(ids[:-1])
    assert deltas[-1].endswith("\ufffd")
    assert detok.take_new_text(True) == ""  # a second flush adds nothing


def test_a_tokenizer_that_cleans_up_spaces_is_decoded_whole(bundled_tokenizer):
    import copy

    tok = copy.deepcopy(bundled_tokenizer)
    tok.clean_up_tokenization_spaces = True
    ids = tok.encode("Hello , world . Do n't stop !", add_special_tokens=False)
    deltas, _ = _streamed(tok, ids)
    assert "".join(deltas) == tok.decode(ids, skip_special_tokens=True)
