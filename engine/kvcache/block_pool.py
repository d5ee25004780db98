"""BlockPool: every KV block, the free queue, and the map from block hash to cached blocks."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Protocol

from engine.kvcache.block_hash import BlockHash, MultiModalItem
from engine.kvcache.free_block_queue import FreeBlockQueue
from engine.kvcache.kv_cache_block import KVCacheBlock


class BlockEventSink(Protocol):
    """Told what the pool caches, evicts and clears (``engine.server.kv_event_publisher``).
    ``medium`` is ``"GPU"`` for the block pool (vLLM's name for the device tier) and
    ``"DISK"`` for the disk tier (:mod:`engine.kvcache.disk_store`)."""

    def blocks_stored(self, hashes: Sequence[BlockHash], parent: BlockHash | None, token_ids: Sequence[int],
                      block_size: int, first_block: int, cache_salt: str | None, lora_id: str | int | None,
                      mm_items: Sequence[MultiModalItem], medium: str = "GPU") -> None: ...

    def block_removed(self, block_hash: BlockHash, medium: str = "GPU") -> None: ...

    def all_cleared(self) -> None: ...


class BlockPool:
    """All ``num_blocks`` blocks, created once at start-up.

    Invariants (checked by ``KVCacheManager.check_integrity``):

    * a block is in the free queue if and only if its ref count is 0;
    * ``cached[h]`` holds exactly the blocks whose ``block_hash == h``; several
      blocks may share a hash (block tables are append-only, so a request that
      computed a block another request cached in the same step keeps its own);
    * eviction is lazy: a freed block keeps its hash, and stays findable, until
      it is popped from the free queue for reuse.
    """

    def __init__(self, num_blocks: int) -> None:
        if not isinstance(num_blocks, int) or num_blocks <= 0:
            raise ValueError(f"num_blocks must be a positive int, got {num_blocks!r}")
        self.num_blocks = num_blocks
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self.free_queue = FreeBlockQueue(self.blocks)
        self.cached: dict[BlockHash, dict[int, KVCacheBlock]] = {}
        self.num_evictions = 0
        self.event_sink: BlockEventSink | None = None

    @property
    def num_free_blocks(self) -> int:
        return self.free_queue.num_free_blocks

    def get_cached_block(self, block_hash: BlockHash) -> KVCacheBlock | None:
        """One block cached under ``block_hash``, or None."""
        found = self.cached.get(block_hash)
        if not found:
            return None
        return next(iter(found.values()))

    def cache_block(self, block: KVCacheBlock, block_hash: BlockHash) -> None:
        """Record a full block under its hash."""
        assert block.block_hash is None, f"{block} is already cached"
        block.block_hash = block_hash
        self.cached.setdefault(block_hash, {})[block.block_id] = block

    def get_new_blocks(self, n: int) -> list[KVCacheBlock]:
        """Pop ``n`` blocks from the head of the free queue, evicting their old hashes."""
        blocks = self.free_queue.popleft_n(n)
        for block in blocks:
            assert block.ref_cnt == 0
            self._evict(block)
            block.ref_cnt = 1
        return blocks

    def uncache(self, block: KVCacheBlock) -> None:
        """Forget ``block``'s hash now (its contents are not to be reused); counts as an eviction."""
        self._evict(block)

    def _evict(self, block: KVCacheBlock) -> None:
        h = block.block_hash
        if h is None:
            return
        same = self.cached[h]
        del same[block.block_id]
        if not same:
            del self.cached[h]
        block.block_hash = None
        self.num_evictions += 1
        if self.event_sink is not None:
            self.event_sink.block_removed(h)

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Take a reference on hit blocks, pulling free ones out of the free queue."""
        for block in blocks:
            if block.ref_cnt == 0:
                self.free_queue.remove(block)
            block.ref_cnt += 1

    def free_blocks(self, ordered: Sequence[KVCacheBlock]) -> None:
        """Drop one reference on each block; those reaching 0 join the tail in this order."""
        for block in ordered:
            assert block.ref_cnt > 0, f"{block} freed more often than referenced"
            block.ref_cnt -= 1
        for block in ordered:
            if block.ref_cnt == 0:
                self.free_queue.append(block)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash; refused (False) while any block is in use."""
        if self.num_free_blocks != self.num_blocks:
            return False
        for block in self.blocks:
            block.block_hash = None
        self.cached.clear()
        if self.event_sink is not None:
            self.event_sink.all_cleared()
        return True
