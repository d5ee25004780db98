"""The assembly plan's pure functions: which positions a segmented request computes."""

from __future__ import annotations

import pytest

from engine.core.assembly import (
    Assembly,
    assembly_key,
    blend_candidates,
    exact_head_tokens,
    plan_runs,
)
from engine.promptcache.segments import Recovery, Segment, SegmentedPrompt


def prompt(recovery: Recovery, head: int = 4) -> SegmentedPrompt:
    segs = [Segment(tuple(range(1, head + 1)))] if head else []
    segs += [Segment(tuple(range(100, 110)), "a"), Segment(tuple(range(200, 210)), "b"), Segment((7, 8, 9))]
    return SegmentedPrompt(tuple(segs), recovery)


@pytest.mark.parametrize(("recovery", "runs"), [
    (Recovery("none"), [(0, 4), (24, 27)]),
    (Recovery("epic", first_tokens=2), [(0, 6), (14, 16), (24, 27)]),
    (Recovery("epic", first_tokens=2, last_tokens=3), [(0, 6), (11, 16), (21, 27)]),
    (Recovery("epic", first_tokens=0, last_tokens=20), [(0, 27)]),
])
def test_plan_runs_computes_plain_segments_and_the_recovery_tokens(recovery, runs):
    sp = prompt(recovery)
    assert plan_runs(sp, 0, len(sp.token_ids)) == runs
    assert plan_runs(sp, 16, len(sp.token_ids)) == [(max(s, 16), e) for s, e in runs if e > 16]


def test_last_tokens_is_another_assembly_and_must_be_non_negative():
    assert assembly_key(prompt(Recovery("epic", last_tokens=4))) != assembly_key(prompt(Recovery("epic")))
    with pytest.raises(ValueError, match="last_tokens"):
        Recovery("epic", last_tokens=-1)


def test_exact_head_is_everything_before_the_first_module():
    assert exact_head_tokens(prompt(Recovery("none"))) == 4
    assert exact_head_tokens(prompt(Recovery("none"), head=0)) == 0
    plain = SegmentedPrompt((Segment((1, 2)), Segment((3,))))
    assert exact_head_tokens(plain) == 3


def test_cacheblend_chooses_among_the_module_tokens_after_the_probe():
    sp = prompt(Recovery("cacheblend", fraction=0.2))
    runs = plan_runs(sp, 0, len(sp.token_ids))
    assert runs == [(0, 4), (24, 27)]  # its recovery tokens are not known before the probe
    candidates, starts, budget = blend_candidates(sp, 0, runs)
    assert candidates == list(range(4, 24)) and starts == [4] * 10 + [14] * 10 and budget == 4
    assert blend_candidates(sp, 16, plan_runs(sp, 16, 27)) == (list(range(16, 24)), [14] * 8, 2)
    assert blend_candidates(prompt(Recovery("epic")), 0, runs) == ([], [], 0)
    asm = Assembly([], runs, 0, 20, candidates=candidates, module_starts=starts, budget=budget)
    assert asm.active and asm.num_pending == 4 + 3 + 4 and asm.probe_span == (0, 24)
    deviation = [(0.0, 0.0)] * 24
    for p, d in {7: 5.0, 20: 9.0, 21: 1.0, 9: 3.0, 2: 99.0}.items():  # 2: not a candidate
        deviation[p] = (d, d)
    asm.select(deviation, 0)
    assert asm.runs == [(0, 4), (7, 8), (9, 10), (20, 22), (24, 27)] and asm.budget == 0
    fallback = Assembly([], list(runs), 0, 20, candidates=candidates, module_starts=starts, budget=budget)
    fallback.select(None, 0)  # no probe: the tokens that missed most of their context
    assert fallback.runs == [(0, 5), (14, 17), (24, 27)]


@pytest.mark.parametrize("chunk", [1, 5, 10, 24, 100])
def test_a_probe_in_chunks_selects_what_one_probe_selects(chunk):
    sp = prompt(Recovery("cacheblend", fraction=0.2))
    runs = plan_runs(sp, 0, len(sp.token_ids))
    candidates, starts, budget = blend_candidates(sp, 0, runs)
    deviation = [(float((p * 7) % 11), float((p * 5) % 13)) for p in range(24)]
    whole = Assembly([], list(runs), 0, 20, candidates=candidates, module_starts=starts, budget=budget)
    whole.add_probe(0, deviation, 0)
    chunked = Assembly([], list(runs), 0, 20, candidates=candidates, module_starts=starts, budget=budget)
    while chunked.budget:
        start, end = chunked.next_probe(chunk)
        assert start == chunked.probed and end == min(24, start + chunk)
        chunked.add_probe(start, deviation[start:end], 0)
    assert chunked.runs == whole.runs and whole.budget == 0 and chunked.deviation == []
    assert len(whole.runs) > len(runs)  # the selection added recovery tokens


def test_a_probe_chunk_must_continue_where_the_last_ended():
    sp = prompt(Recovery("cacheblend", fraction=0.2))
    runs = plan_runs(sp, 0, len(sp.token_ids))
    candidates, starts, budget = blend_candidates(sp, 0, runs)
    asm = Assembly([], runs, 0, 20, candidates=candidates, module_starts=starts, budget=budget)
    asm.add_probe(0, [(1.0, 1.0)] * 8, 0)
    assert asm.next_probe(0) == (8, 9) and asm.budget == budget  # at least one position; nothing chosen yet
    with pytest.raises(ValueError, match="probe chunk at 4, expected 8"):
        asm.add_probe(4, [(1.0, 1.0)] * 4, 0)
    asm.add_probe(8, None, 0)  # no probe can run: chosen at once by the missed context
    assert asm.budget == 0
