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
product then copies it whole. Each mirror lives in a flat buffer with room for
:data:`HEADROOM` more positions; when the padded length grows (every
:data:`~engine.model.attention.KV_PAD` positions) its rows are moved apart in place,
and past its room it moves to a larger buffer. Buffers of finished requests are kept
(within the budget) for the next mirror: a fresh allocation of ~180 MB costs its page
faults (tens of ms), a reused one nothing. Each forward appends what it computes (the same values it
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
starts with the blocks its kept positions were filled from (a rejected draft's block
given back does not count: its positions are computed again), and least recently
used first when a new one would pass the memory budget (a request that does not fit
is gathered as before).

Invariants: the mirrors' bytes never exceed the budget; positions below ``valid``
equal the pool's K/V of the request's blocks.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence

import torch

from engine.model.kv_storage import KVStorage

MIN_TOKENS = 1024
"""Padded length from which a request is mirrored: shorter gathers cost little."""
HEADROOM = 1024
"""Positions a new buffer holds beyond the padded length that needs it."""


class _Entry:
    """One request's mirror: ``rows = layers * kv_heads`` rows of ``length * head_dim``
    elements at the front of a flat key buffer and a flat value buffer."""

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, rows: int, head_dim: int) -> None:
        self.buf_keys, self.buf_values = keys, values
        self.rows, self.head_dim = rows, head_dim
        self.length = 0
        self.valid = 0
        self.blocks: tuple[int, ...] = ()  # the block table prefix the valid positions were read from

    @property
    def room(self) -> int:
        """The longest length the buffers hold."""
        return self.buf_keys.numel() // (self.rows * self.head_dim)

    @property
    def nbytes(self) -> int:
        return 2 * self.buf_keys.numel() * self.buf_keys.element_size()

    def view(self, buf: torch.Tensor, layers: int) -> torch.Tensor:
        """``buf``'s front as ``[layers, kv_heads, length, head_dim]`` (contiguous)."""
        return buf[: self.rows * self.length * self.head_dim].view(layers, -1, self.length, self.head_dim)

    def stretch(self, length: int) -> None:
        """Lay the rows out for ``length`` positions (at most :attr:`room`), in place:
        each row's first ``min(valid, length)`` positions keep their values. Rows move
        from the last to the first, so none is overwritten before it moved."""
        old, d = self.length, self.head_dim
        keep = min(self.valid, old, length) * d
        if length > old and keep:
            for buf in (self.buf_keys, self.buf_values):
                for i in range(self.rows - 1, 0, -1):
                    src, dst = buf[i * old * d : i * old * d + keep], buf[i * length * d : i * length * d + keep]
                    dst.copy_(src.clone() if i * length * d < i * old * d + keep else src)
        elif length < old and keep:
            for buf in (self.buf_keys, self.buf_values):
                for i in range(1, self.rows):  # rows move towards the front: first to last
                    src, dst = buf[i * old * d : i * old * d + keep], buf[i * length * d : i * length * d + keep]
                    dst.copy_(src.clone() if i * old * d < i * length * d + keep else src)
        self.length = length
        self.valid = min(self.valid, length)


