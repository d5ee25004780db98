"""Worked scenarios for the KV cache manager, written from vLLM v1's prefix-caching rules.

Every scenario calls ``check_integrity()`` after every operation (via ``Harness``).
"""

import pytest

from engine import KVCacheManager, MultiModalItem, Request


class Harness:
    """A manager whose every operation is followed by ``check_integrity()``."""

    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True) -> None:
        self.m = KVCacheManager(num_blocks, block_size, enable_caching=enable_caching)
        self.m.check_integrity()

    def schedule(self, req: Request, num_new_tokens: int | None = None):
        """Prefill: look up the hit, allocate the rest. Returns (new blocks or None, hit tokens)."""
        hit, n = self.m.get_computed_blocks(req)
        self.m.check_integrity()
        todo = req.num_tokens - n if num_new_tokens is None else num_new_tokens
        new = self.m.allocate_slots(req, todo, n, hit)
        self.m.check_integrity()
        return new, n

    def append(self, req: Request, tokens: list[int]):
        req.append_output_token_ids(tokens)
        new = self.m.allocate_slots(req, len(tokens))
        self.m.check_integrity()
        return new

    def free(self, req: Request) -> None:
        self.m.free(req)
        self.m.check_integrity()

    def ids(self, req: Request) -> list[int]:
        return self.m.get_block_ids(req.request_id)

    def hit_tokens(self, req: Request) -> int:
        """Probe the cache without allocating."""
        _, n = self.m.get_computed_blocks(req)
        return n


def toks(start: int, n: int) -> list[int]:
    return list(range(start, start + n))


def test_fresh_allocation_pops_from_head_and_caches_full_blocks():
    h = Harness(10, 4)
    a = Request("a", toks(0, 10))
    new, hit = h.schedule(a)
    assert hit == 0
    assert [b.block_id for b in new] == [0, 1, 2]
    assert h.ids(a) == [0, 1, 2]
    blocks = h.m.block_pool.blocks
    assert blocks[0].block_hash == a.block_hashes[0]
    assert blocks[1].block_hash == a.block_hashes[1]
    assert blocks[2].block_hash is None  # partial block: never hashed
    assert h.m.free_block_ids() == [3, 4, 5, 6, 7, 8, 9]
    assert [b.ref_cnt for b in blocks[:4]] == [1, 1, 1, 0]


def test_last_token_is_never_covered_by_a_hit():
    h = Harness(20, 16)
    a = Request("a", toks(0, 48))
    h.schedule(a)
    h.free(a)
    b = Request("b", toks(0, 48))
    hit_blocks, n = h.m.get_computed_blocks(b)
    assert n == 32  # 2 blocks, not 3: the last token must be recomputed for logits
    assert len(hit_blocks) == 2
    c = Request("c", toks(0, 49))
    assert h.hit_tokens(c) == 48  # one more token: all three full blocks hit


def test_running_requests_share_blocks_and_ref_counts():
    h = Harness(10, 4)
    a = Request("a", toks(0, 9))
    h.schedule(a)
    b = Request("b", [*toks(0, 8), 99, 98, 97])
    new, hit = h.schedule(b)
    assert hit == 8
    assert h.ids(b)[:2] == h.ids(a)[:2]
    assert [blk.block_id for blk in new] == [3]
    assert [blk.ref_cnt for blk in h.m.block_pool.blocks[:3]] == [2, 2, 1]
    h.free(a)
    assert [blk.ref_cnt for blk in h.m.block_pool.blocks[:3]] == [1, 1, 0]
    assert h.m.free_block_ids()[-1] == 2  # only a's own block returned


def test_same_step_reuse_before_anything_is_freed():
    h = Harness(10, 4)
    a = Request("a", toks(0, 13))
    h.schedule(a)  # blocks cached at allocation time, before any KV is "computed"
    b = Request("b", toks(0, 13))
    _, hit = h.schedule(b)
    assert hit == 12


