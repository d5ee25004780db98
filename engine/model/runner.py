"""ModelRunner: runs a request's uncached tokens over its cached K/V and writes new K/V to blocks.

One request's life in the runner:

1. :meth:`ModelRunner.prefill` gathers the K/V of the request's cache-hit blocks
   (whole blocks, in block-table order) once into a per-request working cache,
   runs the model over the uncached prompt suffix only, with positions
   ``num_cached .. num_prompt - 1``, and writes the suffix's K/V into the
   request's block slots;
2. :meth:`ModelRunner.decode` runs one new token at the next position over the
   same working cache (nothing is re-gathered) and writes that token's K/V into
   its slot.

Invariants:

* a working cache holds exactly the K/V of positions ``0 .. num_computed - 1`` of
  its request, contiguous, in position order;
* after every forward, every computed position's K/V is also in its block slot,
  so blocks the KV cache manager caches hold exactly what a full pass computes.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from transformers.cache_utils import DynamicCache, DynamicLayer

from engine.kvcache.block_hash import BlockHash
from engine.model.attention import padded_length
from engine.model.kv_storage import KVStorage


class _WorkingLayer(DynamicLayer):
    """One layer of a request's working cache, filled left to right so that appending a
    token copies only that token.

    Keys are stored transposed, ``[1, kv_heads, head_dim, capacity]``, values as
    ``[1, kv_heads, capacity, head_dim]``: the two attention products then read both
    operands in the layout the CPU GEMM kernels take without a copy (a transposed
    key view costs ~30x more per product). :meth:`update` returns ``[1, kv_heads,
    n, head_dim]`` views padded with zeros to :func:`padded_length` (see
    :mod:`engine.model.attention`, which masks the padding by position).
    """

    def __init__(self, keys_t: torch.Tensor, values: torch.Tensor, length: int, fresh: bool) -> None:
        """``fresh``: the buffers come from ``torch.empty`` and may hold non-finite
        garbage past ``length`` (zeroed here); recycled buffers hold finite stale data."""
        super().__init__()
        capacity = values.shape[-2]
        assert keys_t.shape[-1] == capacity == padded_length(capacity)
        self._keys_t = keys_t
        self._values = values
        self.length = length
        self.dtype, self.device = values.dtype, values.device
        self.is_initialized = True
        if fresh:
            keys_t[..., length:].zero_()
            values[:, :, length:].zero_()
        self._expose()

    def buffers(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self._keys_t, self._values

    def _expose(self) -> None:
        self.keys = self._keys_t[..., : self.length].transpose(-1, -2)
        self.values = self._values[:, :, : self.length]

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        return None

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        start, end = self.length, self.length + key_states.shape[-2]
        if end > self._values.shape[-2]:
            self._grow(end)
        self._keys_t[..., start:end].copy_(key_states.transpose(-1, -2))
        self._values[:, :, start:end].copy_(value_states)
        self.length = end
        self._expose()
        padded = padded_length(end)
        return self._keys_t[..., :padded].transpose(-1, -2), self._values[:, :, :padded]

    def _grow(self, needed: int) -> None:
        capacity = padded_length(max(needed, 2 * self._values.shape[-2]))
        keys_t = self._keys_t.new_zeros((*self._keys_t.shape[:3], capacity))
        values = self._values.new_zeros((*self._values.shape[:2], capacity, self._values.shape[-1]))
        keys_t[..., : self.length].copy_(self._keys_t[..., : self.length])
        values[:, :, : self.length].copy_(self._values[:, :, : self.length])
        self._keys_t, self._values = keys_t, values

    def get_seq_length(self) -> int:
        return self.length

    def truncate(self, length: int) -> None:
        """Forget positions from ``length`` on; their stale (finite) K/V stay in the
        buffers, where attention masks them exactly like zero padding."""
        assert 0 <= length <= self.length
        self.length = length
        self._expose()

    def span(self, start: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of positions ``[start, end)``, ``[kv_heads, n, head_dim]`` views."""
        return self._keys_t[0, :, :, start:end].transpose(-1, -2), self._values[0, :, start:end]


class SequenceState:
    """A request's working cache and how many of its tokens it covers."""

    def __init__(self, cache: DynamicCache, num_computed: int) -> None:
        self.cache = cache
        self.num_computed = num_computed

    def layer(self, i: int) -> _WorkingLayer:
        layer = self.cache.layers[i]
        assert isinstance(layer, _WorkingLayer)
        return layer