class MirrorUse:
    """One sequence's mirror in one forward: before its layer's attention reads it,
    :meth:`update` copies the positions missing from the pool and the forward's new
    ones from its K/V rows."""

    def __init__(self, entry: _Entry, storage: KVStorage, fill_rows: torch.Tensor | None, fill_from: int,
                 row: int, start: int, end: int) -> None:
        layers = storage.layout.num_layers
        self._keys, self._values = entry.view(entry.buf_keys, layers), entry.view(entry.buf_values, layers)
        self._entry = entry
        self._storage = storage
        self._fill_rows = fill_rows
        self._fill_from = fill_from
        self._row, self._start, self._end = row, start, end
        self.length = entry.length

    def update(self, layer: int, key: torch.Tensor, value: torch.Tensor) -> None:
        """Bring the mirror of ``layer`` up to this forward's last position (after the
        forward's K/V were written to the pool; ``key``/``value``: the batch's new
        ``[rows, kv_heads, head_dim]``)."""
        s, t = self._start, self._end
        if self._fill_rows is not None and self._fill_from == 0:  # the whole (padded) table: gathered in place
            lay = self._storage.layout
            for mirror, pool in ((self._keys, self._storage.keys), (self._values, self._storage.values)):
                out = mirror[layer].view(-1, lay.block_size, lay.head_dim)
                torch.index_select(pool[layer].view(-1, lay.block_size, lay.head_dim), 0, self._fill_rows, out=out)
        elif self._fill_rows is not None:  # whole blocks from the one holding fill_from
            bs = self._storage.layout.block_size
            skip = self._fill_from % bs
            k, v = self._storage.gather(layer, self._fill_rows)
            self._keys[layer, :, self._fill_from : s].copy_(k[:, skip : skip + s - self._fill_from])
            self._values[layer, :, self._fill_from : s].copy_(v[:, skip : skip + s - self._fill_from])
        rows = slice(self._row, self._row + t - s)
        self._keys[layer, :, s:t].copy_(key[rows].transpose(0, 1))
        self._values[layer, :, s:t].copy_(value[rows].transpose(0, 1))

    def kv(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``[kv_heads, length, head_dim]`` contiguous views of the layer's keys and values (reads only)."""
        return self._keys[layer], self._values[layer]

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
        self._spare: list[_Entry] = []  # buffers of forgotten mirrors, for reuse
        self.others: list[Callable[[], int]] = []
        """Bytes held by other mirrors within the same budget
        (:class:`~engine.model.packed_mirror.PackedMirrors`)."""

    @property
    def nbytes(self) -> int:
        """Bytes of every buffer held, spare ones included."""
        return sum(e.nbytes for e in [*self._entries.values(), *self._spare])

    def __len__(self) -> int:
        return len(self._entries)

    def _used(self) -> int:
        return self.nbytes + sum(other() for other in self.others)

    def make_room(self, need: int) -> bool:
        """Whether ``need`` more bytes fit the budget, after evicting spare buffers, then
        least recently used mirrors, as far as that helps (nothing when it cannot)."""
        if sum(other() for other in self.others) + need > self.budget_bytes:
            return False
        while (self._spare or self._entries) and self._used() + need > self.budget_bytes:
            if self._spare:
                self._spare.pop(0)
            else:
                self._entries.popitem(last=False)
        return self._used() + need <= self.budget_bytes

    def use(self, key: str, block_ids: Sequence[int], row: int, start: int, end: int, length: int,
            ) -> MirrorUse | None:
        """The mirror for request ``key`` computing positions ``[start, end)`` over
        ``block_ids`` (attention reads ``length`` positions), created or grown as needed;
        None when ``length`` is under :data:`MIN_TOKENS` or it does not fit the budget.
        Evicts spare buffers, then least recently used mirrors, to make room."""
        if length < MIN_TOKENS or not self.budget_bytes:
            return None
        bs = self.storage.layout.block_size
        entry = self._entries.pop(key, None)
        if entry is not None:  # the blocks of the positions it keeps (before ``start``) must be the same
            keep = -(-min(entry.valid, start) // bs)
            if tuple(block_ids[:keep]) != entry.blocks[:keep]:
                entry.valid, entry.blocks = 0, ()  # preempted and re-admitted elsewhere: refill
        if entry is None or entry.room < length:
            moved = self._buffer(length)
            if moved is None:
                if entry is not None:
                    self._spare.append(entry)
                return None
            if entry is not None:  # past its room: into the larger buffer
                moved.length = length
                keep = min(entry.valid, entry.length)
                layers = self.storage.layout.num_layers
                for new, old in ((moved.buf_keys, entry.buf_keys), (moved.buf_values, entry.buf_values)):
                    moved.view(new, layers)[:, :, :keep].copy_(entry.view(old, layers)[:, :, :keep])
                moved.valid, moved.blocks = keep, entry.blocks
                self._spare.append(entry)
            entry = moved
        if entry.length != length:
            entry.stretch(length)
        self._entries[key] = entry
        while self._spare and self._used() > self.budget_bytes:  # the buffer it left
            self._spare.pop(0)
        fill_from = min(entry.valid, start)
        if fill_from == 0 < start:  # a new mirror: the padded table, as attention would gather it
            used = -(-end // bs)
            fill_rows = self.storage.rows([*block_ids[:used], *[self.storage.pad_block] * (length // bs - used)])
        elif fill_from < start:
            fill_rows = self.storage.rows(block_ids[fill_from // bs : -(-start // bs)])
        else:
            fill_rows = None
        entry.blocks = tuple(block_ids[: -(-end // bs)])
        return MirrorUse(entry, self.storage, fill_rows, fill_from, row, start, end)

    def _buffer(self, length: int) -> _Entry | None:
        """An empty entry with room for ``length`` positions: the smallest spare one that
        fits, else a new one (zeros: every element stays finite), evicting to make room."""
        fits = [e for e in self._spare if e.room >= length]
        if fits:
            entry = min(fits, key=lambda e: e.room)
            self._spare.remove(entry)
            entry.length, entry.valid, entry.blocks = 0, 0, ()
            return entry
        lay = self.storage.layout
        rows = lay.num_layers * lay.kv_heads
        numel = rows * (length + HEADROOM) * lay.head_dim
        need = 2 * numel * torch.empty((), dtype=lay.dtype).element_size()
        if not self.make_room(need):
            return None
        return _Entry(torch.zeros(numel, dtype=lay.dtype), torch.zeros(numel, dtype=lay.dtype), rows, lay.head_dim)

    def forget(self, key: str) -> None:
        """Drop request ``key``'s mirror, if any (it finished, or its blocks were freed);
        its buffers are kept for the next mirror while the budget allows."""
        entry = self._entries.pop(key, None)
        if entry is not None:
            self._spare.append(entry)
