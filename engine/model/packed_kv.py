"""PackedKV: one compressed request's K/V, packed into layer pages of the blocks it holds.

A block id of the pool spans every layer: block ``b`` is ``num_layers`` *layer pages*
``(l, b)``, each ``block_size`` token slots of every KV head in layer ``l``'s tensor
(:attr:`~engine.model.kv_storage.KVStorage.all_keys` makes any of them addressable).
An exact request uses page ``(l, b)`` for layer ``l``. A compressed request keeps
fewer tokens in deeper layers (:mod:`engine.model.pyramid`), so it holds only
``ceil(sum of its layers' pages / num_layers)`` whole blocks from the pool and puts
layer ``l``'s tokens into any page of them: per layer, a *page table* of global page
ids ``g = l' * (num_blocks + 1) + b`` (page ``(l', b)``). The pool's accounting is
unchanged (whole blocks, ref counts); the packing is this request's business.

Invariants:

* layer ``l`` holds ``counts[l]`` tokens in ``pages[l]``, in order: token ``i`` in
  page ``pages[l][i // block_size]`` at offset ``i % block_size``; ``len(pages[l]) ==
  ceil(counts[l] / block_size)`` after :meth:`fill` (a full layer gets a page only
  when its next token needs it);
* every page of every held block is in exactly one layer's table or in ``spare``;
* these pages are never hashed, shared or read by another request (the blocks are
  fresh from the pool and the KV cache manager never caches them);
* ``scores[l, i]`` is the attention the decode queries since the last selection paid
  to layer ``l``'s token ``i`` (summed over heads; ``since_selection`` queries), for
  re-selection (:meth:`reselect`, :func:`engine.model.pyramid.reselect`).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

from engine.model.kv_storage import KVStorage


class PackedKV:
    """The page tables of one compressed request (see the module docstring)."""

    def __init__(self, storage: KVStorage, counts: Sequence[int]) -> None:
        """Empty tables for layers that will hold ``counts[l]`` tokens (no block yet)."""
        self.storage = storage
        self.stride = storage.num_blocks + 1
        self.block_size = storage.layout.block_size
        self.num_layers = storage.layout.num_layers
        if len(counts) != self.num_layers:
            raise ValueError(f"{len(counts)} layer counts for {self.num_layers} layers")
        self.counts = list(counts)
        self.pages: list[list[int]] = [[] for _ in counts]
        self.spare: list[int] = []
        self.blocks: list[int] = []
        self.table = torch.full((self.num_layers, 0), storage.pad_block, dtype=torch.long)
        """``pages`` as a tensor ``[layers, capacity]``, padded with the pad block's page."""
        self.scores = torch.zeros((self.num_layers, 0))
        self.since_selection = 0
        self.version = 0
        """Bumped by every change of the pages' contents except a decode's new token
        (:meth:`write`, :meth:`reselect`): a copy made at another version is stale
        (:mod:`engine.model.packed_mirror`)."""

    @staticmethod
    def blocks_for(counts: Sequence[int], block_size: int) -> int:
        """Whole blocks that hold layers of ``counts`` tokens, packed."""
        pages = sum(-(-c // block_size) for c in counts)
        return -(-pages // len(counts))

    @property
    def num_tokens(self) -> int:
        """Tokens held, summed over layers (the exact request holds ``tokens * layers``)."""
        return sum(self.counts)

    def add_blocks(self, block_ids: Sequence[int]) -> None:
        """Take ``block_ids`` (fresh from the pool): all their layer pages become spare."""
        self.blocks.extend(block_ids)
        self.spare.extend(layer * self.stride + b for b in block_ids for layer in range(self.num_layers))

    def _per_layer(self, new_tokens: int | Sequence[int]) -> list[int]:
        if isinstance(new_tokens, int):
            return [new_tokens] * self.num_layers
        if len(new_tokens) != self.num_layers:
            raise ValueError(f"{len(new_tokens)} layer counts for {self.num_layers} layers")
        return list(new_tokens)

    def blocks_needed(self, new_tokens: int | Sequence[int] = 0) -> int:
        """Blocks to add before every layer can hold ``new_tokens`` more tokens (or
        layer ``l`` ``new_tokens[l]``)."""
        bs = self.block_size
        pages = sum(max(0, -(-(c + k) // bs) - len(p))
                    for c, k, p in zip(self.counts, self._per_layer(new_tokens), self.pages, strict=True))
        return -(-max(0, pages - len(self.spare)) // self.num_layers)

    def fill(self, new_tokens: int | Sequence[int] = 0) -> None:
        """Give every layer the spare pages it needs for ``new_tokens`` more tokens (or
        layer ``l`` ``new_tokens[l]``; :meth:`blocks_needed` must be 0)."""
        bs = self.block_size
        added: list[tuple[int, int, int]] = []
        for layer, (count, k, pages) in enumerate(zip(self.counts, self._per_layer(new_tokens), self.pages,
                                                      strict=True)):
            while len(pages) * bs < count + k:
                if not self.spare:
                    raise ValueError("no spare page: add blocks first")
                pages.append(self.spare.pop())
                added.append((layer, len(pages) - 1, pages[-1]))
        if not added:
            return
        need = max(len(p) for p in self.pages)
        if need > self.table.shape[1]:
            grown = torch.full((self.num_layers, max(need, 2 * self.table.shape[1])), self.storage.pad_block,
                               dtype=torch.long)
            grown[:, : self.table.shape[1]] = self.table
            self.table = grown
        layers, columns, values = zip(*added, strict=True)
        self.table[list(layers), list(columns)] = torch.tensor(values, dtype=torch.long)

    def add_scores(self, scores: torch.Tensor) -> None:
        """Add one decode query's attention (``[layers, keys]``, float32, per layer over
        its packed tokens, zeros past each count) to :attr:`scores`."""
        n = scores.shape[1]
        if self.scores.shape[1] < n:
            self.scores = F.pad(self.scores, (0, n - self.scores.shape[1]))
        self.scores[:, :n] += scores
        self.since_selection += 1

    def load(self, data: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Write every layer's tokens from the start (``data[l]``: keys, values
        ``[counts[l], kv_heads, head_dim]``; the pages must exist: :meth:`fill`)."""
        for layer, (keys, values) in enumerate(data):
            self.write(layer, 0, keys, values)

    def reselect(self, keep: Sequence[torch.Tensor]) -> list[int]:
        """Keep only layer ``l``'s tokens at packed indices ``keep[l]`` (sorted), repacked
        from the first page of the first block on; returns the blocks no page needs any
        more, dropped from :attr:`blocks` (the caller gives them back to the pool).
        Resets the scores. Every layer's kept K/V are copied out in one gather and back
        in one scatter, their rows computed for all layers at once."""
        hd = self.storage.layout.head_dim
        flat_keys, flat_values = self.storage.all_keys.view(-1, hd), self.storage.all_values.view(-1, hd)
        counts = torch.tensor([idx.numel() for idx in keep], dtype=torch.long)
        layer_of = torch.repeat_interleave(torch.arange(self.num_layers), counts)  # every kept token's layer
        source = self.rows(layer_of, torch.cat(list(keep)))
        keys, values = self.storage.scratch(source.numel())
        torch.index_select(flat_keys, 0, source, out=keys)
        torch.index_select(flat_values, 0, source, out=values)
        self.version += 1
        self.counts = counts.tolist()
        need = self.blocks_for(self.counts, self.block_size)
        kept, released = self.blocks[:need], self.blocks[need:]
        self.blocks, self.spare = [], []
        self.pages = [[] for _ in self.counts]
        self.table.fill_(self.storage.pad_block)
        self.add_blocks(kept)
        self.fill()
        first = torch.repeat_interleave(torch.cumsum(counts, 0) - counts, counts)  # each layer's first kept token
        target = self.rows(layer_of, torch.arange(layer_of.numel()) - first)
        flat_keys.index_copy_(0, target, keys)
        flat_values.index_copy_(0, target, values)
        self.scores = torch.zeros((self.num_layers, 0))
        self.since_selection = 0
        return released

    def rows(self, layer: int | torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
        """Where layer ``layer``'s packed tokens ``indices`` live (or, ``layer`` a tensor
        like ``indices``, each token's own layer): their rows of the flat
        ``storage.all_keys.view(-1, head_dim)`` (and of the values), token by token, each
        token's KV heads in order (``[len(indices) * kv_heads]``)."""
        lay = self.storage.layout
        bs, stride = self.block_size, self.stride
        pages = self.table[layer, indices // bs]
        where, slot = pages // stride, (pages % stride) * bs + indices % bs
        heads = torch.arange(lay.kv_heads, dtype=torch.long)
        return ((where[:, None] * lay.kv_heads + heads) * (stride * bs) + slot[:, None]).reshape(-1)

    def gather(self, layer: int, pages: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Copies of layer ``layer``'s first ``pages`` pages, keys and values
        ``[kv_heads, pages * block_size, head_dim]`` each (one ``index_select`` of whole
        pages; positions past the count hold whatever the pages held)."""
        lay = self.storage.layout
        table = self.table[layer, :pages]
        base = (table // self.stride) * (lay.kv_heads * self.stride) + table % self.stride
        rows = (torch.arange(lay.kv_heads, dtype=torch.long)[:, None] * self.stride + base[None, :]).reshape(-1)
        shape = (lay.kv_heads, pages * lay.block_size, lay.head_dim)
        flat = (-1, lay.block_size, lay.head_dim)
        return (torch.index_select(self.storage.all_keys.view(flat), 0, rows).view(shape),
                torch.index_select(self.storage.all_values.view(flat), 0, rows).view(shape))

    def read(self, layer: int, indices: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Copies of layer ``layer``'s keys and values at packed ``indices``
        (``[n, kv_heads, head_dim]`` each)."""
        lay = self.storage.layout
        rows = self.rows(layer, indices)
        shape = (indices.numel(), lay.kv_heads, lay.head_dim)
        return (torch.index_select(self.storage.all_keys.view(-1, lay.head_dim), 0, rows).view(shape),
                torch.index_select(self.storage.all_values.view(-1, lay.head_dim), 0, rows).view(shape))

    def write(self, layer: int, first: int, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Store ``keys``/``values`` (``[n, kv_heads, head_dim]``) as layer ``layer``'s
        tokens ``first ..`` (their pages must exist: :meth:`fill`)."""
        hd = self.storage.layout.head_dim
        self.version += 1
        rows = self.rows(layer, torch.arange(first, first + keys.shape[0]))
        self.storage.all_keys.view(-1, hd).index_copy_(0, rows, keys.reshape(-1, hd))
        self.storage.all_values.view(-1, hd).index_copy_(0, rows, values.reshape(-1, hd))
