"""KVStorage: the engine's KV cache memory, one key and one value tensor per layer.

Each tensor is laid out by the block pool: ``[num_blocks, block_size, kv_heads,
head_dim]``. Token ``p`` of a request lives in block ``block_table[p // block_size]``
at offset ``p % block_size`` (its *slot*). The KV cache manager decides which
blocks a request holds; this module only moves tensors in and out of slots.

Invariants:

* shapes and dtype never change after construction;
* a slot's contents are only meaningful while some block table holds its block
  (or while the block is cached under a hash): writers write only their own slots.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

import torch

logger = logging.getLogger(__name__)

GIB = 1024**3


@dataclass(frozen=True)
class KVLayout:
    """The shape of the KV cache: what one token costs and how blocks are cut."""

    num_layers: int
    kv_heads: int
    head_dim: int
    block_size: int
    dtype: torch.dtype

    @property
    def bytes_per_token(self) -> int:
        """Keys and values of one token across all layers."""
        elem = torch.empty((), dtype=self.dtype).element_size()
        return 2 * self.num_layers * self.kv_heads * self.head_dim * elem

    @property
    def bytes_per_block(self) -> int:
        return self.bytes_per_token * self.block_size

    def num_blocks_for(self, memory_gib: float) -> int:
        """How many blocks fit in ``memory_gib`` GiB (at least one is required)."""
        if not memory_gib > 0:
            raise ValueError(f"kv_cache_memory_gib must be > 0, got {memory_gib!r}")
        num_blocks = int(memory_gib * GIB) // self.bytes_per_block
        if num_blocks < 1:
            raise ValueError(
                f"kv_cache_memory_gib={memory_gib} holds no block of {self.bytes_per_block} bytes"
            )
        return num_blocks


class KVStorage:
    """Per-layer key/value tensors ``[num_blocks, block_size, kv_heads, head_dim]``."""

    def __init__(self, layout: KVLayout, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks!r}")
        self.layout = layout
        self.num_blocks = num_blocks
        shape = (num_blocks, layout.block_size, layout.kv_heads, layout.head_dim)
        self.keys = [torch.zeros(shape, dtype=layout.dtype) for _ in range(layout.num_layers)]
        self.values = [torch.zeros(shape, dtype=layout.dtype) for _ in range(layout.num_layers)]
        logger.info(
            "KV cache: %d blocks of %d tokens (%d tokens, %.2f GiB, %s)",
            num_blocks,
            layout.block_size,
            num_blocks * layout.block_size,
            num_blocks * layout.bytes_per_block / GIB,
            str(layout.dtype).removeprefix("torch."),
        )

    @classmethod
    def from_memory(cls, layout: KVLayout, memory_gib: float) -> KVStorage:
        return cls(layout, layout.num_blocks_for(memory_gib))

    def slot_ids(self, block_ids: Sequence[int], start: int, end: int) -> torch.Tensor:
        """Flat slot indices of token positions ``[start, end)`` for a block table."""
        bs = self.layout.block_size
        if end > len(block_ids) * bs:
            raise ValueError(f"positions up to {end} exceed {len(block_ids)} blocks of {bs}")
        pos = torch.arange(start, end)
        table = torch.tensor(block_ids, dtype=torch.long)
        return table[pos // bs] * bs + pos % bs

    def write(
        self, layer: int, slots: torch.Tensor, keys: torch.Tensor, values: torch.Tensor
    ) -> None:
        """Store ``keys``/``values`` shaped ``[kv_heads, n, head_dim]`` into ``n`` slots."""
        flat_shape = (-1, self.layout.kv_heads, self.layout.head_dim)
        self.keys[layer].view(flat_shape).index_copy_(0, slots, keys.transpose(0, 1))
        self.values[layer].view(flat_shape).index_copy_(0, slots, values.transpose(0, 1))

    def read_blocks_into(
        self, layer: int, block_ids: torch.Tensor, key_out: torch.Tensor, value_out: torch.Tensor
    ) -> None:
        """Copy whole blocks, in table order, into ``[kv_heads, n, head_dim]`` views
        (``n = len(block_ids) * block_size``; any strides whose token dimension can be
        split into blocks). One pass per tensor: the gather writes straight into the views."""
        h, nb, bs, d = self.layout.kv_heads, block_ids.numel(), self.layout.block_size, self.layout.head_dim
        for pool, out in ((self.keys[layer], key_out), (self.values[layer], value_out)):
            torch.index_select(pool.permute(2, 0, 1, 3), 1, block_ids, out=out.view(h, nb, bs, d))