def test_freed_blocks_join_tail_in_reverse_order_and_stay_findable():
    h = Harness(8, 4)
    a = Request("a", toks(0, 12))
    h.schedule(a)
    assert h.ids(a) == [0, 1, 2]
    h.free(a)
    assert h.m.free_block_ids() == [3, 4, 5, 6, 7, 2, 1, 0]
    # Lazy eviction: the freed blocks still hold their hashes.
    b = Request("b", toks(0, 13))
    new, hit = h.schedule(b)
    assert hit == 12
    assert h.ids(b)[:3] == [0, 1, 2]
    assert [blk.block_id for blk in new] == [3]
    # Touched hit blocks were removed from the middle/tail of the queue.
    assert h.m.free_block_ids() == [4, 5, 6, 7]


def test_eviction_order_across_three_requests_with_interleaved_frees():
    h = Harness(12, 4)
    a = Request("a", toks(0, 12))  # blocks 0,1,2, all full
    b = Request("b", toks(100, 8))  # blocks 3,4
    h.schedule(a)
    h.schedule(b)
    h.free(b)  # tail: ..., 4, 3
    c = Request("c", toks(200, 8))
    h.schedule(c)  # pops 5,6 from the head
    assert h.ids(c) == [5, 6]
    h.free(a)  # tail: ..., 4, 3, 2, 1, 0
    h.free(c)  # tail: ..., 4, 3, 2, 1, 0, 6, 5
    assert h.m.free_block_ids() == [7, 8, 9, 10, 11, 4, 3, 2, 1, 0, 6, 5]

    d = Request("d", toks(300, 24))  # needs 6 blocks: 7..11 then 4
    before = h.m.stats.evictions
    h.schedule(d)
    assert h.ids(d) == [7, 8, 9, 10, 11, 4]
    assert h.m.stats.evictions - before == 1  # only block 4 held a hash
    # b's chain lost its tail first: its first block is still found.
    assert h.hit_tokens(Request("b2", toks(100, 9))) == 4
    assert h.hit_tokens(Request("a2", toks(0, 13))) == 12
    assert h.hit_tokens(Request("c2", toks(200, 9))) == 8

    e = Request("e", toks(400, 12))  # pops 3, 2, 1: b's head, then a's chain tail-first
    h.schedule(e)
    assert h.ids(e) == [3, 2, 1]
    assert h.hit_tokens(Request("b3", toks(100, 9))) == 0
    assert h.hit_tokens(Request("a3", toks(0, 13))) == 4  # block 0 survives
    assert h.hit_tokens(Request("c3", toks(200, 9))) == 8
    assert h.m.stats.evictions - before == 4


def test_not_enough_blocks_returns_none_and_changes_nothing():
    h = Harness(4, 4)
    a = Request("a", toks(0, 8))
    h.schedule(a)
    b = Request("b", toks(50, 12))
    snapshot = (
        h.m.free_block_ids(),
        [(blk.ref_cnt, blk.block_hash) for blk in h.m.block_pool.blocks],
        h.m.stats.evictions,
    )
    new, _ = h.schedule(b)
    assert new is None
    assert h.ids(b) == []
    assert snapshot == (
        h.m.free_block_ids(),
        [(blk.ref_cnt, blk.block_hash) for blk in h.m.block_pool.blocks],
        h.m.stats.evictions,
    )


def test_hit_blocks_in_free_queue_count_against_free_blocks():
    h = Harness(4, 4)
    a = Request("a", toks(0, 13))  # 4 blocks, 3 full and cached
    h.schedule(a)
    h.free(a)
    assert h.m.num_free_blocks == 4
    b = Request("b", [*toks(0, 12), *toks(500, 8)])  # hits 3 free blocks, needs 2 more
    hit, n = h.m.get_computed_blocks(b)
    assert n == 12
    # 4 free blocks, but 3 of them are the hit itself: only 1 left for 2 new blocks.
    assert h.m.allocate_slots(b, b.num_tokens - n, n, hit) is None
    h.m.check_integrity()
    assert h.m.num_free_blocks == 4
    assert all(blk.ref_cnt == 0 for blk in h.m.block_pool.blocks)
    # One block fewer needed: it fits exactly.
    c = Request("c", [*toks(0, 12), *toks(500, 4)])
    new, hit_tokens = h.schedule(c)
    assert hit_tokens == 12
    assert new is not None and len(new) == 1


