"""The block-hash replay behind the hit-rate estimate, on explicit token lists."""

import pytest

from engine import hash_block_chain
from linter.replay import PrefixCacheReplay


def test_uses_the_engines_block_hash_chain():
    ids = list(range(50))
    assert PrefixCacheReplay(16).hashes(ids) == hash_block_chain(ids, 16)


def test_hits_full_shared_blocks_only():
    replay = PrefixCacheReplay(16)
    assert replay.add(list(range(40))) == 0
    # Shares 20 tokens: one full block.
    assert replay.add([*range(20), *range(100, 120)]) == 16
    # Shares all 40 tokens: two full blocks; the partial third block is never cached.
    assert replay.add(list(range(41))) == 32
    assert (replay.hit_tokens, replay.prompt_tokens, replay.requests) == (48, 121, 3)
    assert replay.hit_rate == 48 / 121


def test_never_covers_the_last_token():
    replay = PrefixCacheReplay(16)
    replay.add(list(range(32)))
    assert replay.add(list(range(32))) == 16


def test_a_changed_first_token_loses_everything():
    replay = PrefixCacheReplay(16)
    replay.add(list(range(64)))
    assert replay.add([999, *range(1, 64)]) == 0


def test_lru_capacity_evicts_tail_blocks_first():
    replay = PrefixCacheReplay(16, capacity_blocks=3)
    a = list(range(33))
    b = list(range(1000, 1033))
    replay.add(a)
    replay.add(b)  # 4 blocks for 3 slots: a's tail block goes first
    assert replay.add(a) == 16


def test_lru_capacity_touching_keeps_hot_prefix():
    replay = PrefixCacheReplay(16, capacity_blocks=2)
    shared = list(range(16))
    replay.add([*shared, *range(100, 117)])
    replay.add([*shared, *range(200, 217)])
    assert replay.add([*shared, 5]) == 16


@pytest.mark.parametrize("kwargs", [{"block_size": 0}, {"capacity_blocks": 0}])
def test_rejects_bad_sizes(kwargs):
    with pytest.raises(ValueError):
        PrefixCacheReplay(**kwargs)


def test_prompt_hash_reuse_equals_the_full_chain():
    from pathlib import Path

    from linter.corpus import load_file
    from linter.estimate import Prompts
    from linter.render import render
    from linter.tokenizer import ApproxTokenizer

    records = load_file(Path(__file__).resolve().parents[2] / "examples" / "requests.jsonl", [])
    tokenizer = ApproxTokenizer()
    prompts = Prompts(tokenizer, 16)
    for record in records * 2:
        rendered = render(record.body)
        count, hashes = prompts.of_rendered(rendered)
        ids = tokenizer.encode(rendered.text)
        assert count == len(ids)
        assert hashes == hash_block_chain(ids, 16)
