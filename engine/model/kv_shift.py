"""KV shifting: copy a prompt module's K/V rows to another place, keys re-rotated.

A module's K/V are computed once, on their own, at positions ``[a, a + n)`` (after
an anchor of ``a`` tokens, see :mod:`engine.core.module_assembler`). A request that
holds the module at positions ``[o, o + n)`` gets them by copying the rows into its
own blocks: values unchanged, keys rotated by ``delta = o - a``. RoPE is a
rotation per pair of dimensions by ``position * theta_i``, so rotating a key stored
at position ``p`` by ``delta`` gives the key at ``p + delta`` (up to rounding: the
rotation is done in float32 from the stored, already rounded key); nothing is
recomputed. ``delta == 0`` is a plain copy, bit for bit.

The rotation uses the model's own rotary embedding module (``rotary(x,
position_ids) -> (cos, sin)``, transformers' convention with ``rotate_half``), so
scaled RoPE variants (llama3, linear, dynamic) rotate by what the model uses.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from engine.model.kv_storage import KVStorage


@dataclass(frozen=True)
class KVCopy:
    """Copy ``num_tokens`` positions from ``src_start`` of the block table
    ``src_block_ids`` to ``dst_start`` of ``dst_block_ids``, keys rotated by ``delta``."""

    src_block_ids: tuple[int, ...]
    src_start: int
    dst_block_ids: tuple[int, ...]
    dst_start: int
    num_tokens: int
    delta: int


def _rotate(keys: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """transformers' ``x * cos + rotate_half(x) * sin`` on ``[..., head_dim]``, in float32."""
    x = keys.float()
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return (x * cos + rotated * sin).to(keys.dtype)


class KVShifter:
    """Applies :class:`KVCopy` lists to a :class:`KVStorage`, every layer."""

    def __init__(self, storage: KVStorage, rotary: Any) -> None:
        self.storage = storage
        self.rotary = rotary

    def angles(self, deltas: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """float32 ``cos``, ``sin`` (``[n, head_dim]``) of rotations by ``deltas`` positions."""
        probe = torch.zeros((1, 1, self.storage.layout.head_dim), dtype=torch.float32)
        with torch.inference_mode():
            cos, sin = self.rotary(probe, deltas[None])
        return cos[0].float(), sin[0].float()

    def apply(self, copies: Sequence[KVCopy]) -> None:
        """Perform ``copies``: in every layer all rows are read before any is written, so
        a block freed by one copy's module and reused as another request's block in the
        same step is read intact. Changes the KV storage only."""
        if not copies:
            return
        storage = self.storage
        h, d = storage.layout.kv_heads, storage.layout.head_dim
        src_slots: list[int] = []
        dst_slots: list[int] = []
        deltas: list[int] = []
        for copy in copies:
            n = copy.num_tokens
            src_slots += storage.slot_ids(copy.src_block_ids, copy.src_start, copy.src_start + n)
            dst_slots += storage.slot_ids(copy.dst_block_ids, copy.dst_start, copy.dst_start + n)
            deltas += [copy.delta] * n
        src, dst = torch.tensor(src_slots), torch.tensor(dst_slots)
        rotate = any(deltas)
        cos, sin = self.angles(torch.tensor(deltas)) if rotate else (None, None)
        with torch.inference_mode():
            for layer in range(storage.layout.num_layers):
                keys = storage.keys[layer].view(h, -1, d)
                values = storage.values[layer].view(h, -1, d)
                moved = keys.index_select(1, src)
                if cos is not None and sin is not None:
                    moved = _rotate(moved, cos, sin)
                moved_values = values.index_select(1, src)
                keys.index_copy_(1, dst, moved)
                values.index_copy_(1, dst, moved_values)