def test_decode_allocates_and_caches_as_blocks_fill():
    h = Harness(10, 4)
    a = Request("a", toks(0, 6))
    h.schedule(a)
    assert h.ids(a) == [0, 1]
    assert h.m.block_pool.blocks[1].block_hash is None
    assert h.append(a, [60]) == []
    assert h.append(a, [61]) == []
    assert h.m.block_pool.blocks[1].block_hash == a.block_hashes[1]  # full now: cached
    new = h.append(a, [62])
    assert [blk.block_id for blk in new] == [2]
    # Another request with the same prompt+output prefix reuses the decoded block.
    b = Request("b", [*toks(0, 6), 60, 61, 62])
    assert h.hit_tokens(b) == 8


def test_decode_several_tokens_at_once_caches_each_full_block():
    h = Harness(10, 4)
    a = Request("a", toks(0, 3))
    h.schedule(a)
    new = h.append(a, toks(70, 10))  # 13 tokens: blocks 0..3, three full
    assert len(new) == 3
    assert [blk.block_hash for blk in h.m.block_pool.blocks[:3]] == a.block_hashes[:3]


def test_duplicate_blocks_with_the_same_hash():
    h = Harness(10, 4)
    a = Request("a", toks(0, 9))
    b = Request("b", toks(0, 9))
    hit_a, na = h.m.get_computed_blocks(a)
    hit_b, nb = h.m.get_computed_blocks(b)  # same step: nothing cached yet
    assert na == nb == 0
    h.m.allocate_slots(a, 9, na, hit_a)
    h.m.allocate_slots(b, 9, nb, hit_b)
    h.m.check_integrity()
    assert h.ids(a) == [0, 1, 2] and h.ids(b) == [3, 4, 5]
    assert set(h.m.block_pool.cached[a.block_hashes[0]]) == {0, 3}
    found = h.m.block_pool.get_cached_block(a.block_hashes[0])
    assert found is not None and found.block_id in {0, 3}
    h.free(a)
    c = Request("c", toks(0, 9))
    assert h.hit_tokens(c) == 8
    h.free(b)
    assert h.hit_tokens(c) == 8


def test_cache_salt_isolates_and_matching_salt_hits():
    h = Harness(20, 4)
    h.schedule(Request("a", toks(0, 17), cache_salt="tenant-a"))
    assert h.hit_tokens(Request("b", toks(0, 17), cache_salt="tenant-b")) == 0
    assert h.hit_tokens(Request("c", toks(0, 17))) == 0
    assert h.hit_tokens(Request("d", toks(0, 17), cache_salt="tenant-a")) == 16


def test_lora_id_isolates_every_block():
    h = Harness(20, 4)
    h.schedule(Request("a", toks(0, 17), lora_id="adapter-1"))
    assert h.hit_tokens(Request("b", toks(0, 17), lora_id="adapter-2")) == 0
    assert h.hit_tokens(Request("c", toks(0, 17))) == 0
    assert h.hit_tokens(Request("d", toks(0, 17), lora_id="adapter-1")) == 16


@pytest.mark.parametrize(("offset", "expected_hit"), [(0, 0), (3, 0), (4, 4), (9, 8), (15, 12)])
def test_image_difference_breaks_the_chain_at_its_block(offset, expected_hit):
    h = Harness(20, 4)
    prompt = toks(0, 17)
    h.schedule(Request("a", prompt, mm_items=[MultiModalItem("img-1", offset, 1)]))
    same = Request("b", prompt, mm_items=[MultiModalItem("img-1", offset, 1)])
    other = Request("c", prompt, mm_items=[MultiModalItem("img-2", offset, 1)])
    assert h.hit_tokens(same) == 16
    assert h.hit_tokens(other) == expected_hit


def test_reset_prefix_cache_refused_while_in_use():
    h = Harness(10, 4)
    a = Request("a", toks(0, 9))
    h.schedule(a)
    assert h.m.reset_prefix_cache() is False
    h.m.check_integrity()
    assert h.hit_tokens(Request("x", toks(0, 9))) == 8
    h.free(a)
    assert h.m.reset_prefix_cache() is True
    h.m.check_integrity()
    assert h.hit_tokens(Request("y", toks(0, 9))) == 0
    assert h.m.block_pool.cached == {}
    assert h.m.stats.resets == 1


