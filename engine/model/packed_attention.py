"""PackedDecodes and PackedChunk: attention for compressed requests, over their packed layer pages.

A compressed request (:class:`~engine.model.packed_kv.PackedKV`) keeps, per layer, a
subset of its tokens' K/V, stored with the RoPE rotation of their original
positions; its new token is computed at its true position and attends to the
layer's retained keys plus itself. There is no causal structure left to mask
inside a layer's retained tokens (all precede the new one), only the padding past
each request's count. All compressed decodes of a batch are attended together per
layer: read in place from their packed mirrors (:mod:`engine.model.packed_mirror`),
or gathered through their page tables padded to the longest with the storage's pad
page. A prefill
chunk of a request already packed (progressive compression) is a :class:`PackedChunk`:
its tokens go after the layer's kept ones, causal among themselves.

Each layer also records, per sequence, the attention its query paid to each packed
token (summed over heads), handed to :meth:`PackedKV.add_scores` after the forward:
the decode-time re-selection's evidence (:func:`engine.model.pyramid.reselect`).

Not batch invariant like the exact path (:mod:`engine.model.attention`): compressed
outputs are approximate by design; exact requests never come here.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from engine.model.packed_kv import PackedKV
from engine.model.packed_mirror import PackedMirrors
from engine.model.pyramid import AttentionCapture, PyramidSchedule, keep_chunk

SDPA_ROWS = 128
"""A packed chunk of at least this many rows is attended with torch's fused attention
(:meth:`PackedChunk._attend_fused`); below it, with two products (faster there:
the capture's window is then a large share of the rows)."""


@dataclass(frozen=True)
class _LayerTables:
    kv_rows: torch.Tensor | None  # [n * kv_heads * pages], sequence-major, for the gather (None: mirrored)
    length: int  # keys attended: the pages' positions, or the mirror's capacity
    hidden: torch.Tensor  # [n, 1, 1, length]: padding past each count
    new_rows: torch.Tensor  # [n * kv_heads]: the new token's row per head in the flat storage
    mirror_rows: torch.Tensor | None  # [n * kv_heads]: the same in the layer's flat mirror


class PackedDecodes:
    """The single-token compressed sequences of one forward; their tables are built for
    all layers at once (a few tensor ops per layer, whatever the batch).

    With ``mirrors`` (:mod:`engine.model.packed_mirror`) holding them, attention reads
    their K/V from the mirrors' first slots in place, each slot's whole capacity
    (masked past its count); otherwise it gathers them from the pages, padded to the
    longest. The products see the same keys and values either way, in rows of the
    same layout; only the masked tail differs in length (the same greedy tokens,
    tested on the tiny model and the bundled one in bfloat16)."""

    def __init__(self, rows: Sequence[int], packed: Sequence[PackedKV], mirrors: PackedMirrors | None = None,
                 keys: Sequence[str] | None = None) -> None:
        """Sequence ``i`` sits at batch row ``rows[i]``; its pages must hold room for the
        new token in every layer (:meth:`PackedKV.fill` with 1). ``keys[i]``: its request
        id, its slot's name in ``mirrors``."""
        slots = mirrors.use(keys, packed) if mirrors is not None and keys is not None else None
        order = sorted(range(len(packed)), key=lambda i: slots[i]) if slots is not None else range(len(packed))
        self.rows = torch.tensor([rows[i] for i in order], dtype=torch.long)
        self.packed = [packed[i] for i in order]
        self.mirrors = mirrors if slots is not None else None
        self.slots = [slots[i] for i in order] if slots is not None else None
        """Each sequence's mirror slot (increasing), or None: gathered."""
        self.width = self.slots[-1] + 1 if self.slots is not None else len(self.packed)
        """Sequences attended per layer: the mirror's slots up to the last one used
        (a slot in between that does not decode now is attended and ignored)."""
        storage = self.packed[0].storage
        self.storage = storage
        lay = storage.layout
        bs, stride = lay.block_size, storage.num_blocks + 1
        cap = max(p.table.shape[1] for p in self.packed)
        tables = torch.stack([F.pad(p.table, (0, cap - p.table.shape[1]), value=storage.pad_block)
                              for p in self.packed])  # [n, layers, cap] global page ids
        counts = torch.tensor([p.counts for p in self.packed], dtype=torch.long)  # [n, layers]
        pages_used = [max(len(p.pages[layer]) for p in self.packed) for layer in range(lay.num_layers)]
        new_page = tables.gather(2, (counts // bs)[..., None])[..., 0]  # [n, layers]
        where, slot = new_page // stride, (new_page % stride) * bs + counts % bs
        base = (tables // stride) * (lay.kv_heads * stride) + tables % stride
        heads = torch.arange(lay.kv_heads, dtype=torch.long)[None, :, None] * stride
        # rows of all_keys.view(-1, head_dim): [layers, kv_heads, stride * bs] rows
        new_rows = ((where[:, :, None] * lay.kv_heads + torch.arange(lay.kv_heads)) * (stride * bs)
                    + slot[:, :, None])  # [n, layers, kv_heads]
        seq = torch.tensor(self.slots if self.slots is not None else range(len(self.packed)), dtype=torch.long)
        # every layer's tables at once, sliced per layer below (a few ops per step, not per layer)
        if self.mirrors is not None:  # a mirror is attended whole: its capacity, a multiple of the block size
            lengths = [self.mirrors.capacity(layer) for layer in range(lay.num_layers)]
        else:
            lengths = [pages * bs for pages in pages_used]
        per_layer = counts.t()  # [layers, n]
        hidden = torch.arange(max(lengths))[None, None, :] > per_layer[:, :, None]  # [layers, n, longest]
        if self.width > len(self.packed):  # slots not decoding now: attend everything, ignored
            full = torch.zeros((lay.num_layers, self.width, hidden.shape[2]), dtype=torch.bool)
            full[:, seq] = hidden
            hidden = full
        mirror_rows = None
        if self.mirrors is not None:
            capacity = torch.tensor(lengths, dtype=torch.long)[:, None, None]
            mirror_rows = (((seq[None, :, None] * lay.kv_heads + torch.arange(lay.kv_heads)) * capacity
                            + per_layer[:, :, None]).reshape(lay.num_layers, -1))
        new_by_layer = new_rows.transpose(0, 1).reshape(lay.num_layers, -1)
        self.layers: list[_LayerTables] = []
        for layer, (pages, length) in enumerate(zip(pages_used, lengths, strict=True)):
            kv_rows = None if self.mirrors is not None else (heads + base[:, None, layer, :pages]).reshape(-1)
            self.layers.append(_LayerTables(kv_rows, length, hidden[layer, :, None, None, :length], new_by_layer[layer],
                                            None if mirror_rows is None else mirror_rows[layer]))
        self.scores = torch.zeros((lay.num_layers, self.width, max(t.length for t in self.layers)))
        """Per layer and attended sequence, the attention paid to each packed token (float32)."""

    def attend(self, layer: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float,
               out: torch.Tensor) -> None:
        """Write these rows' new K/V into their packed slots of ``layer`` (and mirror
        slots), then attend their queries (``[T, heads, head_dim]`` batch tensors) into
        ``out``'s rows."""
        lay = self.storage.layout
        t = self.layers[layer]
        kv_heads, head_dim, bs = lay.kv_heads, lay.head_dim, lay.block_size
        n, width = self.rows.numel(), self.width
        new_keys, new_values = key[self.rows].view(-1, head_dim), value[self.rows].view(-1, head_dim)
        self.storage.all_keys.view(-1, head_dim).index_copy_(0, t.new_rows, new_keys)
        self.storage.all_values.view(-1, head_dim).index_copy_(0, t.new_rows, new_values)
        length = t.length
        if self.mirrors is not None:
            assert t.mirror_rows is not None
            mk, mv = self.mirrors.keys[layer], self.mirrors.values[layer]
            mk.view(-1, head_dim).index_copy_(0, t.mirror_rows, new_keys)
            mv.view(-1, head_dim).index_copy_(0, t.mirror_rows, new_values)
            # the first slots, whole (a contiguous view: bmm copies a strided one)
            keys = mk[:width].view(width * kv_heads, length, head_dim)
            values = mv[:width].view(width * kv_heads, length, head_dim)
        else:
            assert t.kv_rows is not None
            keys = torch.index_select(self.storage.all_keys.view(-1, bs, head_dim), 0, t.kv_rows)
            values = torch.index_select(self.storage.all_values.view(-1, bs, head_dim), 0, t.kv_rows)
            keys, values = keys.view(n * kv_heads, length, head_dim), values.view(n * kv_heads, length, head_dim)
        heads = query.shape[1]
        groups = heads // kv_heads
        q = query[self.rows] * scale
        if width > n:
            wide = q.new_zeros((width, heads, head_dim))
            wide[torch.tensor(self.slots)] = q
            q = wide
        q = q.view(width * kv_heads, groups, head_dim)
        # K @ q^T with K contiguous is ~1.4x faster than q @ K^T through a transposed view
        scores = torch.bmm(keys, q.transpose(-1, -2)).transpose(-1, -2).contiguous()
        scores = scores.view(width, kv_heads, groups, length)
        scores.masked_fill_(t.hidden, float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        # over groups (contiguous rows) then heads: ~8x cheaper than one sum over both
        torch.sum(probs.sum(dim=2, dtype=torch.float32), dim=1, out=self.scores[layer, :, :length])
        chunk = torch.bmm(probs.view(width * kv_heads, groups, length), values)  # [width * kv_heads, groups, head_dim]
        chunk = chunk.view(width, heads * head_dim)
        if width > n:
            chunk = chunk[torch.tensor(self.slots)]
        out.index_copy_(0, self.rows, chunk)

    def advance(self) -> None:
        """After the forward: every layer of every sequence holds one more token, and the
        attention its query paid is added to its scores."""
        where = self.slots if self.slots is not None else range(len(self.packed))
        for i, p in zip(where, self.packed, strict=True):
            p.counts = [c + 1 for c in p.counts]
            p.add_scores(self.scores[:, i])
        if self.mirrors is not None and self.slots is not None:
            self.mirrors.advanced(self.slots)


class PackedChunk:
    """A compressed request's prefill chunk (``n`` tokens at batch rows ``row ..``),
    computed over its packed pages: each layer writes the chunk's K/V after the tokens
    it keeps, and row ``i`` attends those kept tokens plus the chunk's first ``i + 1``
    (causal within the chunk). With ``capture``, the chunk's last ``capture.window``
    queries' attention over the layer's tokens is added to it (the next selection's
    evidence).

    Layer-wise (``schedule`` given, :attr:`PyramidSchedule.layerwise`): after layer
    ``l``'s attention, :meth:`survivors` selects that layer's tokens right away
    (:func:`~engine.model.pyramid.keep_chunk`: the chunk keeps about ``retention(l)`` of
    its tokens, the layer's older tokens fill the rest; recorded in the capture and
    applied after the forward) and the chunk's tokens it drops leave the batch: layer
    ``l + 1`` computes only :attr:`m` rows, from :attr:`row` on. The last ``window``
    tokens are always kept, so the chunk's last token (the one that samples) reaches
    the last layer."""

    def __init__(self, row: int, n: int, packed: PackedKV, capture: AttentionCapture | None,
                 schedule: PyramidSchedule | None = None, total: int | None = None) -> None:
        """The pages must hold room for the ``n`` tokens in every layer (:meth:`PackedKV.fill`),
        or layer-wise (``schedule`` and ``total``, the sequence's length after this chunk)
        for the rows each layer computes (:meth:`PyramidSchedule.chunk_rows`)."""
        self.row, self.n, self.packed, self.capture = row, n, packed, capture
        self.counts = list(packed.counts)
        self.m = n
        """The chunk's rows in the current layer (its survivors, layer-wise)."""
        self.added = [n] * len(self.counts)
        """Per layer, the chunk tokens it computed (and holds until the next selection)."""
        self.targets: list[int] | None = None
        self._masks: dict[int, torch.Tensor] = {}
        self.schedule = schedule
        if schedule is not None and capture is not None and total is not None:
            self.targets = schedule.keep_counts(total, len(self.counts))

    def attend(self, layer: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float,
               out: torch.Tensor) -> None:
        p, n, r = self.packed, self.m, self.row
        storage = p.storage
        lay = storage.layout
        kv_heads, head_dim, bs = lay.kv_heads, lay.head_dim, lay.block_size
        count = self.counts[layer]
        self.added[layer] = n
        p.write(layer, count, key[r : r + n], value[r : r + n])
        pages = -(-(count + n) // bs)
        length = pages * bs
        keys, values = p.gather(layer, pages)
        heads = query.shape[1]
        groups = heads // kv_heads
        window = 0 if self.capture is None else min(n, self.capture.window)
        if n >= SDPA_ROWS and n >= 4 * window:
            self._attend_fused(layer, query, keys, values, scale, out, count, window)
            return
        # a KV head's query groups as rows of one product: the keys are read once, not
        # broadcast (copied) per group
        q = (query[r : r + n] * scale).view(n, kv_heads, groups, head_dim).permute(1, 2, 0, 3)
        scores = torch.bmm(q.reshape(kv_heads, groups * n, head_dim), keys.transpose(1, 2))
        grid = scores.view(kv_heads, groups, n, length)
        grid[..., count + n :] = float("-inf")  # the pages' room past the chunk
        grid[..., count : count + n].masked_fill_(self._causal(n), float("-inf"))  # the older tokens: all seen
        probs = torch.softmax(scores, dim=-1)
        if self.capture is not None:
            self.capture.add(layer, probs.view(kv_heads, groups, n, length), 0, n)
        chunk = torch.bmm(probs, values).view(kv_heads, groups, n, head_dim)
        out[r : r + n] = chunk.permute(2, 0, 1, 3).reshape(n, heads * head_dim)

    def _attend_fused(self, layer: int, query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float,
                      out: torch.Tensor, count: int, window: int) -> None:
        """:meth:`attend` for a long chunk: torch's fused attention (the whole ``[n, keys]``
        probabilities are never formed: ~3.5x faster at 512 rows over 2k keys), and the
        capture's probabilities from the last ``window`` queries alone."""
        n, r = self.m, self.row
        kv_heads, length, head_dim = keys.shape
        heads = query.shape[1]
        total = count + n
        # the whole pages, masked past the chunk: a contiguous view, and fewer distinct
        # lengths (oneDNN compiles a kernel per shape of the fused attention's blocks)
        seen = self._seen(count, n, length)
        chunk = F.scaled_dot_product_attention(query[r : r + n].transpose(0, 1)[None], keys[None], values[None],
                                               attn_mask=seen, scale=scale, enable_gqa=True)
        out[r : r + n] = chunk[0].transpose(0, 1).reshape(n, heads * head_dim)
        if self.capture is None or not window:
            return
        groups = heads // kv_heads
        q = (query[r + n - window : r + n] * scale).view(window, kv_heads, groups, head_dim).permute(1, 2, 0, 3)
        scores = torch.bmm(q.reshape(kv_heads, groups * window, head_dim), keys.transpose(1, 2))
        grid = scores.view(kv_heads, groups, window, length)
        grid[..., total:] = float("-inf")
        grid[..., total - window : total].masked_fill_(self._causal(window), float("-inf"))
        self.capture.add(layer, torch.softmax(grid, dim=-1), n - window, n)

    def _seen(self, count: int, n: int, length: int) -> torch.Tensor:
        """``[n, length]``: what each chunk row attends (every older token, the chunk
        causally, nothing past it)."""
        seen = torch.zeros((n, length), dtype=torch.bool)
        seen[:, :count] = True
        seen[:, count : count + n] = ~self._causal(n)
        return seen

    def _causal(self, n: int) -> torch.Tensor:
        """``[n, n]``: chunk token ``j`` is after row ``i`` (built once per row count)."""
        mask = self._masks.get(n)
        if mask is None:
            mask = self._masks[n] = torch.ones((n, n), dtype=torch.bool).triu_(1)
        return mask

    @property
    def layerwise(self) -> bool:
        return self.targets is not None

    def survivors(self, layer: int) -> torch.Tensor | None:
        """After layer ``layer``'s :meth:`attend`: the chunk rows (``0 .. m - 1``) that
        layer keeps, which alone go on to the next layer (:attr:`m` becomes their
        number); None when all go on (or not layer-wise). Changes no K/V."""
        if self.targets is None or self.capture is None:
            return None
        count, n = self.counts[layer], self.m
        schedule = self.schedule
        assert schedule is not None
        quota = min(n, schedule.chunk_quota(layer, self.n, len(self.counts)))
        keep = keep_chunk(self.capture.scores[layer], count, n, self.targets[layer], quota, schedule)
        self.capture.keep[layer] = keep
        new = keep[keep >= count] - count
        if new.numel() == n:
            return None
        self.m = int(new.numel())
        return new

    def advance(self) -> None:
        """After the forward: every layer holds the chunk tokens it computed too."""
        self.packed.counts = [c + a for c, a in zip(self.packed.counts, self.added, strict=True)]
