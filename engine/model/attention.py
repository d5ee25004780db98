"""Paged, length-invariant attention: the same bits for a token whatever the batch around it.

Each sequence of a flattened batch reads its keys and values straight from
:class:`~engine.model.kv_storage.KVStorage` through its block table (one
``index_select`` of :meth:`~engine.model.kv_storage.KVStorage.rows` per layer into a
transient buffer; no per-request cache is kept).

The engine computes a token either in one full pass over the prompt, over K/V
cached by an earlier request, alone or next to other requests, and greedy outputs
must not change between these. PyTorch's CPU flash-attention kernel does not allow
that: its reductions are cut by the total key length and the number of queries, so
a token's attention output moves with the length of the call (~1e-6 in float32; in
bfloat16 the output rounding turns that into logit differences of ~0.5 and
different greedy tokens). Here attention is plain matrix products, which are
row-independent on CPU (each query row's result depends only on that row and the
keys), one sequence at a time, with the key length padded to a multiple of
:data:`KV_PAD` so that vectorised reductions see the same shape of tail; padded
keys come from the storage's pad block or stale slots and are masked. Precision
matches transformers' "eager" attention: scores and probabilities in the model
dtype, softmax accumulated in float32.

The matrix products are row-independent only up to a row count. On a Xeon with AMX,
oneDNN's bfloat16 kernel for probabilities times values (``[rows, keys] @ [keys,
head_dim]``) sums a row's products over the keys in an order that depends on how many
rows the call has once the keys are many: at 2,048 keys calls of 36-48 rows round some
rows differently from calls of 4 or 768 rows, at 6-8k keys calls of 20-64 rows do;
calls of at most 16 rows (one AMX tile) agreed with each other at every length and
offset measured (256-8,192 keys). A cold prefill computes a token in a chunk of
``Q_CHUNK`` queries (``heads / kv_heads * 256`` rows per KV head), a cache hit in a
short tail (48 rows for a 16-token tail of the bundled model), a decode in 4: so that
product runs in tiles of at most :data:`PV_TILE` rows (:func:`_weighted_values`), and
the same token gets the same bits in all three. The scores product (``head_dim``
deep) showed no such dependence and runs whole. Price (``benchmarks/attention_tiles.py``,
bundled model, 2 threads): a cold 2k-token prefill 1.3x, 20 tokens over a cached 2k
prefix 1.1x, decode steps unchanged (their products have 4 rows per sequence).

The scores product is computed one of two ways with the same bits: ``q @ K^T`` (the
keys through a transposed view) for a prefill chunk, and ``K @ q^T``, transposed
back, for a decode or a chunk of few queries (at most :data:`KEYS_FIRST_ROWS` rows).
With few query rows the second reads the keys once, in their stored order: 8.8 ms
against 16.3 ms for 30 layers of 7.8k keys at 12 rows (2 threads, out of cache);
with many rows it is the slower one. :func:`keys_first_agrees` checks on a probe,
once, that the two give the same bits on this machine, and only then is the second
used (the same token must get the same scores in a prefill and in a decode).

The mask is by position: query ``i`` attends key ``j`` iff ``j <= position_i``; key
``j`` of a sequence is its position ``j`` (block tables are in position order).
Queries are processed in chunks of :data:`Q_CHUNK` rows, each over the keys it can
see, so a long prefill skips the masked upper triangle and bounds its scratch memory.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from engine.model import native
from engine.model.kv_mirror import MirrorUse
from engine.model.kv_storage import KVStorage
from engine.model.packed_attention import PackedChunk, PackedDecodes
from engine.model.pyramid import AttentionCapture

logger = logging.getLogger(__name__)

ATTN_IMPLEMENTATION = "prefixgate_paged_attention"
KV_PAD = 64
Q_CHUNK = 256
ROW_MULTIPLE = 4
"""Matrix products get a multiple of this many rows (see :func:`_pad_rows`)."""
PV_TILE = 16
"""Most rows per probabilities-times-values product (see :func:`_weighted_values`)."""


KEYS_FIRST_ROWS = 64
"""Query rows (per KV head) up to which scores are computed as ``K @ q^T`` (see the module docstring)."""
NATIVE_KEYS = 1024
"""Decode groups of at most this many keys (and no mirror) attend through the engine's
C library (:func:`engine.model.native.decode_scores` and ``decode_values``: no gather,
two calls for the four ops), where :func:`native_decodes_agree`. Measured: torch's
bfloat16 probabilities-times-values product sums 512 positions at a time up to 1,024
keys, 1,024 at a time from 2,048 (and the scores' 64 pairs in one): up to this length
one rule, :data:`NATIVE_CHUNK`."""
NATIVE_CHUNK = 512
NATIVE_SEQUENCES = 8
"""...and of at most this many sequences: with more, torch's batched products are faster
(a decode step of 16 sequences 23.7 ms native against 22.5 ms; of 8, 12.9 against 14.2;
of 1, 7.4 against 8.9)."""


@functools.cache
def keys_first_agrees() -> bool:
    """Whether ``K @ q^T`` (transposed) gives ``q @ K^T``'s bits here, in bfloat16 and
    float32, on a probe of the shapes attention uses (1-64 query rows, 64-8,192 keys)."""
    gen = torch.Generator().manual_seed(0)
    for dtype in (torch.bfloat16, torch.float32):
        for keys_n, rows in ((64, 4), (640, 12), (2048, 48), (8192, 12), (8192, 64)):
            k = torch.randn((3, keys_n, 64), generator=gen).to(dtype)
            q = torch.randn((3, rows, 64), generator=gen).to(dtype)
            if not torch.equal(torch.matmul(q, k.transpose(-1, -2)), _keys_first(q, k)):
                logger.warning("scores as K @ q^T differ from q @ K^T here (%s): decodes use q @ K^T", dtype)
                return False
    return True


@functools.cache
def native_decodes_agree(kv_heads: int, head_dim: int, block_size: int, rows: int) -> bool:
    """Whether the C decode products give this module's bits (:func:`_scores`, then
    :func:`_weighted_values` of torch's softmax) for decode groups of this layout with
    ``rows`` query rows per KV head: checked once, on random pools of 64, 640 and
    :data:`NATIVE_KEYS` keys, 4 sequences each."""
    if native.native_library() is None or head_dim != 64 or block_size % 16 or rows > 8:
        return False
    gen = torch.Generator().manual_seed(head_dim * 31 + rows)
    for length in (64, 640, NATIVE_KEYS):
        bps = -(-length // block_size)
        blocks = 4 * bps + 1
        keys, values = ((2 * torch.randn((kv_heads, blocks + 1, block_size, head_dim), generator=gen))
                        .to(torch.bfloat16) for _ in range(2))
        table = torch.randperm(blocks, generator=gen)[: 4 * bps]
        kv_rows = (torch.arange(kv_heads)[:, None] * (blocks + 1) + table[None, :]).reshape(-1)
        q = (2 * torch.randn((kv_heads, 4, rows, head_dim), generator=gen)).to(torch.bfloat16)
        k, v = (torch.index_select(t.view(-1, block_size, head_dim), 0, kv_rows).view(kv_heads, 4, -1, head_dim)
                for t in (keys, values))
        scores = _scores(q, k)
        probs = torch.softmax(scores, dim=-1)
        if not (torch.equal(native.decode_scores(q, keys, kv_rows, bps), scores)
                and torch.equal(native.decode_values(probs, values, kv_rows, bps, NATIVE_CHUNK),
                                _weighted_values(probs, v))):
            logger.warning("native decode attention off: its bits differ from torch's here")
            return False
    return True


def _keys_first(q: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """``q @ keys^T`` (``q``: ``[..., rows, d]``, ``keys``: ``[..., n, d]``) computed as
    ``keys @ q^T``, transposed back, contiguous."""
    return torch.matmul(keys, q.transpose(-1, -2)).transpose(-1, -2).contiguous()


def _scores(q: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """``q @ keys^T`` the faster of the two equal ways (see the module docstring)."""
    if q.shape[-2] <= KEYS_FIRST_ROWS and keys_first_agrees():
        return _keys_first(q, keys)
    return torch.matmul(q, keys.transpose(-1, -2))


def padded_length(n: int) -> int:
    """``n`` rounded up to a multiple of :data:`KV_PAD`."""
    return -(-n // KV_PAD) * KV_PAD


@dataclass(frozen=True)
class SequenceSlice:
    """One sequence's rows in a flattened batch.

    Rows ``row .. row + num_tokens - 1`` hold its tokens at positions ``start ..
    start + num_tokens - 1`` (or, with ``positions``, at those increasing positions,
    ``positions[0] == start``: runs of one request attended as one slice);
    ``kv_rows`` is :meth:`KVStorage.rows` of a block table covering at least
    ``padded_length(last position + 1)`` positions (padded with the storage's pad block).
    """

    row: int
    num_tokens: int
    start: int
    kv_rows: torch.Tensor
    masks: dict[int, torch.Tensor] = field(default_factory=dict, compare=False, repr=False)
    """Per query chunk start, the keys its rows must not see (filled by the first
    layer, reused by the others: the mask is by position, the same in every layer)."""
    positions: torch.Tensor | None = field(default=None, compare=False, repr=False)
    mirror: MirrorUse | None = field(default=None, compare=False, repr=False)
    """When set, keys and values are read from the request's mirror
    (:mod:`engine.model.kv_mirror`), not gathered through ``kv_rows``."""
    capture: AttentionCapture | None = field(default=None, compare=False, repr=False)
    """When set, each layer adds the attention of this slice's last ``capture.window``
    tokens over its keys to it (:mod:`engine.model.pyramid`); outputs are unchanged."""

    def chunk_mask(self, cs: int, first_hidden: int, seen: int, rows: int) -> torch.Tensor:
        """``[rows, seen - first_hidden]``: key ``first_hidden + j`` is after row ``i``'s position."""
        mask = self.masks.get(cs)
        if mask is None:
            positions = (torch.arange(self.start + cs, self.start + cs + rows) if self.positions is None
                         else self.positions[cs : cs + rows])
            mask = torch.arange(first_hidden, seen)[None, :] > positions[:, None]
            self.masks[cs] = mask
        return mask


@dataclass(frozen=True)
class DecodeGroup:
    """Single-token sequences whose block tables have the same length, attended together.

    ``rows[i]`` is the row of sequence ``i`` and ``kv_rows`` :meth:`KVStorage.rows` of
    their tables concatenated (``len(rows) * blocks_per_seq`` ids). ``hidden`` (``[1, n, 1,
    blocks_per_seq * block_size]``, bool) masks the keys sequence ``i`` must not see:
    those after its token's position (computed once per forward, used by every layer).
    """

    rows: torch.Tensor
    kv_rows: torch.Tensor
    blocks_per_seq: int
    hidden: torch.Tensor
    mirror: MirrorUse | None = None
    """A group of one sequence may read its keys and values from its mirror
    (:mod:`engine.model.kv_mirror`) instead of gathering them."""
    first_row: int | None = None
    """``rows[0]`` when the rows are consecutive (then queries and outputs are read and
    written through slices, not gathered and scattered), else None."""
    queries: list[torch.Tensor] = field(default_factory=list, compare=False, repr=False)
    """Scratch for the scaled queries, ``[kv_heads, n, groups padded to ROW_MULTIPLE,
    head_dim]``, zeroed once per forward: every layer overwrites the same rows, so the
    padding rows stay zero."""

    @classmethod
    def build(cls, rows: Sequence[int], positions: Sequence[int], tables: Sequence[Sequence[int]],
              storage: KVStorage, mirror: MirrorUse | None = None) -> DecodeGroup:
        """The group of sequences at ``rows`` whose tokens sit at ``positions``, with
        block ``tables`` of equal length in ``storage`` (one sequence with a ``mirror``)."""
        if mirror is not None and len(rows) != 1:
            raise ValueError(f"a mirrored decode group has one sequence, got {len(rows)}")
        length = len(tables[0]) * storage.layout.block_size
        hidden = torch.arange(length)[None, :] > torch.tensor(positions, dtype=torch.long)[:, None]
        return cls(
            rows=torch.tensor(rows, dtype=torch.long),
            kv_rows=storage.rows([b for t in tables for b in t]),
            blocks_per_seq=len(tables[0]),
            hidden=hidden[None, :, None, :],
            mirror=mirror,
            first_row=rows[0] if list(rows) == list(range(rows[0], rows[0] + len(rows))) else None,
        )


@dataclass(frozen=True)
class AttentionBatch:
    """What attention needs to know about a flattened batch: where each new token's
    K/V go (``slots``, one per row, padding rows included), the multi-token sequences
    (prefill chunks) and the single-token ones (decodes), grouped."""

    storage: KVStorage
    slots: torch.Tensor
    sequences: Sequence[SequenceSlice]
    decode_groups: Sequence[DecodeGroup] = ()
    packed: PackedDecodes | None = None
    """Compressed requests' decodes (:mod:`engine.model.packed_attention`); their rows'
    ``slots`` are the pad slot."""
    packed_chunks: Sequence[PackedChunk] = ()
    """Compressed requests' prefill chunks over their packed pages (pad slots too)."""

    @property
    def exact_rows(self) -> int | None:
        """Where the packed chunks' rows begin: the rows before it need row-invariant
        products, the chunks' rows do not (compressed K/V, private to their request).
        The runner puts the chunks last (only padding follows them), and a layer-wise
        chunk's dropped rows leave from among them, so this holds in every layer.
        None: every row does."""
        return min((c.row for c in self.packed_chunks), default=None)


def _pad_rows(q: torch.Tensor) -> torch.Tensor:
    """``q`` (``[..., m, head_dim]``) with zero rows appended up to a multiple of
    :data:`ROW_MULTIPLE`: a CPU matrix product rounds rows differently with 1-3 rows."""
    extra = -q.shape[-2] % ROW_MULTIPLE
    if not extra:
        return q
    return torch.cat([q, q.new_zeros((*q.shape[:-2], extra, q.shape[-1]))], dim=-2)


def _weighted_values(probs: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """``probs @ values`` in calls of at most :data:`PV_TILE` rows (``probs``' dim -2):
    past 16 rows the bfloat16 kernel's reduction over the keys depends on the row count."""
    rows = probs.shape[-2]
    if rows <= PV_TILE:
        return torch.matmul(probs, values)
    return torch.cat([torch.matmul(probs[..., r : r + PV_TILE, :], values) for r in range(0, rows, PV_TILE)], dim=-2)


def paged_attention(
    layer: int,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    batch: AttentionBatch,
    scale: float,
) -> torch.Tensor:
    """Write the batch's new ``key``/``value`` (``[T, kv_heads, head_dim]``) into their
    slots, then attend every sequence's queries (``query``: ``[T, heads, head_dim]``)
    over its keys. Returns ``[T, heads * head_dim]`` (zeros on padding rows). ``T`` may
    be less than the batch's rows once layer-wise chunks dropped some (their rows and
    the padding, the last ones, all have the pad slot)."""
    batch.storage.write(layer, batch.slots[: key.shape[0]], key, value)
    for mirror in [*(s.mirror for s in batch.sequences), *(g.mirror for g in batch.decode_groups)]:
        if mirror is not None:
            mirror.update(layer, key, value)
    out = query.new_zeros((query.shape[0], query.shape[1] * query.shape[2]))
    for group in batch.decode_groups:
        _attend_decodes(layer, query, batch.storage, group, scale, out)
    for seq in batch.sequences:
        _attend_sequence(layer, query, batch.storage, seq, scale, out)
    if batch.packed is not None:
        batch.packed.attend(layer, query, key, value, scale, out)
    for chunk in batch.packed_chunks:
        chunk.attend(layer, query, key, value, scale, out)
    return out


def _attend_decodes(
    layer: int, query: torch.Tensor, storage: KVStorage, group: DecodeGroup, scale: float, out: torch.Tensor
) -> None:
    kv_heads, head_dim = storage.layout.kv_heads, storage.layout.head_dim
    heads = query.shape[1]
    groups = heads // kv_heads
    n = group.rows.numel()
    block_size = storage.layout.block_size
    length = group.blocks_per_seq * block_size
    if not group.queries:
        group.queries.append(query.new_zeros((kv_heads, n, groups + (-groups % ROW_MULTIPLE), head_dim)))
    q = group.queries[0]  # the same values as _pad_rows(query[rows] * scale), in two ops
    first = group.first_row
    mine = query[first : first + n] if first is not None else torch.index_select(query, 0, group.rows)
    torch.mul(mine.view(n, kv_heads, groups, head_dim).transpose(0, 1), scale, out=q[:, :, :groups])
    native_path = (group.mirror is None and length <= NATIVE_KEYS and n <= NATIVE_SEQUENCES
                   and q.dtype == torch.bfloat16
                   and native_decodes_agree(kv_heads, head_dim, block_size, q.shape[2]))
    if native_path:  # the same products read from the pool in place (see NATIVE_KEYS)
        scores = native.decode_scores(q, storage.keys[layer], group.kv_rows, group.blocks_per_seq)
    else:
        if group.mirror is not None:
            keys, values = (t.unsqueeze(1) for t in group.mirror.kv(layer))
        else:
            keys, values = storage.gather(layer, group.kv_rows)
            keys, values = keys.view(kv_heads, n, length, head_dim), values.view(kv_heads, n, length, head_dim)
        scores = _scores(q, keys)  # [kv_heads, n, padded groups, length]
    scores.masked_fill_(group.hidden, float("-inf"))
    probs = torch.softmax(scores, dim=-1)  # accumulates in float32 for bfloat16 input
    if native_path:
        values_out = native.decode_values(probs, storage.values[layer], group.kv_rows, group.blocks_per_seq,
                                          NATIVE_CHUNK)
    else:
        values_out = _weighted_values(probs, values)
    chunk = values_out[:, :, :groups]  # [kv_heads, n, groups, head_dim]
    # head h of a row is kv head h // groups, query group h % groups (transformers' GQA order)
    if first is not None:
        out[first : first + n].view(n, kv_heads, groups, head_dim).copy_(chunk.transpose(0, 1))
    else:
        out.view(-1, kv_heads, groups, head_dim).index_copy_(0, group.rows, chunk.transpose(0, 1))


def _attend_sequence(
    layer: int, query: torch.Tensor, storage: KVStorage, seq: SequenceSlice, scale: float, out: torch.Tensor
) -> None:
    kv_heads, head_dim = storage.layout.kv_heads, storage.layout.head_dim
    heads = query.shape[1]
    group = heads // kv_heads
    keys, values = seq.mirror.kv(layer) if seq.mirror is not None else storage.gather(layer, seq.kv_rows)
    q_all = query[seq.row : seq.row + seq.num_tokens] * scale
    for cs in range(0, seq.num_tokens, Q_CHUNK):
        ce = min(seq.num_tokens, cs + Q_CHUNK)
        rows = ce - cs
        if seq.positions is None:
            first_pos, last_pos = seq.start + cs, seq.start + ce - 1
        else:
            first_pos, last_pos = int(seq.positions[cs]), int(seq.positions[ce - 1])
        seen = min(padded_length(last_pos + 1), keys.shape[1])
        q = q_all[cs:ce].view(rows, kv_heads, group, head_dim).permute(1, 2, 0, 3)
        q = _pad_rows(q.reshape(kv_heads, group * rows, head_dim))
        scores = _scores(q, keys[:, :seen])
        first_hidden = first_pos + 1  # keys before this are seen by every row
        if first_hidden < seen:
            tail = scores[:, : group * rows].view(kv_heads, group, rows, seen)[..., first_hidden:]
            tail.masked_fill_(seq.chunk_mask(cs, first_hidden, seen, rows), float("-inf"))
        probs = torch.softmax(scores, dim=-1)  # accumulates in float32 for bfloat16 input
        if seq.capture is not None:
            seq.capture.add(layer, probs[:, : group * rows].view(kv_heads, group, rows, seen), cs, seq.num_tokens)
        chunk = _weighted_values(probs, values[:, :seen])[:, : group * rows]
        chunk = chunk.view(kv_heads, group, rows, head_dim).permute(2, 0, 1, 3)
        out[seq.row + cs : seq.row + ce] = chunk.reshape(rows, heads * head_dim)


def transformers_attention(
    module: Any,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """:func:`paged_attention` behind transformers' attention interface (the generic
    forward): ``query``/``key``/``value`` are ``[1, heads, T, head_dim]`` for the whole
    flattened batch, the batch comes in ``kwargs["paged_batch"]``; returns ``[1, T,
    heads, head_dim]``."""
    batch = kwargs.get("paged_batch")
    if not isinstance(batch, AttentionBatch) or query.shape[0] != 1:
        raise ValueError(f"{ATTN_IMPLEMENTATION} needs a paged_batch and one flattened sequence")
    head_dim = query.shape[-1]
    scale = scaling if scaling is not None else head_dim**-0.5
    out = paged_attention(
        module.layer_idx, query[0].transpose(0, 1), key[0].transpose(0, 1), value[0].transpose(0, 1),
        batch, scale,
    )
    return out.view(1, out.shape[0], -1, head_dim), None


def check_supported(config: Any) -> None:
    """Raise ValueError for attention this module does not implement (sliding windows,
    logit soft-capping)."""
    if getattr(config, "sliding_window", None) and getattr(config, "use_sliding_window", True):
        raise ValueError(f"sliding-window attention ({config.sliding_window}) is not supported")
    if getattr(config, "attn_logit_softcapping", None):
        raise ValueError("attention logit soft-capping is not supported")


def install(model: Any) -> None:
    """Register :func:`transformers_attention` and make ``model`` use it (the generic
    forward). Raises ValueError for unsupported attention (:func:`check_supported`)."""
    from transformers import AttentionInterface

    check_supported(model.config)
    AttentionInterface.register(ATTN_IMPLEMENTATION, transformers_attention)
    model.config._attn_implementation = ATTN_IMPLEMENTATION