def test_statistics_count_tokens_and_evictions():
    h = Harness(3, 4)
    a = Request("a", toks(0, 9))
    h.schedule(a)
    h.free(a)
    b = Request("b", toks(0, 9))
    h.schedule(b)
    h.free(b)
    s = h.m.stats
    assert (s.requests, s.queries, s.hits, s.evictions) == (2, 18, 8, 0)
    c = Request("c", toks(100, 12))  # needs all 3 blocks: evicts the 2 cached ones
    h.schedule(c)
    assert h.m.stats.evictions == 2
    assert h.m.stats.hit_rate == pytest.approx(8 / 30)


def test_caching_disabled_never_hits_nor_hashes():
    h = Harness(10, 4, enable_caching=False)
    a = Request("a", toks(0, 9))
    h.schedule(a)
    h.free(a)
    b = Request("b", toks(0, 9))
    _, hit = h.schedule(b)
    assert hit == 0
    assert all(blk.block_hash is None for blk in h.m.block_pool.blocks)
    assert h.m.stats.queries == 0


def test_free_is_idempotent_and_unknown_ids_are_ignored():
    h = Harness(5, 4)
    a = Request("a", toks(0, 5))
    h.schedule(a)
    h.free(a)
    h.free(a)
    h.m.free("never-seen")
    h.m.check_integrity()
    assert h.m.num_free_blocks == 5


def test_invalid_calls_raise_value_error():
    m = KVCacheManager(10, 4)
    a = Request("a", toks(0, 9))
    hit, _ = m.get_computed_blocks(a)
    with pytest.raises(ValueError, match="num_computed_tokens"):
        m.allocate_slots(a, 9, 4, hit)
    with pytest.raises(ValueError, match="cannot reserve"):
        m.allocate_slots(a, 10)
    with pytest.raises(ValueError, match="non-negative"):
        m.allocate_slots(a, -1)
    m.allocate_slots(a, 9)
    with pytest.raises(ValueError, match="already running"):
        m.allocate_slots(Request("a", toks(0, 3)), 3)
    with pytest.raises(ValueError, match="first allocation"):
        m.allocate_slots(a, 0, 4, m.block_pool.blocks[:1])
    m.check_integrity()
    with pytest.raises(ValueError, match="block_size"):
        KVCacheManager(10, 0)
    with pytest.raises(ValueError, match="num_blocks"):
        KVCacheManager(0, 4)


def test_check_integrity_detects_corruption():
    """The checker itself must fail on broken invariants, or every test above proves nothing."""

    def fresh():
        m = KVCacheManager(6, 4)
        a = Request("a", toks(0, 9))
        m.allocate_slots(a, 9)
        m.free(Request("b", toks(0, 1)))
        return m

    m = fresh()
    m.block_pool.blocks[0].ref_cnt += 1
    with pytest.raises(AssertionError, match="ref_cnt"):
        m.check_integrity()

    m = fresh()
    m.block_pool.blocks[4].prev_free = m.block_pool.blocks[5]
    with pytest.raises(AssertionError, match="prev_free"):
        m.check_integrity()

    m = fresh()
    m.block_pool.blocks[0].block_hash = b"x" * 32
    with pytest.raises(AssertionError, match="hash"):
        m.check_integrity()

    m = fresh()
    m.block_pool.free_queue.num_free_blocks += 1
    with pytest.raises(AssertionError, match="counter"):
        m.check_integrity()

    m = fresh()
    m.req_to_slots["a"] = 20
    with pytest.raises(AssertionError, match="slots"):
        m.check_integrity()


def test_uncache_unwritten_blocks_after_a_failed_forward():
    h = Harness(10, 4)
    a = Request("a", toks(0, 13))
    h.schedule(a)  # blocks 0..2 cached at allocation, 3 partial
    shared = Request("s", toks(0, 5))
    h.schedule(shared)  # holds block 0 too
    h.m.uncache_unwritten_blocks("a", 0)  # the forward failed before writing anything
    h.m.check_integrity()
    blocks = h.m.block_pool.blocks
    # "s" hit block 0 in the same step, so it ran in the same failed forward: unwritten too.
    assert all(blocks[i].block_hash is None for i in range(3))
    assert h.m.num_cached_blocks["s"] == 0
    h.free(a)
    h.free(shared)
    assert h.hit_tokens(Request("b", toks(0, 13))) == 0
    h.m.uncache_unwritten_blocks("gone", 0)  # unknown request: nothing to do
    h.m.check_integrity()


