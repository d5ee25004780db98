"""PackedMirrors: compressed requests' packed K/V, copied side by side, so their decodes attend without a gather.

A compressed request's decode reads its packed pages (:mod:`engine.model.packed_kv`)
out of the pool with one ``index_select`` per layer (:class:`~engine.model.packed_attention.PackedDecodes`):
a copy of every kept token, every step, then read again by the products. Measured on
the bundled model (2 threads, 8 compressed requests at 2k tokens decoding together):
the gathers took ~16 ms of a ~68 ms step, as long as the products themselves.

The mirrors keep, per layer, one tensor ``[slots, kv_heads, capacity, head_dim]`` of keys
and one of values; each compressed request that decodes owns a slot and its layer
``l``'s packed tokens ``0 .. counts[l] - 1`` sit at the front of the slot, in packed
order. Decodes of the slots ``0 .. s - 1`` are then attended by one batched product per
layer over a view of the first ``s`` slots (no copy). A decode writes its new token to
the pool and to its slot; anything else that rewrites a request's pages (a prefill
chunk, a selection: :attr:`PackedKV.version`) makes its slot stale, refilled from the
pool at its next decode. The values are the pool's, bit for bit; positions past a
slot's count hold zeros or older finite values and are masked, as the pool's padding.

Slots are dense: when a request leaves (:meth:`forget`: finished, preempted) the last
slot moves into its place. The capacity of a layer grows (every slot's tensor copied)
when a request needs more; the whole copy is freed when the last slot leaves. Memory
comes out of the runner's mirror budget (:class:`~engine.model.kv_mirror.KVMirrors`,
:meth:`KVMirrors.make_room`); requests that do not fit are gathered as before.

Invariants: slots ``0 .. len(self) - 1`` are in use, each by one request; a slot whose
``version`` and ``counts`` equal its :class:`PackedKV`'s holds that request's packed
K/V of every layer at its front.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from engine.model.kv_mirror import KVMirrors
from engine.model.kv_storage import KVStorage
from engine.model.packed_kv import PackedKV

HEADROOM = 64
"""Positions a layer's capacity grows by beyond what the request that needs it asks."""
CAPACITY_STEP = 128
"""Capacities are multiples of it: the decode products' shapes are the capacities, and
oneDNN compiles a kernel per shape."""


@dataclass
class _Slot:
    key: str
    packed: PackedKV
    version: int | None = None
    """The packed K/V's version the slot holds; None: stale (filled at the next use)."""
    counts: list[int] = field(default_factory=list)


