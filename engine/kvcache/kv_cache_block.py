"""One block of the KV cache pool: an id, a ref count, a hash, and free-queue links."""

from __future__ import annotations

from engine.kvcache.block_hash import BlockHash


class KVCacheBlock:
    """A fixed-size slot range of the KV cache.

    ``ref_cnt`` counts the running requests whose block table holds this block.
    ``block_hash`` is set once the block is full and cached, and cleared when the
    block is evicted (popped from the free queue for reuse). ``prev_free`` and
    ``next_free`` are the links of the intrusive free queue: both are None while
    the block is not in the queue.
    """

    __slots__ = ("block_hash", "block_id", "next_free", "prev_free", "ref_cnt")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: BlockHash | None = None
        self.prev_free: KVCacheBlock | None = None
        self.next_free: KVCacheBlock | None = None

    def __repr__(self) -> str:
        h = self.block_hash.hex()[:8] if self.block_hash is not None else None
        return f"KVCacheBlock(id={self.block_id}, ref_cnt={self.ref_cnt}, hash={h})"
