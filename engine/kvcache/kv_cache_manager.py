"""KVCacheManager: vLLM-v1-style automatic prefix caching over a BlockPool."""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

from engine.kvcache.block_hash import BlockHash
from engine.kvcache.block_pool import BlockPool
from engine.kvcache.kv_cache_block import KVCacheBlock
from engine.kvcache.request import Request

logger = logging.getLogger(__name__)


class BlockLoader(Protocol):
    """A tier below the pool that can fill blocks by hash (``engine.model.kv_offload``)."""

    def available(self, hashes: Sequence[BlockHash]) -> int:
        """How many leading ``hashes`` the tier holds."""
        ...

    def load(self, hashes: Sequence[BlockHash], block_ids: Sequence[int]) -> int:
        """Write the K/V of the leading ``hashes`` into ``block_ids``; returns how many
        it wrote (a prefix: it stops at the first block it cannot read)."""
        ...


@dataclass
class PrefixCacheStats:
    """Cumulative prefix-cache statistics, in tokens (queries, hits) and blocks (evictions)."""

    requests: int = 0
    queries: int = 0
    hits: int = 0
    evictions: int = 0
    resets: int = 0

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0


class KVCacheManager:
    """Allocates KV blocks to requests and reuses cached prefixes.

    Per request it keeps a block table (append-only), the number of token slots
    reserved, and how many of its leading blocks are cached. Invariants, all checked
    by :meth:`check_integrity`:

    * each block's ref count equals the number of block tables holding it, plus
      the number of prompt-module holds on it (:meth:`hold_module_blocks`);
    * a block is in the free queue if and only if its ref count is 0;
    * a request with ``s`` reserved slots holds ``ceil(s / block_size)`` blocks;
    * the first ``num_cached_blocks`` blocks of a table carry the request's block
      hashes, in order, and are in the hash map under them;
    * the hash map and the blocks' ``block_hash`` fields agree;
    * a *packed* request (a compressed one, :meth:`repack` or :meth:`start_packed`) holds blocks that carry no
      hash and no cached count; the slot rule does not apply to it (it packs its
      layers' tokens into the blocks' layer pages, :mod:`engine.model.packed_kv`).
    """

    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True) -> None:
        if not isinstance(block_size, int) or block_size <= 0:
            raise ValueError(f"block_size must be a positive int, got {block_size!r}")
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.block_pool = BlockPool(num_blocks)
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        self.req_to_slots: dict[str, int] = {}
        self.num_cached_blocks: dict[str, int] = {}
        self._requests: dict[str, Request] = {}
        self.packed: set[str] = set()
        self._stats = PrefixCacheStats()
        self.module_holds: dict[str, list[KVCacheBlock]] = {}

    # ------------------------------------------------------------------ queries
    @property
    def num_blocks(self) -> int:
        return self.block_pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.block_pool.num_free_blocks

    @property
    def usage(self) -> float:
        """Fraction of blocks held by running requests."""
        return 1.0 - self.num_free_blocks / self.num_blocks

    @property
    def stats(self) -> PrefixCacheStats:
        """A snapshot of the cumulative statistics."""
        return PrefixCacheStats(
            requests=self._stats.requests,
            queries=self._stats.queries,
            hits=self._stats.hits,
            evictions=self.block_pool.num_evictions,
            resets=self._stats.resets,
        )

    def get_block_ids(self, request_id: str) -> list[int]:
        """The request's block table as block ids (empty for an unknown request)."""
        return [b.block_id for b in self.req_to_blocks.get(request_id, ())]

    def free_block_ids(self) -> list[int]:
        """The free queue as block ids, head (next to reuse) first."""
        return [b.block_id for b in self.block_pool.free_queue.blocks()]

    def num_slots(self, request_id: str) -> int:
        """Token slots reserved for the request (0 for an unknown request)."""
        return self.req_to_slots.get(request_id, 0)

    def num_new_blocks(self, request_id: str, num_new_slots: int) -> int:
        """Blocks the request would take from the pool for ``num_new_slots`` more slots."""
        held = len(self.req_to_blocks.get(request_id, ()))
        return max(0, -(-(self.num_slots(request_id) + num_new_slots) // self.block_size) - held)

    # --------------------------------------------------------------- operations
    def get_computed_blocks(self, request: Request, count: bool = True) -> tuple[list[KVCacheBlock], int]:
        """The longest run of cached full blocks from the start of ``request``.

        Never covers the request's last token, whose logits must be computed, so a
        fully cached prompt of ``k * block_size`` tokens hits ``k - 1`` blocks.
        Returns the blocks and the number of tokens they hold. Counts one query of
        ``request.num_tokens`` tokens in the statistics unless ``count`` is false (a
        scheduler probing a request it may not admit yet counts it with
        :meth:`count_query` once it does); nothing when caching is off.
        """
        if not self.enable_caching:
            return [], 0
        request.bind_block_size(self.block_size)
        max_blocks = (request.num_tokens - 1) // self.block_size
        hits: list[KVCacheBlock] = []
        for block_hash in request.block_hashes[:max_blocks]:
            block = self.block_pool.get_cached_block(block_hash)
            if block is None:
                break
            hits.append(block)
        num_computed = len(hits) * self.block_size
        if count:
            self.count_query(request, num_computed)
        return hits, num_computed

    def load_blocks(self, request: Request, loader: BlockLoader) -> int:
        """Continue ``request``'s hash chain past its RAM hit in ``loader``'s tier: the
        blocks it holds (up to the hit rule's limit and the free blocks) are filled and
        cached, then freed, so they become ordinary cached blocks in the free queue
        (the tail, most recently used) that :meth:`get_computed_blocks` finds. Changes
        the cache; takes and drops references on the RAM hit blocks so that popping
        blocks for the load never evicts them. Returns the number of blocks loaded."""
        if not self.enable_caching:
            return 0
        hits, _ = self.get_computed_blocks(request, count=False)
        start = len(hits)
        wanted = request.block_hashes[start:(request.num_tokens - 1) // self.block_size]
        if not wanted:
            return 0
        evictable = sum(1 for b in hits if b.ref_cnt == 0)
        n = min(loader.available(wanted), self.block_pool.num_free_blocks - evictable)
        if n <= 0:
            return 0
        self.block_pool.touch(hits)
        blocks = self.block_pool.get_new_blocks(n)
        loaded = loader.load(wanted[:n], [b.block_id for b in blocks])
        for block, block_hash in zip(blocks[:loaded], wanted, strict=False):
            self.block_pool.cache_block(block, block_hash)
        self._announce(request, start, start + loaded)
        self.block_pool.free_blocks([*hits, *blocks][::-1])
        return loaded

    def count_query(self, request: Request, num_hit_tokens: int) -> None:
        """Record one prefix-cache query of ``request`` that hit ``num_hit_tokens`` tokens."""
        if not self.enable_caching:
            return
        self._stats.requests += 1
        self._stats.queries += request.num_tokens
        self._stats.hits += num_hit_tokens

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        num_computed_tokens: int = 0,
        computed_blocks: Sequence[KVCacheBlock] = (),
        lookahead: int = 0,
    ) -> list[KVCacheBlock] | None:
        """Reserve KV slots for ``num_new_tokens`` more tokens of ``request``.

        First call: ``computed_blocks``/``num_computed_tokens`` are the hit from
        :meth:`get_computed_blocks`. Later calls (decode, after appending tokens)
        pass only ``num_new_tokens``. Returns the newly allocated blocks, or None,
        changing nothing, when too few blocks are free (hit blocks still in the free
        queue count against the free blocks). Every block that is now full is cached
        at once, so other requests scheduled in the same step can reuse it.

        ``lookahead``: also reserve that many slots past the request's tokens, for
        draft tokens (speculative decoding) whose K/V the step writes before they are
        known to be right. Blocks are cached only as far as the request's own tokens
        fill them; :meth:`trim_slots` gives the lookahead back once the drafts are
        judged.
        """
        if not isinstance(num_new_tokens, int) or num_new_tokens < 0:
            raise ValueError(f"num_new_tokens must be a non-negative int, got {num_new_tokens!r}")
        rid = request.request_id
        known = self._requests.get(rid)
        if known is not None and known is not request:
            raise ValueError(f"another request with id {rid!r} is already running")
        request.bind_block_size(self.block_size)
        if rid in self.packed:
            raise ValueError(f"request {rid!r} is packed: it grows with grow_packed()")
        held = self.req_to_blocks.get(rid, [])
        if held and (computed_blocks or num_computed_tokens not in (0, self.req_to_slots[rid])):
            raise ValueError(
                f"request {rid!r} already holds blocks: pass computed blocks only on its first allocation"
            )
        if not held and num_computed_tokens != len(computed_blocks) * self.block_size:
            raise ValueError(
                f"num_computed_tokens={num_computed_tokens} does not match "
                f"{len(computed_blocks)} computed blocks of {self.block_size} tokens"
            )
        if not isinstance(lookahead, int) or lookahead < 0:
            raise ValueError(f"lookahead must be a non-negative int, got {lookahead!r}")
        slots = (self.req_to_slots[rid] if held else num_computed_tokens) + num_new_tokens
        if slots > request.num_tokens:
            raise ValueError(
                f"request {rid!r} has {request.num_tokens} tokens; cannot reserve {slots} slots"
            )
        slots += lookahead
        num_needed = -(-slots // self.block_size) - len(held) - len(computed_blocks)
        num_evictable_hits = sum(1 for b in computed_blocks if b.ref_cnt == 0)
        if num_needed > self.block_pool.num_free_blocks - num_evictable_hits:
            return None

        if not held:
            self._requests[rid] = request
            self.req_to_blocks[rid] = held
            self.num_cached_blocks[rid] = len(computed_blocks)
            self.block_pool.touch(computed_blocks)
            held.extend(computed_blocks)
        new_blocks = self.block_pool.get_new_blocks(max(num_needed, 0))
        held.extend(new_blocks)
        self.req_to_slots[rid] = slots
        if self.enable_caching:
            self._cache_full_blocks(request, slots)
        return new_blocks

    def trim_slots(self, request_id: str, num_slots: int) -> None:
        """Keep only ``num_slots`` of the request's slots (after its draft tokens were
        judged: the rejected ones' K/V are dropped) and free the blocks past them. A
        freed block was never cached: :meth:`allocate_slots` caches a block only once
        the request's own tokens fill it, and ``num_slots`` may not cut into those.
        Raises ValueError for an unknown request or a ``num_slots`` outside ``[cached
        tokens, slots held]``."""
        blocks = self.req_to_blocks.get(request_id)
        if blocks is None or request_id in self.packed:
            raise ValueError(f"request {request_id!r} holds no exact slots")
        held = self.req_to_slots[request_id]
        cached = self.num_cached_blocks[request_id] * self.block_size
        if not cached <= num_slots <= held:
            raise ValueError(f"cannot trim request {request_id!r} to {num_slots} slots: it holds {held}, "
                             f"{cached} of them in cached blocks")
        keep = -(-num_slots // self.block_size)
        freed = blocks[keep:]
        del blocks[keep:]
        self.req_to_slots[request_id] = num_slots
        if freed:
            self.block_pool.free_blocks(freed[::-1])

    def _cache_full_blocks(self, request: Request, slots: int) -> None:
        rid = request.request_id
        blocks = self.req_to_blocks[rid]
        first = self.num_cached_blocks[rid]
        num_full = min(slots, request.num_tokens) // self.block_size
        for i in range(first, num_full):
            self.block_pool.cache_block(blocks[i], request.block_hashes[i])
        self.num_cached_blocks[rid] = max(first, num_full)
        self._announce(request, first, num_full)

    def _announce(self, request: Request, first: int, end: int) -> None:
        """Tell the event sink that ``request``'s blocks ``[first, end)`` are now cached."""
        sink = self.block_pool.event_sink
        if sink is not None and end > first:
            bs = self.block_size
            sink.blocks_stored(request.block_hashes[first:end], request.block_hashes[first - 1] if first else None,
                               request.all_token_ids[first * bs:end * bs], bs, first, request.cache_salt,
                               request.lora_id, request.mm_items)

    def repack(self, request_id: str, num_blocks: int, read: Callable[[list[int]], None],
               write: Callable[[list[int]], None]) -> list[int] | None:
        """Trade a running request's block table for ``num_blocks`` fresh blocks:
        ``read(old_ids)`` (it copies out the K/V the request keeps), then the old blocks
        are freed (cached ones stay cached at ref count 0: their contents are exact and
        untouched), then the new ones are taken from the pool (possibly some of the old
        ones, evicted: so the request never holds both tables at once) and
        ``write(new_ids)`` fills them. The new blocks are never hashed. Returns the new
        ids, or None, changing nothing, when too few blocks would be free (blocks the
        request shares with others stay held by them); if ``read`` raises, nothing has
        changed; if ``write`` raises, the request holds the new blocks, packed, with
        unwritten contents (the caller must drop it)."""
        old = self.req_to_blocks.get(request_id)
        if old is None or request_id in self.packed:
            raise ValueError(f"request {request_id!r} holds no exact block table")
        if num_blocks > self.block_pool.num_free_blocks + sum(1 for b in old if b.ref_cnt == 1):
            return None
        read([b.block_id for b in old])
        self.block_pool.free_blocks(old[::-1])
        new = self.block_pool.get_new_blocks(num_blocks)
        self.req_to_blocks[request_id] = new
        self.num_cached_blocks[request_id] = 0
        self.packed.add(request_id)
        new_ids = [b.block_id for b in new]
        write(new_ids)
        return new_ids

    def start_packed(self, request_id: str) -> None:
        """Register a request that holds nothing yet as packed from its first token (a
        layer-wise compressed prefill with no prefix-cache hit): it holds no block until
        :meth:`grow_packed`."""
        if request_id in self.req_to_blocks:
            raise ValueError(f"request {request_id!r} already holds blocks")
        self.req_to_blocks[request_id] = []
        self.num_cached_blocks[request_id] = 0
        self.packed.add(request_id)

    def release_packed(self, request_id: str, block_ids: Sequence[int]) -> None:
        """Give blocks of a packed request back to the pool (its pages in them hold
        nothing any more: :meth:`engine.model.packed_kv.PackedKV.reselect`)."""
        if request_id not in self.packed:
            raise ValueError(f"request {request_id!r} is not packed")
        held = self.req_to_blocks[request_id]
        ids = set(block_ids)
        dropped = [b for b in held if b.block_id in ids]
        if len(dropped) != len(ids):
            raise ValueError(f"request {request_id!r} does not hold blocks {sorted(ids - {b.block_id for b in held})}")
        self.req_to_blocks[request_id] = [b for b in held if b.block_id not in ids]
        self.block_pool.free_blocks(dropped[::-1])

    def grow_packed(self, request_id: str, num_blocks: int) -> list[int] | None:
        """``num_blocks`` more fresh blocks for a packed request; None, changing nothing,
        when too few are free."""
        if request_id not in self.packed:
            raise ValueError(f"request {request_id!r} is not packed")
        if num_blocks > self.block_pool.num_free_blocks:
            return None
        new = self.block_pool.get_new_blocks(num_blocks)
        self.req_to_blocks[request_id].extend(new)
        return [b.block_id for b in new]

    def free(self, request: Request | str) -> None:
        """Release the request's blocks; those reaching ref count 0 join the free queue's
        tail in reverse block-table order, so a chain's tail is evicted before its head.
        Freeing an unknown (or already freed) request does nothing."""
        rid = request if isinstance(request, str) else request.request_id
        blocks = self.req_to_blocks.pop(rid, None)
        self.req_to_slots.pop(rid, None)
        self.num_cached_blocks.pop(rid, None)
        self._requests.pop(rid, None)
        self.packed.discard(rid)
        if blocks:
            self.block_pool.free_blocks(blocks[::-1])

    def hold_module_blocks(self, owner: str, hits: Sequence[KVCacheBlock], num_new: int) -> list[KVCacheBlock] | None:
        """Reference prompt-module blocks for ``owner`` (a request id): the cached
        ``hits`` and ``num_new`` fresh blocks, returned (None, changing nothing, when
        too few blocks are free). Held until :meth:`release_module_blocks`. Changes
        the free queue, not the hash map (the caller caches a module's blocks once
        their K/V are written)."""
        if num_new > self.block_pool.num_free_blocks - sum(1 for b in hits if b.ref_cnt == 0):
            return None
        self.block_pool.touch(hits)
        new = self.block_pool.get_new_blocks(num_new)
        self.module_holds.setdefault(owner, []).extend([*hits, *new])
        return new

    def release_module_blocks(self, owner: str) -> None:
        """Drop ``owner``'s module references; blocks reaching ref 0 join the free
        queue's tail (cached ones stay findable until evicted, LRU like any block).
        A fresh block never cached is forgotten at once (nothing to find). Idempotent."""
        blocks = self.module_holds.pop(owner, None)
        if blocks:
            self.block_pool.free_blocks(blocks[::-1])

    def uncache_unwritten_blocks(self, request_id: str, num_written_tokens: int) -> None:
        """After a failed forward: forget the hashes of the request's blocks past its
        first ``num_written_tokens // block_size``, whose K/V were never written, so
        no later request can hit garbage. Such a block is forgotten even when another
        request holds it: that request hit it in the same step, so it ran in the same
        failed forward (its cached-block count shrinks accordingly). The blocks stay
        in the tables."""
        blocks = self.req_to_blocks.get(request_id)
        if blocks is None:
            return
        keep = num_written_tokens // self.block_size
        dropped = [b for b in blocks[keep:] if b.block_hash is not None]
        for block in dropped:
            self.block_pool.uncache(block)
        self.num_cached_blocks[request_id] = min(self.num_cached_blocks[request_id], keep)
        if not dropped:
            return
        for rid, table in self.req_to_blocks.items():
            cached = self.num_cached_blocks[rid]
            first = next((i for i, b in enumerate(table[:cached]) if b in dropped), None)
            if first is not None:
                self.num_cached_blocks[rid] = first

    def reset_prefix_cache(self) -> bool:
        """Forget all cached prefixes. Refused (returns False) while any block is in use."""
        if not self.block_pool.reset_prefix_cache():
            logger.warning(
                "prefix cache reset refused: %d blocks in use",
                self.num_blocks - self.num_free_blocks,
            )
            return False
        self._stats.resets += 1
        return True

    # ---------------------------------------------------------------- integrity
    def check_integrity(self) -> None:
        """Verify every invariant; raises AssertionError naming the first one broken."""

        def fail(msg: str) -> None:
            raise AssertionError(f"KV cache integrity: {msg}")

        pool = self.block_pool
        queue = pool.free_queue
        # Free queue links, walked both ways.
        forward: list[KVCacheBlock] = []
        seen: set[int] = set()
        cur = queue.head.next_free
        prev = queue.head
        while cur is not queue.tail:
            if cur is None:
                fail("free queue broken: a link is None")
                return
            if cur.prev_free is not prev:
                fail(f"{cur}.prev_free does not point back")
            if cur.block_id in seen:
                fail(f"{cur} appears twice in the free queue")
            seen.add(cur.block_id)
            forward.append(cur)
            prev, cur = cur, cur.next_free
        if queue.tail.prev_free is not prev:
            fail("tail.prev_free is not the last free block")
        if len(forward) != queue.num_free_blocks:
            fail(f"free queue holds {len(forward)} blocks, counter says {queue.num_free_blocks}")
        # Ref counts against block tables.
        refs = [0] * pool.num_blocks

        def count(holder: str, blocks: list[KVCacheBlock]) -> None:
            ids = [b.block_id for b in blocks]
            if len(set(ids)) != len(ids):
                fail(f"{holder} holds a block twice: {ids}")
            for b in blocks:
                refs[b.block_id] += 1

        for rid, blocks in self.req_to_blocks.items():
            count(f"request {rid!r}", blocks)
            if rid in self.packed:
                if self.num_cached_blocks[rid] or any(b.block_hash is not None for b in blocks):
                    fail(f"packed request {rid!r} holds a hashed block")
                continue
            expected = -(-self.req_to_slots[rid] // self.block_size)
            if len(blocks) != expected:
                fail(f"request {rid!r} holds {len(blocks)} blocks for {self.req_to_slots[rid]} slots")
            req = self._requests[rid]
            n_cached = self.num_cached_blocks[rid]
            if n_cached > len(blocks):
                fail(f"request {rid!r} has {n_cached} cached blocks of {len(blocks)}")
            if self.enable_caching:
                for i in range(n_cached):
                    if blocks[i].block_hash != req.block_hashes[i]:
                        fail(f"request {rid!r} block {i} ({blocks[i]}) lost its hash")
        for owner, held in self.module_holds.items():
            count(f"module holder {owner!r}", held)
        for block in pool.blocks:
            if block.ref_cnt != refs[block.block_id]:
                fail(f"{block} ref_cnt != {refs[block.block_id]} block-table references")
            in_queue = block.block_id in seen
            if in_queue != (block.ref_cnt == 0):
                fail(f"{block} is {'in' if in_queue else 'not in'} the free queue")
            if not in_queue and (block.prev_free is not None or block.next_free is not None):
                fail(f"{block} has free-queue links but is not in the queue")
            if block.block_hash is not None:
                if pool.cached.get(block.block_hash, {}).get(block.block_id) is not block:
                    fail(f"{block} has a hash missing from the hash map")
                if not self.enable_caching:
                    fail(f"{block} has a hash with caching disabled")
        if not self.packed <= set(self.req_to_blocks):
            fail(f"packed requests {self.packed - set(self.req_to_blocks)} hold no blocks")
        for h, same in pool.cached.items():
            if not same:
                fail("empty entry in the hash map")
            for bid, block in same.items():
                if block.block_id != bid or block.block_hash != h:
                    fail(f"hash map entry for {block} disagrees with the block")