class ModelRunner:
    """Executes forwards of a causal LM against a block-laid-out :class:`KVStorage`.

    It keeps at most one *spare* working cache: the one of the last request that
    finished cleanly, named by the hashes of the full blocks it holds. A prefill
    whose hit ends on one of those hashes takes the spare instead of gathering
    from the blocks: the hash chain names the whole prefix (tokens, salt, extra
    keys), so the spare holds exactly the K/V the hit blocks hold.
    """

    def __init__(self, model: Any, storage: KVStorage) -> None:
        self.model = model
        self.storage = storage
        self.num_layers = storage.layout.num_layers
        self._spare: tuple[list[BlockHash], SequenceState] | None = None
        self.num_spare_reuses = 0

    def retain(self, state: SequenceState, block_hashes: Sequence[BlockHash]) -> None:
        """Keep ``state`` as the spare; ``block_hashes`` name its first full blocks."""
        self._spare = (list(block_hashes), state) if block_hashes else None

    def drop_spare(self) -> None:
        """Forget the spare working cache (the next hit gathers from the blocks)."""
        self._spare = None

    def _take_spare(
        self, hit_hashes: Sequence[BlockHash]
    ) -> tuple[SequenceState | None, SequenceState | None]:
        """(the spare as this request's state, or None; else the spare as scratch)."""
        spare, self._spare = self._spare, None
        if spare is None:
            return None, None
        hashes, state = spare
        n = len(hit_hashes)
        if n == 0 or len(hashes) < n or hashes[n - 1] != hit_hashes[-1]:
            return None, state
        num_cached = n * self.storage.layout.block_size
        for i in range(self.num_layers):
            state.layer(i).truncate(num_cached)
        state.num_computed = num_cached
        self.num_spare_reuses += 1
        return state, None

    @torch.inference_mode()
    def prefill(
        self,
        token_ids: Sequence[int],
        num_cached: int,
        block_ids: Sequence[int],
        capacity: int,
        hit_hashes: Sequence[BlockHash] = (),
    ) -> tuple[SequenceState, torch.Tensor]:
        """Run ``token_ids[num_cached:]`` over the K/V of the first ``num_cached`` tokens.

        ``num_cached`` must be a multiple of the block size (whole hit blocks, whose
        hashes are ``hit_hashes``); the working cache is sized for ``capacity``
        tokens (it grows if needed). Returns the request's state and the float32
        logits of the last token.
        """
        bs = self.storage.layout.block_size
        assert num_cached % bs == 0 and num_cached < len(token_ids), (num_cached, len(token_ids))
        assert not hit_hashes or len(hit_hashes) * bs == num_cached
        state, scratch = self._take_spare(hit_hashes)
        if state is None:
            cache = self._gather(block_ids[: num_cached // bs], num_cached, capacity, scratch)
            state = SequenceState(cache, num_cached)
        logits = self._forward(state, token_ids[num_cached:], block_ids)
        return state, logits

    @torch.inference_mode()
    def decode(self, state: SequenceState, token_id: int, block_ids: Sequence[int]) -> torch.Tensor:
        """Run one token at position ``state.num_computed``; returns its float32 logits."""
        return self._forward(state, [token_id], block_ids)

    def _gather(
        self,
        hit_block_ids: Sequence[int],
        num_cached: int,
        capacity: int,
        scratch: SequenceState | None,
    ) -> DynamicCache:
        """A new working cache holding the hit blocks' K/V. Recycles ``scratch``'s
        buffers when they are large enough: fresh memory costs a page fault per 4 KiB."""
        layout = self.storage.layout
        cap = padded_length(max(capacity, num_cached + 1))
        ids = torch.tensor(hit_block_ids, dtype=torch.long)
        layers: list[Any] = []
        for i in range(self.num_layers):
            recycled = scratch.layer(i).buffers() if scratch is not None else None
            if recycled is not None and recycled[1].shape[-2] >= cap:
                keys_t, values = recycled
            else:
                keys_t = torch.empty((1, layout.kv_heads, layout.head_dim, cap), dtype=layout.dtype)
                values = torch.empty((1, layout.kv_heads, cap, layout.head_dim), dtype=layout.dtype)
                recycled = None
            if num_cached:
                self.storage.read_blocks_into(
                    i, ids, keys_t[0, :, :, :num_cached].transpose(-1, -2), values[0, :, :num_cached]
                )
            layers.append(_WorkingLayer(keys_t, values, num_cached, fresh=recycled is None))
        cache = DynamicCache()
        cache.layers = layers
        cache.layer_class_to_replicate = None
        return cache

    def _forward(
        self, state: SequenceState, new_token_ids: Sequence[int], block_ids: Sequence[int]
    ) -> torch.Tensor:
        start = state.num_computed
        end = start + len(new_token_ids)
        input_ids = torch.tensor([list(new_token_ids)], dtype=torch.long)
        positions = torch.arange(start, end, dtype=torch.long).unsqueeze(0)
        out = self.model(
            input_ids=input_ids,
            position_ids=positions,
            past_key_values=state.cache,
            use_cache=True,
            logits_to_keep=1,
        )
        slots = self.storage.slot_ids(block_ids, start, end)
        for i in range(self.num_layers):
            layer = state.layer(i)
            assert layer.length == end, (layer.length, end)
            keys, values = layer.span(start, end)
            self.storage.write(i, slots, keys, values)
        state.num_computed = end
        logits: torch.Tensor = out.logits[0, -1].float()
        return logits
