"""NgramDraft: prompt-lookup drafts (speculative decoding)."""

from __future__ import annotations

import random

import pytest

from engine.core.ngram_draft import NgramDraft


def scan(tokens, k, max_n=3, min_n=2):
    """The definition, by brute force: the tokens after the latest earlier occurrence
    of the longest suffix of max_n .. min_n tokens, looked up again after them while
    fewer than k."""
    end = len(tokens)
    draft = []
    while len(draft) < k:
        text = tokens + draft
        found = None
        for n in range(min(max_n, len(text)), min_n - 1, -1):
            suffix = text[len(text) - n :]
            # occurrences ending before the real tokens' end
            for start in range(end - n - 1, -1, -1):
                if tokens[start : start + n] == suffix:
                    found = start + n
                    break
            if found is not None:
                break
        if found is None:
            break
        draft += tokens[found : found + k - len(draft)]
    return draft


def test_the_longest_suffix_wins_and_its_latest_occurrence():
    d = NgramDraft(max_n=3, min_n=1)
    #        0  1  2  3  4  5  6  7  8  9 10
    tokens = [1, 2, 3, 9, 2, 3, 8, 7, 1, 2, 3]
    # [1, 2, 3] occurred at 0 (followed by 9, 2); [2, 3] last at 4 (followed by 8): three tokens win
    assert d.propose(tokens, 2) == [9, 2]
    assert NgramDraft(max_n=2, min_n=1).propose(tokens, 2) == [8, 7]


def test_no_repeat_no_draft_and_k_caps_it():
    d = NgramDraft()
    assert d.propose([5, 6, 7, 8], 4) == []
    assert d.propose([5, 6, 7, 8, 5, 6], 1) == [7]
    assert d.propose([5, 6, 7, 8, 5, 6, 7], 0) == []


def test_a_loop_drafts_its_own_continuation():
    d = NgramDraft()
    tokens = [4, 1, 2, 1, 2, 1, 2]
    # [2, 1, 2] last occurred at 2..4: only [1, 2] follow it, then the lookup goes on
    assert d.propose(tokens, 5) == [1, 2, 1, 2, 1]


@pytest.mark.parametrize("seed", range(5))
def test_incremental_lookups_equal_the_brute_force_scan(seed):
    rng = random.Random(seed)
    tokens = [rng.randrange(6) for _ in range(20)]
    d = NgramDraft(max_n=4, min_n=1)
    for _ in range(60):
        k = rng.randrange(1, 6)
        assert d.propose(tokens, k) == scan(tokens, k, 4, 1)
        tokens.extend(rng.randrange(6) for _ in range(rng.randrange(1, 4)))


def test_bad_sizes_and_shrinking_tokens_are_value_errors():
    with pytest.raises(ValueError, match="min_n"):
        NgramDraft(max_n=1, min_n=2)
    with pytest.raises(ValueError, match="min_n"):
        NgramDraft(max_n=3, min_n=0)
    d = NgramDraft()
    d.propose([1, 2, 3, 1, 2], 2)
    with pytest.raises(ValueError, match="shrank"):
        d.propose([1, 2], 2)


def test_the_draft_length_grows_when_kept_and_shrinks_when_cut():
    d = NgramDraft()
    tokens = [1, 2, 3, 4, 5, 6, 7, 8, 1, 2]
    assert d.propose(tokens, 6) == [3, 4, 5, 6, 7, 8]  # no draft judged yet: up to k
    d.record(6, 2)
    assert d.length == 5 and len(d.propose(tokens, 8)) == 5
    d.record(5, 5)
    assert d.length == 7
    d.record(1, 0)
    assert d.length == 1
    d.record(0, 0)  # nothing drafted: nothing learnt
    assert d.length == 1 and d.propose(tokens, 8) == [3]
    with pytest.raises(ValueError, match="kept 3 of 2"):
        d.record(2, 3)
