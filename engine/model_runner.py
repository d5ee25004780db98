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

from engine.attention import padded_length
from engine.kv_storage import KVStorage


class _WorkingLayer(DynamicLayer):
    """One layer of a request's working cache: a preallocated ``[1, kv_heads, capacity,
    head_dim]`` buffer filled left to right, so appending a token copies only that token.

    :meth:`update` returns views padded with zeros to a whole number of attention
    key chunks (see :mod:`engine.attention`, which masks the padding by position).
    """

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, length: int) -> None:
        super().__init__()
        assert keys.shape[-2] == padded_length(keys.shape[-2])
        self._key_buf = keys
        self._value_buf = values
        self.length = length
        self.dtype, self.device = keys.dtype, keys.device
        self.keys = keys[:, :, :length]
        self.values = values[:, :, :length]
        self.is_initialized = True
        keys[:, :, length:].zero_()
        values[:, :, length:].zero_()

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        return None

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        start, end = self.length, self.length + key_states.shape[-2]
        if end > self._key_buf.shape[-2]:
            self._grow(end)
        self._key_buf[:, :, start:end].copy_(key_states)
        self._value_buf[:, :, start:end].copy_(value_states)
        self.length = end
        self.keys = self._key_buf[:, :, :end]
        self.values = self._value_buf[:, :, :end]
        padded = padded_length(end)
        return self._key_buf[:, :, :padded], self._value_buf[:, :, :padded]

    def _grow(self, needed: int) -> None:
        capacity = padded_length(max(needed, 2 * self._key_buf.shape[-2]))
        for name in ("_key_buf", "_value_buf"):
            old = getattr(self, name)
            new = old.new_zeros((*old.shape[:2], capacity, old.shape[-1]))
            new[:, :, : self.length].copy_(old[:, :, : self.length])
            setattr(self, name, new)

    def get_seq_length(self) -> int:
        return self.length

    def span(self, start: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of positions ``[start, end)``, ``[kv_heads, n, head_dim]`` views."""
        return self._key_buf[0, :, start:end], self._value_buf[0, :, start:end]


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
    """Executes forwards of a causal LM against a block-laid-out :class:`KVStorage`."""

    def __init__(self, model: Any, storage: KVStorage) -> None:
        self.model = model
        self.storage = storage
        self.num_layers = storage.layout.num_layers

    @torch.inference_mode()
    def prefill(
        self,
        token_ids: Sequence[int],
        num_cached: int,
        block_ids: Sequence[int],
        capacity: int,
    ) -> tuple[SequenceState, torch.Tensor]:
        """Run ``token_ids[num_cached:]`` over the K/V of the first ``num_cached`` tokens.

        ``num_cached`` must be a multiple of the block size (whole hit blocks); the
        working cache is sized for ``capacity`` tokens. Returns the request's state
        and the float32 logits of the last token.
        """
        bs = self.storage.layout.block_size
        assert num_cached % bs == 0 and num_cached < len(token_ids), (num_cached, len(token_ids))
        state = SequenceState(self._gather(block_ids[: num_cached // bs], num_cached, capacity), num_cached)
        logits = self._forward(state, token_ids[num_cached:], block_ids)
        return state, logits

    @torch.inference_mode()
    def decode(self, state: SequenceState, token_id: int, block_ids: Sequence[int]) -> torch.Tensor:
        """Run one token at position ``state.num_computed``; returns its float32 logits."""
        return self._forward(state, [token_id], block_ids)

    def _gather(self, hit_block_ids: Sequence[int], num_cached: int, capacity: int) -> DynamicCache:
        layout = self.storage.layout
        shape = (1, layout.kv_heads, padded_length(max(capacity, num_cached + 1)), layout.head_dim)
        ids = torch.tensor(hit_block_ids, dtype=torch.long)
        layers: list[Any] = []
        for i in range(self.num_layers):
            keys = torch.empty(shape, dtype=layout.dtype)
            values = torch.empty(shape, dtype=layout.dtype)
            if num_cached:
                self.storage.read_blocks_into(
                    i, ids, keys[0, :, :num_cached], values[0, :, :num_cached]
                )
            layers.append(_WorkingLayer(keys, values, num_cached))
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
