"""KVStorage: the engine's KV cache memory, a key and a value tensor per layer (views of one).

Laid out by block for paged attention: per layer, keys and values are stored as
``[kv_heads, num_blocks + 1, block_size, head_dim]``. Token ``p`` of a request lives
in block ``block_table[p // block_size]`` at offset ``p % block_size`` (its *slot*).
Gathering a block table with one ``index_select`` copies whole blocks (a block of
one head is ``block_size * head_dim`` contiguous elements) and yields a sequence's
keys and values as ``[kv_heads, tokens, head_dim]``, contiguous; attention reads
the keys as ``K^T`` through a transposed view, which the CPU matrix product takes
without a copy. (Keys stored transposed, ``[kv_heads, head_dim, blocks,
block_size]``, made the gather copy ``block_size``-element pieces: 6x slower for a
2k-token table, and the product with a contiguous ``K^T`` was slower too.)

The extra block at index :attr:`KVStorage.pad_block` is never handed out by the
KV cache manager: block tables are padded with it up to the attention's key
padding (see :mod:`engine.model.attention`), and the padding rows of a batch
write their K/V into it. Its contents are finite and always masked.

Invariants:

* shapes and dtype never change after construction;
* a slot's contents are only meaningful while some block table holds its block
  (or while the block is cached under a hash): writers write only their own slots;
* every element is finite (zeros at start; only computed K/V are written).
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
    """Per-layer keys and values ``[kv_heads, blocks, block_size, head_dim]``;
    ``blocks = num_blocks + 1`` (the pad block)."""

    def __init__(self, layout: KVLayout, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks!r}")
        self.layout = layout
        self.num_blocks = num_blocks
        self.pad_block = num_blocks
        h, d, bs = layout.kv_heads, layout.head_dim, layout.block_size
        total = num_blocks + 1
        shape = (layout.num_layers, h, total, bs, d)
        self.all_keys = torch.zeros(shape, dtype=layout.dtype)
        self.all_values = torch.zeros(shape, dtype=layout.dtype)
        """Every layer's keys/values in one tensor, so that a *layer page* (layer ``l``'s
        part of block ``b``, ``block_size`` tokens of every head) is addressable whatever
        the layer reading it: a compressed request packs several layers' tokens into the
        pages of the blocks it holds (:mod:`engine.model.packed_kv`)."""
        self.keys = list(self.all_keys.unbind(0))  # per layer, contiguous views
        self.values = list(self.all_values.unbind(0))
        self._scratch = (torch.empty((0, d), dtype=layout.dtype), torch.empty((0, d), dtype=layout.dtype))
        logger.info(
            "KV cache: %d blocks of %d tokens (%d tokens, %.2f GiB, %s)",
            num_blocks,
            bs,
            num_blocks * bs,
            num_blocks * layout.bytes_per_block / GIB,
            str(layout.dtype).removeprefix("torch."),
        )

    @classmethod
    def from_memory(cls, layout: KVLayout, memory_gib: float) -> KVStorage:
        return cls(layout, layout.num_blocks_for(memory_gib))

    @property
    def pad_slot(self) -> int:
        """The slot padding rows of a batch write to (in the pad block)."""
        return self.pad_block * self.layout.block_size

    def slot_ids(self, block_ids: Sequence[int], start: int, end: int) -> list[int]:
        """Flat slot indices of token positions ``[start, end)`` for a block table."""
        bs = self.layout.block_size
        if end > len(block_ids) * bs:
            raise ValueError(f"positions up to {end} exceed {len(block_ids)} blocks of {bs}")
        return [block_ids[p // bs] * bs + p % bs for p in range(start, end)]

    def scratch(self, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Two ``[rows, head_dim]`` buffers (keys, values) for a copy between steps (the
        loop thread's only: the next call may hand out the same memory). Kept and grown,
        not allocated per copy: a fresh ~10 MB tensor each re-selection cost ~7 ms of page
        faults, ten times the gather itself (8 compressed requests at 2k tokens)."""
        if self._scratch[0].shape[0] < rows:
            grown = max(rows, 2 * self._scratch[0].shape[0])
            d, dtype = self.layout.head_dim, self.layout.dtype
            self._scratch = (torch.empty((grown, d), dtype=dtype), torch.empty((grown, d), dtype=dtype))
        return self._scratch[0][:rows], self._scratch[1][:rows]

    def write(self, layer: int, slots: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Store ``keys``/``values`` shaped ``[n, kv_heads, head_dim]`` into ``n`` slots."""
        h, d = self.layout.kv_heads, self.layout.head_dim
        self.keys[layer].view(h, -1, d).index_copy_(1, slots, keys.transpose(0, 1))
        self.values[layer].view(h, -1, d).index_copy_(1, slots, values.transpose(0, 1))

    def read(self, layer: int, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The keys/values stored in ``slots``, each ``[n, kv_heads, head_dim]`` (a copy;
        :meth:`write`'s inverse). Changes nothing."""
        h, d = self.layout.kv_heads, self.layout.head_dim
        keys = self.keys[layer].view(h, -1, d).index_select(1, slots).transpose(0, 1)
        values = self.values[layer].view(h, -1, d).index_select(1, slots).transpose(0, 1)
        return keys, values

    def copy_blocks(self, block_ids: Sequence[int]) -> torch.Tensor:
        """A copy of the blocks' keys and values, ``[n, layers, 2, kv_heads, block_size,
        head_dim]``, contiguous: block ``i`` is ``out[i]``, the disk tier's payload layout
        (:mod:`engine.model.kv_offload`). Reads the cache, changes nothing."""
        lay = self.layout
        ids = torch.as_tensor(block_ids, dtype=torch.long)
        out = torch.empty((len(ids), lay.num_layers, 2, lay.kv_heads, lay.block_size, lay.head_dim), dtype=lay.dtype)
        for layer in range(lay.num_layers):
            out[:, layer, 0].copy_(self.keys[layer].index_select(1, ids).transpose(0, 1))
            out[:, layer, 1].copy_(self.values[layer].index_select(1, ids).transpose(0, 1))
        return out

    def load_blocks(self, block_ids: Sequence[int], blocks: torch.Tensor) -> None:
        """Write ``blocks`` shaped as :meth:`copy_blocks` returns into ``block_ids``."""
        ids = torch.as_tensor(block_ids, dtype=torch.long)
        for layer in range(self.layout.num_layers):
            self.keys[layer].index_copy_(1, ids, blocks[:, layer, 0].transpose(0, 1))
            self.values[layer].index_copy_(1, ids, blocks[:, layer, 1].transpose(0, 1))

    def rows(self, block_table: Sequence[int] | torch.Tensor) -> torch.Tensor:
        """A block table's blocks as row indices of the flat ``[kv_heads * blocks,
        block_size, head_dim]`` view of a layer, head-major: what :meth:`gather` takes.
        The same for every layer, so a forward computes it once per sequence."""
        table = torch.as_tensor(block_table, dtype=torch.long)
        heads = torch.arange(self.layout.kv_heads, dtype=torch.long)[:, None] * (self.num_blocks + 1)
        return (heads + table[None, :]).reshape(-1)

    def gather(self, layer: int, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The keys and values of a block table given as :meth:`rows`, each ``[kv_heads,
        n, head_dim]``, contiguous (``n = len(block_table) * block_size``). One gather of
        whole rows along the first dimension: a copy, ~40% faster than selecting blocks
        along the second dimension of ``[kv_heads, blocks, ...]``."""
        h, d, bs = self.layout.kv_heads, self.layout.head_dim, self.layout.block_size
        keys = torch.index_select(self.keys[layer].view(-1, bs, d), 0, rows).view(h, -1, d)
        values = torch.index_select(self.values[layer].view(-1, bs, d), 0, rows).view(h, -1, d)
        return keys, values