def test_repack_reads_before_freeing_never_holds_both_tables_and_keeps_shared_blocks():
    h = Harness(6, 4)
    a = Request("a", toks(0, 9))  # 3 blocks
    h.schedule(a)
    b = Request("b", [*toks(0, 8), 50, 51])  # shares a's 2 full blocks, 1 of its own
    h.schedule(b)
    assert h.m.num_free_blocks == 2
    # b holds 3 blocks, 2 of them shared: only 1 comes back, so 4 fresh ones do not fit
    assert h.m.repack("b", 4, lambda old: pytest.fail("read"), lambda new: pytest.fail("write")) is None
    h.m.check_integrity()
    seen = []
    new = h.m.repack("a", 3, lambda old: seen.append(("read", old, h.m.num_free_blocks)),
                     lambda new: seen.append(("write", new)))
    h.m.check_integrity()
    assert seen[0] == ("read", [0, 1, 2], 2) and seen[1] == ("write", new)
    assert "a" in h.m.packed and all(h.m.block_pool.blocks[i].block_hash is None for i in new)
    assert h.m.block_pool.blocks[0].ref_cnt == 1  # still b's, still cached
    assert h.hit_tokens(Request("c", [*toks(0, 8), 7])) == 8
    h.m.release_packed("a", new[1:])
    h.m.check_integrity()
    assert h.ids(a) == new[:1]
    with pytest.raises(ValueError, match="does not hold"):
        h.m.release_packed("a", new[1:])
    with pytest.raises(ValueError, match="not packed"):
        h.m.release_packed("b", h.ids(b))
    h.free(a)
    h.free(b)
    assert h.m.num_free_blocks == 6 and not h.m.packed


def test_lookahead_slots_are_never_cached_and_trimming_gives_them_back():
    """Speculative decoding: a decode reserves slots for its draft tokens past the
    request's tokens; only blocks its own tokens fill are cached, and trimming back to
    the accepted tokens frees the rest."""
    h = Harness(10, 4)
    a = Request("a", toks(0, 7))
    h.schedule(a, 6)  # the prompt's last token is the decode's
    assert h.m.num_slots("a") == 6
    assert h.m.num_new_blocks("a", 7) == 2 and h.m.num_new_blocks("a", 2) == 0 and h.m.num_new_blocks("b", 5) == 2
    new = h.m.allocate_slots(a, 1, lookahead=6)  # 13 slots: blocks 0..3
    h.m.check_integrity()
    assert len(new) == 2 and h.m.num_slots("a") == 13
    blocks = [h.m.block_pool.blocks[i] for i in h.ids(a)]
    assert blocks[1].block_hash is None  # positions 4..6 are the request's, 7 a draft's: not full of its own
    assert all(b.block_hash is None for b in blocks[2:])
    a.append_output_token_ids([50, 51])  # two drafts accepted (7 and 8 computed), the third rejected
    h.m.trim_slots("a", 9)
    h.m.check_integrity()
    assert h.m.num_slots("a") == 9 and h.ids(a) == [b.block_id for b in blocks[:3]]
    assert h.m.block_pool.blocks[blocks[3].block_id].ref_cnt == 0
    # the next decode caches the block the accepted tokens filled
    a.append_output_token_ids([52])
    h.m.allocate_slots(a, 1)
    h.m.check_integrity()
    assert blocks[1].block_hash == a.block_hashes[1]
    h.free(a)
    assert h.m.num_free_blocks == 10


def test_trim_slots_refuses_to_cut_cached_blocks_or_grow():
    h = Harness(10, 4)
    a = Request("a", toks(0, 9))
    h.schedule(a, 8)  # blocks 0 and 1 full and cached
    h.m.allocate_slots(a, 1, lookahead=2)
    with pytest.raises(ValueError, match="cannot trim"):
        h.m.trim_slots("a", 7)
    with pytest.raises(ValueError, match="cannot trim"):
        h.m.trim_slots("a", 12)
    with pytest.raises(ValueError, match="holds no exact slots"):
        h.m.trim_slots("nobody", 0)
    with pytest.raises(ValueError, match="lookahead"):
        h.m.allocate_slots(a, 0, lookahead=-1)
    h.m.trim_slots("a", 9)
    h.m.check_integrity()
    h.free(a)
