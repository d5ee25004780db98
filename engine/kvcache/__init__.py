"""Pure-Python KV-cache bookkeeping: which blocks hold which tokens, and which are cached.

Nothing here touches tensors (a test imports this package and checks that torch
was not imported): :mod:`~engine.kvcache.block_hash` names blocks by SHA256 hash
chains, :mod:`~engine.kvcache.block_pool` owns every block, its free queue and the
hash map, :mod:`~engine.kvcache.kv_cache_manager` hands blocks to requests, and
:mod:`~engine.kvcache.request` is a request as the manager sees it, and
:mod:`~engine.kvcache.disk_store` keeps full blocks as files (the disk tier).
"""

from engine.kvcache.block_hash import (
    ROOT_BLOCK_HASH,
    BlockHash,
    MultiModalItem,
    hash_block_chain,
    hash_block_tokens,
)
from engine.kvcache.block_pool import BlockPool
from engine.kvcache.free_block_queue import FreeBlockQueue
from engine.kvcache.kv_cache_block import KVCacheBlock
from engine.kvcache.kv_cache_manager import KVCacheManager, PrefixCacheStats
from engine.kvcache.request import Request

__all__ = [
    "ROOT_BLOCK_HASH",
    "BlockHash",
    "BlockPool",
    "FreeBlockQueue",
    "KVCacheBlock",
    "KVCacheManager",
    "MultiModalItem",
    "PrefixCacheStats",
    "Request",
    "hash_block_chain",
    "hash_block_tokens",
]
