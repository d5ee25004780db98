"""prefixgate's local inference engine.

Three subpackages, one dependency direction (``server -> core -> model``, and
all of them -> ``kvcache``):

* :mod:`engine.kvcache` — the pure-Python prefix-cache bookkeeping (block hashes,
  block pool, free queue, KV cache manager, the KV view of a request). No torch.
* :mod:`engine.model` — torch execution of one forward: loading, the model's
  forward, attention, the block-laid-out KV storage and the model runner.
* :mod:`engine.core` — the engine loop: requests, the scheduler, sampling,
  detokenizing, and the :class:`~engine.core.llm_engine.LLMEngine` API.
* :mod:`engine.server` — the OpenAI-compatible HTTP server on top of ``LLMEngine``.

Importing ``engine`` pulls in only :mod:`engine.kvcache`: the linter and the gateway
use the hash chain without torch. ``engine.model_store`` (converted checkpoints on
disk), ``engine.config`` and ``engine.cli`` are torch-free too.
"""

from engine.kvcache import (
    ROOT_BLOCK_HASH,
    BlockHash,
    BlockPool,
    FreeBlockQueue,
    KVCacheBlock,
    KVCacheManager,
    MultiModalItem,
    PrefixCacheStats,
    Request,
    hash_block_chain,
    hash_block_tokens,
)

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
