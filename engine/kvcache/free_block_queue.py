"""The free queue: an intrusive doubly-linked list of blocks in eviction order.

The head is the next block to reuse (least recently freed); freed blocks go to the
tail. Every operation is O(1): the links live in the blocks themselves and two
sentinel blocks bound the list, so there is no deque and no ``list.remove``.
"""

from __future__ import annotations

from collections.abc import Iterable

from engine.kvcache.kv_cache_block import KVCacheBlock


class FreeBlockQueue:
    """Blocks with ref count 0, head first.

    Invariants: ``head.next_free`` ... ``tail.prev_free`` walk the same blocks in
    opposite directions; ``num_free_blocks`` is their count; a block is in the queue
    exactly when its ``prev_free`` and ``next_free`` are not None.
    """

    def __init__(self, blocks: Iterable[KVCacheBlock]) -> None:
        self.head = KVCacheBlock(-1)
        self.tail = KVCacheBlock(-1)
        self.head.next_free = self.tail
        self.tail.prev_free = self.head
        self.num_free_blocks = 0
        for block in blocks:
            self.append(block)

    def popleft(self) -> KVCacheBlock:
        """Remove and return the head block; ValueError when empty."""
        first = self.head.next_free
        assert first is not None
        if first is self.tail:
            raise ValueError("no free blocks")
        self.remove(first)
        return first

    def popleft_n(self, n: int) -> list[KVCacheBlock]:
        """Remove and return the first ``n`` blocks, head first."""
        if n > self.num_free_blocks:
            raise ValueError(f"asked for {n} blocks, {self.num_free_blocks} free")
        return [self.popleft() for _ in range(n)]

    def remove(self, block: KVCacheBlock) -> None:
        """Unlink ``block`` from anywhere in the queue."""
        prev, nxt = block.prev_free, block.next_free
        if prev is None or nxt is None:
            raise ValueError(f"{block} is not in the free queue")
        prev.next_free = nxt
        nxt.prev_free = prev
        block.prev_free = block.next_free = None
        self.num_free_blocks -= 1

    def append(self, block: KVCacheBlock) -> None:
        """Put ``block`` at the tail (evicted last)."""
        if block.prev_free is not None or block.next_free is not None:
            raise ValueError(f"{block} is already in the free queue")
        last = self.tail.prev_free
        assert last is not None
        last.next_free = block
        block.prev_free = last
        block.next_free = self.tail
        self.tail.prev_free = block
        self.num_free_blocks += 1

    def blocks(self) -> list[KVCacheBlock]:
        """All free blocks, head first."""
        out: list[KVCacheBlock] = []
        cur = self.head.next_free
        while cur is not None and cur is not self.tail:
            out.append(cur)
            cur = cur.next_free
        return out
