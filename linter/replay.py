"""Replaying prompts through a prefix cache made of the engine's block hashes.

:class:`PrefixCacheReplay` mirrors the engine's automatic prefix caching closely
enough to estimate hit rates: every full block of ``block_size`` tokens is named
by :func:`engine.hash_block_chain` (the engine's own hash chain), a request hits
the longest run of leading blocks already cached, a hit never covers the
prompt's last token (the engine must compute at least one token), and after the
request all its full blocks are cached. With a capacity (in blocks), the least
recently used blocks are evicted, a request's tail blocks before its head
(the engine frees a finished request's blocks tail first).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from engine import hash_block_chain
from engine.contract.limits import BLOCK_SIZE

DEFAULT_BLOCK_SIZE = BLOCK_SIZE


class PrefixCacheReplay:
    """An LRU set of block hashes with hit accounting (``hit_tokens`` / ``prompt_tokens``)."""

    def __init__(self, block_size: int = DEFAULT_BLOCK_SIZE, capacity_blocks: int | None = None) -> None:
        if block_size <= 0:
            raise ValueError(f"block size must be positive, got {block_size}")
        if capacity_blocks is not None and capacity_blocks <= 0:
            raise ValueError(f"cache capacity must be a positive number of blocks, got {capacity_blocks}")
        self.block_size = block_size
        self.capacity_blocks = capacity_blocks
        self._cache: OrderedDict[bytes, None] = OrderedDict()
        self._unbounded: set[bytes] = set()  # used instead of the LRU when there is no capacity
        self.requests = 0
        self.prompt_tokens = 0
        self.hit_tokens = 0

    def hashes(self, token_ids: Sequence[int]) -> list[bytes]:
        return hash_block_chain(token_ids, self.block_size)

    def add(self, token_ids: Sequence[int]) -> int:
        """Replay one prompt; returns its cache hit in tokens."""
        return self.add_hashes(len(token_ids), self.hashes(token_ids))

    def add_hashes(self, num_tokens: int, hashes: Sequence[bytes]) -> int:
        """Replay a prompt given its token count and full-block hashes."""
        max_blocks = max(0, (num_tokens - 1) // self.block_size)
        hit_blocks = 0
        if self.capacity_blocks is None:
            seen = self._unbounded
            for h in hashes[:max_blocks]:
                if h not in seen:
                    break
                hit_blocks += 1
            seen.update(hashes)
        else:
            cache = self._cache
            for h in hashes[:max_blocks]:
                if h not in cache:
                    break
                hit_blocks += 1
            for h in reversed(hashes):
                if h in cache:
                    cache.move_to_end(h)
                else:
                    cache[h] = None
            while len(cache) > self.capacity_blocks:
                cache.popitem(last=False)
        hit = hit_blocks * self.block_size
        self.requests += 1
        self.prompt_tokens += num_tokens
        self.hit_tokens += hit
        return hit

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.prompt_tokens if self.prompt_tokens else 0.0
