"""Random allocate/append/free/reset sequences against a simple reference model.

The reference keeps the free queue as a plain Python list and recomputes hashes
with ``hash_block_chain``; after every step both must agree on block tables, the
free queue order, hit sizes and allocation failures, and ``check_integrity()``
must pass.
"""

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from engine import KVCacheManager, Request, hash_block_chain

NUM_BLOCKS = 12
BS = 4


class ReferenceCache:
    """The rules in their most literal form: lists, dicts, linear scans."""

    def __init__(self) -> None:
        self.free: list[int] = list(range(NUM_BLOCKS))
        self.ref = [0] * NUM_BLOCKS
        self.hash: list[bytes | None] = [None] * NUM_BLOCKS
        self.tables: dict[str, list[int]] = {}
        self.slots: dict[str, int] = {}
        self.cached_count: dict[str, int] = {}

    def lookup(self, h: bytes) -> int | None:
        found = [b for b in range(NUM_BLOCKS) if self.hash[b] == h]
        return found[0] if found else None

    def hit(self, tokens: list[int], salt: str | None) -> list[int]:
        hashes = hash_block_chain(tokens, BS, cache_salt=salt)
        out: list[int] = []
        for h in hashes[: (len(tokens) - 1) // BS]:
            b = self.lookup(h)
            if b is None:
                break
            out.append(b)
        return out

    def allocate(self, rid: str, tokens: list[int], salt: str | None, new: int, hit: list[int]) -> bool:
        held = self.tables.get(rid, [])
        slots = (self.slots[rid] if held else len(hit) * BS) + new
        need = -(-slots // BS) - len(held) - len(hit)
        if need > len(self.free) - sum(1 for b in hit if self.ref[b] == 0):
            return False
        if not held:
            self.tables[rid] = held
            self.cached_count[rid] = len(hit)
            for b in hit:
                if self.ref[b] == 0:
                    self.free.remove(b)
                self.ref[b] += 1
            held.extend(hit)
        for _ in range(max(need, 0)):
            b = self.free.pop(0)
            self.hash[b] = None
            self.ref[b] = 1
            held.append(b)
        self.slots[rid] = slots
        hashes = hash_block_chain(tokens, BS, cache_salt=salt)
        full = min(slots, len(tokens)) // BS
        for i in range(self.cached_count[rid], full):
            self.hash[held[i]] = hashes[i]
        self.cached_count[rid] = max(self.cached_count[rid], full)
        return True

    def release(self, rid: str) -> None:
        blocks = self.tables.pop(rid, [])
        self.slots.pop(rid, None)
        self.cached_count.pop(rid, None)
        for b in reversed(blocks):
            self.ref[b] -= 1
        for b in reversed(blocks):
            if self.ref[b] == 0:
                self.free.append(b)

    def reset(self) -> bool:
        if any(self.ref):
            return False
        self.hash = [None] * NUM_BLOCKS
        return True


# Prompts drawn from a few shared stems so that hits, duplicates and evictions happen.
STEMS = [[1] * 8, [1] * 4 + [2] * 4, [3] * 12]
prompts = st.builds(
    lambda stem, tail: stem + tail,
    st.sampled_from(STEMS),
    st.lists(st.integers(0, 3), min_size=1, max_size=9),
)


class KVCacheMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.m = KVCacheManager(NUM_BLOCKS, BS)
        self.ref = ReferenceCache()
        self.running: dict[str, Request] = {}
        self.counter = 0

    @rule(prompt=prompts, salt=st.sampled_from([None, "s1", "s2"]))
    def add_request(self, prompt: list[int], salt: str | None) -> None:
        self.counter += 1
        req = Request(f"r{self.counter}", prompt, cache_salt=salt)
        hit, n = self.m.get_computed_blocks(req)
        ref_hit = self.ref.hit(prompt, salt)
        assert [b.block_id for b in hit] == ref_hit
        assert n == len(ref_hit) * BS
        new = self.m.allocate_slots(req, req.num_tokens - n, n, hit)
        ok = self.ref.allocate(req.request_id, prompt, salt, req.num_tokens - n, ref_hit)
        assert (new is not None) == ok
        if ok:
            self.running[req.request_id] = req

    @precondition(lambda self: self.running)
    @rule(data=st.data(), new_tokens=st.lists(st.integers(0, 3), min_size=1, max_size=6))
    def append_tokens(self, data: st.DataObject, new_tokens: list[int]) -> None:
        rid = data.draw(st.sampled_from(sorted(self.running)))
        req = self.running[rid]
        req.append_output_token_ids(new_tokens)
        new = self.m.allocate_slots(req, len(new_tokens))
        ok = self.ref.allocate(rid, req.all_token_ids, req.cache_salt, len(new_tokens), [])
        assert (new is not None) == ok
        if not ok:
            # A request that cannot grow is preempted: freed, as a scheduler would.
            self.m.free(req)
            self.ref.release(rid)
            del self.running[rid]

    @precondition(lambda self: self.running)
    @rule(data=st.data())
    def free_request(self, data: st.DataObject) -> None:
        rid = data.draw(st.sampled_from(sorted(self.running)))
        self.m.free(self.running.pop(rid))
        self.ref.release(rid)

    @rule()
    def reset(self) -> None:
        assert self.m.reset_prefix_cache() == self.ref.reset()

    @invariant()
    def agrees_with_reference(self) -> None:
        self.m.check_integrity()
        assert self.m.free_block_ids() == self.ref.free
        for rid in self.running:
            assert self.m.get_block_ids(rid) == self.ref.tables[rid]
        assert [b.ref_cnt for b in self.m.block_pool.blocks] == self.ref.ref
        assert [b.block_hash for b in self.m.block_pool.blocks] == self.ref.hash


KVCacheMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
TestKVCacheMachine = KVCacheMachine.TestCase
