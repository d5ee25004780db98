"""prefixgate's local inference engine.

Importing ``engine`` pulls in only the pure-Python prefix-cache bookkeeping (block
hashing, the block pool and the KV cache manager): the linter and the gateway use
it without torch. The torch-based runner and server live in submodules that are
imported explicitly.
"""

from engine.block_hash import (
    ROOT_BLOCK_HASH,
    BlockHash,
    MultiModalItem,
    hash_block_chain,
    hash_block_tokens,
)
from engine.block_pool import BlockPool
from engine.free_block_queue import FreeBlockQueue
from engine.kv_cache_block import KVCacheBlock
from engine.kv_cache_manager import KVCacheManager, PrefixCacheStats
from engine.request import Request

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