class PackedMirrors:
    """The packed mirrors of one :class:`KVStorage`, within a :class:`KVMirrors`' budget."""

    def __init__(self, storage: KVStorage, budget: KVMirrors) -> None:
        self.storage = storage
        self.budget = budget
        self.keys: list[torch.Tensor] = []
        """Per layer ``[slot capacity, kv_heads, capacity(layer), head_dim]`` (empty: no slot)."""
        self.values: list[torch.Tensor] = []
        self._slots: list[_Slot] = []
        budget.others.append(lambda: self.nbytes)

    def __len__(self) -> int:
        return len(self._slots)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.keys, *self.values))

    def capacity(self, layer: int) -> int:
        """Positions each slot holds in ``layer`` (0 before the first use)."""
        return self.keys[layer].shape[2] if self.keys else 0

    def use(self, keys: Sequence[str], packed: Sequence[PackedKV]) -> list[int] | None:
        """The slots of these requests' decodes (request ``keys[i]``, its ``packed[i]``,
        whose pages hold room for the new token: :meth:`PackedKV.fill`), each holding the
        request's packed K/V, taken or grown as needed (stale ones refilled); None when
        they do not fit the budget (nothing changed then)."""
        lay = self.storage.layout
        bs = lay.block_size
        index = {s.key: i for i, s in enumerate(self._slots)}
        need = [max(len(p.pages[layer]) * bs for p in packed) for layer in range(lay.num_layers)]
        new = [(k, p) for k, p in zip(keys, packed, strict=True) if k not in index]
        have = self.keys[0].shape[0] if self.keys else 0
        rows = len(self._slots) + len(new)
        caps = [self.capacity(layer) for layer in range(lay.num_layers)]
        if rows > have or any(n > c for n, c in zip(need, caps, strict=True)):
            caps = [c if c >= n else -(-(n + HEADROOM) // CAPACITY_STEP) * CAPACITY_STEP
                    for c, n in zip(caps, need, strict=True)]
            more = have if rows <= have else max(rows, 2 * have)
            if not self._grow(more, caps) and (more == rows or not self._grow(rows, caps)):
                return None
        for k, p in new:
            index[k] = len(self._slots)
            self._slots.append(_Slot(k, p))
        slots = [index[k] for k in keys]
        for i, p in zip(slots, packed, strict=True):
            slot = self._slots[i]
            if slot.packed is not p or slot.version != p.version or slot.counts != p.counts:
                slot.packed = p
                self._fill(i, p)
                slot.version, slot.counts = p.version, list(p.counts)
        return slots

    def advanced(self, slots: Sequence[int]) -> None:
        """After a forward that appended one token to these slots (and to their pages)."""
        for i in slots:
            slot = self._slots[i]
            slot.counts = list(slot.packed.counts)

    def forget(self, key: str) -> None:
        """Drop request ``key``'s slot, if any: the last slot moves into it; the tensors
        are freed with the last slot."""
        at = next((i for i, s in enumerate(self._slots) if s.key == key), None)
        if at is None:
            return
        last = len(self._slots) - 1
        if at != last:
            for t in (*self.keys, *self.values):
                t[at].copy_(t[last])
            self._slots[at] = self._slots[last]
        self._slots.pop()
        if not self._slots:
            self.keys, self.values = [], []

    def _grow(self, rows: int, caps: Sequence[int]) -> bool:
        """Reallocate for ``rows`` slots of ``caps[l]`` positions per layer (the layers
        whose shape stays are kept as they are), keeping the slots' contents; False when
        the budget cannot make room."""
        lay = self.storage.layout
        elem = torch.empty((), dtype=lay.dtype).element_size()
        want = 2 * rows * lay.kv_heads * sum(caps) * lay.head_dim * elem
        if not self.budget.make_room(want - self.nbytes):
            return False
        keys: list[torch.Tensor] = []
        values: list[torch.Tensor] = []
        for layer, cap in enumerate(caps):
            for old, out in ((self.keys, keys), (self.values, values)):
                if old and old[layer].shape[0] == rows and old[layer].shape[2] == cap:  # this layer as it is
                    out.append(old[layer])
                    continue
                # zeros: every element stays finite (masked positions are multiplied by 0)
                t = torch.zeros((rows, lay.kv_heads, cap, lay.head_dim), dtype=lay.dtype)
                if old:
                    n, c = min(rows, old[layer].shape[0]), min(cap, old[layer].shape[2])
                    t[:n, :, :c] = old[layer][:n, :, :c]
                out.append(t)
        self.keys, self.values = keys, values
        return True

    def _fill(self, i: int, p: PackedKV) -> None:
        """Copy request ``p``'s packed K/V of every layer into slot ``i``."""
        for layer, layer_pages in enumerate(p.pages):
            if layer_pages:
                keys, values = p.gather(layer, len(layer_pages))
                self.keys[layer][i, :, : keys.shape[1]].copy_(keys)
                self.values[layer][i, :, : values.shape[1]].copy_(values)

    def check_integrity(self) -> None:
        """Raise AssertionError unless every slot in sync holds its request's pages' K/V."""
        bs = self.storage.layout.block_size
        for i, slot in enumerate(self._slots):
            p = slot.packed
            if slot.version != p.version or slot.counts != p.counts:
                continue
            for layer, count in enumerate(p.counts):
                idx = torch.arange(count)
                k, v = p.read(layer, idx)
                assert torch.equal(self.keys[layer][i, :, :count].transpose(0, 1), k), (slot.key, layer)
                assert torch.equal(self.values[layer][i, :, :count].transpose(0, 1), v), (slot.key, layer)
            assert all(len(pg) * bs <= self.capacity(x) for x, pg in enumerate(p.pages))
