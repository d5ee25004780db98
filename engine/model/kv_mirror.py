"""KVMirrors: contiguous copies of long requests' keys and values, so attention reads them without a gather.

Attention reads a sequence's K/V out of the paged pool with one ``index_select``
per layer (:meth:`~engine.model.kv_storage.KVStorage.gather`): a copy of every
position, every step. At long context the copy costs about as much as the attention
itself: for one token at 7.7k positions of the bundled model (177 MB of K/V over 30
layers) ~18 ms of gathers beside ~15 ms of products, 2 threads. A request that keeps
computing at long context (decoding, or prefilling in chunks) gathers the same
positions again each step.

A mirror keeps, per request, its K/V of positions ``0 .. valid - 1`` in one
contiguous tensor per layer, laid out as a gather returns them (``[kv_heads,
positions, head_dim]``), exactly as long as attention reads (the sequence's padded
length): a longer one, sliced, is not contiguous across heads, and the batched
product then copies it whole. So a mirror is reallocated (copied once) each time the
padded length grows, every :data:`~engine.model.attention.KV_PAD` positions. Each forward appends what it computes (the same values it
writes into the pool) and copies from the pool only the positions computed since the
mirror was last used; attention then reads the mirror in place. The values are the
pool's, bit for bit, so outputs do not change: positions past the sequence's last
one (the key padding) hold zeros or older finite values and are masked, as the
pool's padding is.

Which requests: the engine names a request by its id (:attr:`SequenceInput.mirror`)
when its K/V at a position depend only on its tokens up to there, i.e. exact
requests that are not assembled from prompt modules (their copies and recomputes
rewrite positions in place) and not compressed; the runner mirrors it once its
padded length reaches :data:`MIN_TOKENS`. A mirror is dropped when its request
finishes or is preempted (:meth:`KVMirrors.forget`), when its block table no longer
starts with the blocks it was filled from, and least recently used first when a new
one would pass the memory budget (a request that does not fit is gathered as before).

Invariants: the mirrors' bytes never exceed the budget; positions below ``valid``
equal the pool's K/V of the request's blocks.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from engine.model.kv_storage import KVStorage

MIN_TOKENS = 1024
"""Padded length from which a request is mirrored: shorter gathers cost little."""


@dataclass
class _Entry:
    keys: torch.Tensor  # [layers, kv_heads, capacity, head_dim]
    values: torch.Tensor
    valid: int = 0
    blocks: tuple[int, ...] = ()  # the block table prefix the valid positions were read from

    @property
    def capacity(self) -> int:
        return self.keys.shape[2]

    @property
    def nbytes(self) -> int:
        return 2 * self.keys.numel() * self.keys.element_size()


class MirrorUse:
    """One sequence's mirror in one forward: before its layer's attention reads it,
    :meth:`update` copies the positions missing from the pool and the forward's new
    ones from its K/V rows."""

    def __init__(self, entry: _Entry, storage: KVStorage, fill_slots: torch.Tensor, fill_from: int,
                 row: int, start: int, end: int, length: int) -> None:
        self._entry = entry
        self._storage = storage
        self._fill_slots = fill_slots
        self._fill_from = fill_from
        self._row, self._start, self._end, self.length = row, start, end, length

    def update(self, layer: int, key: torch.Tensor, value: torch.Tensor) -> None:
        """Bring the mirror of ``layer`` up to this forward's last position (after the
        forward's K/V were written to the pool; ``key``/``value``: the batch's new
        ``[rows, kv_heads, head_dim]``)."""
        e, s, t = self._entry, self._start, self._end
        if self._fill_from < s:
            k, v = self._storage.read(layer, self._fill_slots)
            e.keys[layer, :, self._fill_from : s].copy_(k.transpose(0, 1))
            e.values[layer, :, self._fill_from : s].copy_(v.transpose(0, 1))
        rows = slice(self._row, self._row + t - s)
        e.keys[layer, :, s:t].copy_(key[rows].transpose(0, 1))
        e.values[layer, :, s:t].copy_(value[rows].transpose(0, 1))

    def kv(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``[kv_heads, length, head_dim]`` views of the layer's keys and values (reads only)."""
        return self._entry.keys[layer, :, : self.length], self._entry.values[layer, :, : self.length]

    def done(self) -> None:
        """After the forward: positions up to its last one are valid."""
        self._entry.valid = self._end


class KVMirrors:
    """The mirrors of one :class:`KVStorage`, within ``budget_bytes`` (0: none)."""

    def __init__(self, storage: KVStorage, budget_bytes: int) -> None:
        if budget_bytes < 0:
            raise ValueError(f"the K/V mirror budget must be >= 0 bytes, got {budget_bytes!r}")
        self.storage = storage
        self.budget_bytes = budget_bytes
        self._entries: OrderedDict[str, _Entry] = OrderedDict()

    @property
    def nbytes(self) -> int:
        return sum(e.nbytes for e in self._entries.values())

    def __len__(self) -> int:
        return len(self._entries)

    def use(self, key: str, block_ids: Sequence[int], row: int, start: int, end: int, length: int,
            ) -> MirrorUse | None:
        """The mirror for request ``key`` computing positions ``[start, end)`` over
        ``block_ids`` (attention reads ``length`` positions), created or grown as needed;
        None when ``length`` is under :data:`MIN_TOKENS` or it does not fit the budget.
        Evicts least recently used mirrors to make room."""
        if length < MIN_TOKENS or not self.budget_bytes:
            return None
        lay, bs = self.storage.layout, self.storage.layout.block_size
        entry = self._entries.pop(key, None)
        if entry is not None and tuple(block_ids[: len(entry.blocks)]) != entry.blocks:
            entry.valid, entry.blocks = 0, ()  # preempted and re-admitted elsewhere: refill
        if entry is None or entry.capacity != length:  # a layer's [kv_heads, length, head_dim] stays contiguous
            shape = (lay.num_layers, lay.kv_heads, length, lay.head_dim)
            need = 2 * torch.Size(shape).numel() * torch.empty((), dtype=lay.dtype).element_size()
            while self._entries and self.nbytes + need > self.budget_bytes:
                self._entries.popitem(last=False)
            if need > self.budget_bytes:
                return None
            kept = min(entry.valid, length) if entry is not None else 0
            grown = _Entry(torch.empty(shape, dtype=lay.dtype), torch.empty(shape, dtype=lay.dtype), kept)
            for new, old in ((grown.keys, entry.keys if entry else None), (grown.values, entry.values if entry else None)):
                if old is not None and kept:
                    new[:, :, :kept].copy_(old[:, :, :kept])
                new[:, :, kept:].zero_()
            if entry is not None:
                grown.blocks = entry.blocks
            entry = grown
        self._entries[key] = entry
        fill_from = min(entry.valid, start)
        slots = torch.tensor(self.storage.slot_ids(block_ids, fill_from, start), dtype=torch.long)
        entry.blocks = tuple(block_ids[: -(-end // bs)])
        return MirrorUse(entry, self.storage, slots, fill_from, row, start, end, length)

    def forget(self, key: str) -> None:
        """Drop request ``key``'s mirror, if any (it finished, or its blocks were freed)."""
        self._entries.pop(key, None)

    def clear(self) -> None:
        self._entries.clear()
