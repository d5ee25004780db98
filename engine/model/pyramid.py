"""PyramidSchedule: which tokens each layer of a compressed request keeps (PyramidInfer-style).

PyramidInfer (and SnapKV/PyramidKV at the end of prefill) keep, per layer, the
context tokens the most recent tokens attend to, and fewer of them in deeper
layers. Here, in the forward that computes a compressed request's last prompt
chunk, every layer adds the attention probabilities of the chunk's last
``window`` queries over the keys, summed over heads and queries
(:class:`AttentionCapture`, filled by :mod:`engine.model.attention`); then layer
``l`` keeps the ``window`` most recent tokens plus the best-scored others, up to
``ceil(retention(l) * tokens)``, with ``retention`` falling from 1.0 at layer 0
to ``min_retention`` at the last layer along ``(1 - l / (L - 1)) ** 2`` (most
layers are deep and cheap). :func:`gather` copies the kept K/V (RoPE'd at their
original positions) out of the exact blocks, for a :class:`~engine.model.packed_kv.PackedKV`.

When the last chunk has fewer than ``window`` tokens, the scores come from those
it has (a prompt cut into chunks ends with a short one only when its length is just
past a multiple of the chunk budget).

Selection again while decoding (``PyramidSchedule.reselect``, on by default): every
``window`` decoded tokens, the attention those decode queries paid to each packed
token, per layer (summed over heads, :class:`~engine.model.packed_attention.PackedDecodes`),
picks again: layer ``l`` keeps its ``window`` most recent tokens plus the best-scored
others up to ``ceil(retention(l) * length)`` of the sequence's current length
(:func:`reselect`). With ``progressive``, the prefill is compressed as soon as a chunk
reaches ``min_tokens`` and every later chunk (at most ``chunk`` tokens) is computed over
the packed pages and selects again from its own last ``window`` queries, so the exact
blocks of a long prompt are never all held. So a layer holds at most ``keep(length) + window`` tokens
(:meth:`PyramidSchedule.held_counts`), and the request's reservation follows that.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from engine.model.kv_storage import KVStorage
from engine.model.packed_kv import PackedKV

DEFAULT_MIN_RETENTION = 0.2
DEFAULT_WINDOW = 32
DEFAULT_MIN_TOKENS = 128
DEFAULT_CHUNK = 128
LAYERWISE_CHUNK = 512
"""The chunk of ``--kv-layerwise``: measured on the bundled model (docs/engine.md), 512
prefills a 2,048-token prompt in 0.70x the time of progressive packing at the same
chunk (0.79x at 256) with perplexity 1.07x exact (1.12x at 256: a larger chunk's
selection sees more of the prompt)."""


@dataclass(frozen=True)
class PyramidSchedule:
    """The retention per layer and the recent window; prompts shorter than
    ``min_tokens`` stay exact (there is too little to gain)."""

    min_retention: float = DEFAULT_MIN_RETENTION
    window: int = DEFAULT_WINDOW
    min_tokens: int = DEFAULT_MIN_TOKENS
    pool: int = 1
    """Odd width of the moving average applied to the scores before picking (1: none)."""
    reselect: bool = True
    """Select again every ``window`` decoded tokens (else decode tokens are all kept)."""
    progressive: bool = False
    """Compress after the first prefill chunk that reaches ``min_tokens``; later chunks
    are computed over the packed pages (at most ``chunk`` tokens each) and select again."""
    chunk: int = DEFAULT_CHUNK
    layerwise: bool = False
    """With ``progressive``, the paper's prefill: a chunk's token that layer ``l``'s
    selection drops is not computed in the layers after ``l`` (its K/V there could never
    be kept), so deeper layers compute fewer rows (:meth:`PackedChunk.survivors`)."""

    def __post_init__(self) -> None:
        if not isinstance(self.min_retention, int | float) or not 0 < self.min_retention <= 1:
            raise ValueError(f"min_retention must be in (0, 1], got {self.min_retention!r}")
        if not isinstance(self.window, int) or self.window < 1:
            raise ValueError(f"window must be an int >= 1, got {self.window!r}")
        if not isinstance(self.min_tokens, int) or self.min_tokens < 1:
            raise ValueError(f"min_tokens must be an int >= 1, got {self.min_tokens!r}")
        if not isinstance(self.chunk, int) or self.chunk < 1:
            raise ValueError(f"chunk must be an int >= 1, got {self.chunk!r}")

    def retention(self, layer: int, num_layers: int) -> float:
        depth = layer / (num_layers - 1) if num_layers > 1 else 0.0
        return self.min_retention + (1.0 - self.min_retention) * (1.0 - depth) ** 2

    def keep_counts(self, num_tokens: int, num_layers: int) -> list[int]:
        """Tokens each layer keeps of ``num_tokens``."""
        return [min(num_tokens, max(self.window, math.ceil(self.retention(layer, num_layers) * num_tokens)))
                for layer in range(num_layers)]


    def chunk_rows(self, n: int, num_layers: int) -> list[int]:
        """Rows each layer computes of an ``n``-token layer-wise chunk: all in layer 0,
        then what the layer before kept of it (:func:`keep_chunk`'s quota: its
        ``window`` most recent plus its best others up to ``retention(l) * n``)."""
        rows = [n]
        for layer in range(num_layers - 1):
            rows.append(min(rows[-1], self.chunk_quota(layer, n, num_layers)))
        return rows

    def chunk_quota(self, layer: int, n: int, num_layers: int) -> int:
        """Tokens layer ``layer`` keeps of an ``n``-token layer-wise chunk at most."""
        return min(n, max(self.window, math.ceil(self.retention(layer, num_layers) * n)))

    def held_counts(self, prefill_tokens: int, total_tokens: int, num_layers: int) -> list[int]:
        """The most tokens each layer of a request whose prefill ends at ``prefill_tokens``
        holds while it grows to ``total_tokens``: with re-selection, what the last
        selection kept plus the ``window`` decoded since, or while a progressive chunk
        is computed (:meth:`chunk_peaks`); without, the prefill's selection plus every
        decoded token (or a chunk)."""
        if self.reselect:
            peaks = self.chunk_peaks(prefill_tokens, num_layers) if self.progressive else [0] * num_layers
            return [min(total_tokens, max(p, keep + self.window))
                    for p, keep in zip(peaks, self.keep_counts(total_tokens, num_layers), strict=True)]
        chunk = max(self.window, self.chunk) if self.progressive else 0
        return [min(total_tokens, keep + max(total_tokens - prefill_tokens, chunk))
                for keep in self.keep_counts(prefill_tokens, num_layers)]

    def chunk_peaks(self, prefill_tokens: int, num_layers: int) -> list[int]:
        """Per layer, the most tokens it holds while a progressive prefill ending at
        ``prefill_tokens`` computes a chunk: what the selection before the chunk kept
        (``keep_counts(start)``) plus the chunk's rows it writes (all of them, or
        layer-wise :meth:`chunk_rows`), over every chunk of ``n <= max(window, chunk)``
        tokens that can start at ``start <= prefill_tokens - n``. Layer-wise, a longer
        chunk starts earlier: its rows in a deep layer grow by about that layer's
        retention as what was kept before it shrinks by about the same."""
        return list(_chunk_peaks(self, prefill_tokens, num_layers))


@functools.lru_cache(maxsize=1024)
def _chunk_peaks(schedule: PyramidSchedule, prefill_tokens: int, num_layers: int) -> tuple[int, ...]:
    """:meth:`PyramidSchedule.chunk_peaks`, over all chunk sizes at once (float64, the
    same rounding as :meth:`~PyramidSchedule.keep_counts` and :meth:`~PyramidSchedule.chunk_quota`)."""
    size = min(max(schedule.window, schedule.chunk), prefill_tokens)
    n = torch.arange(1, size + 1, dtype=torch.float64)
    before = prefill_tokens - n
    peaks = []
    rows = n
    for layer in range(num_layers):
        r = schedule.retention(layer, num_layers)
        kept = torch.minimum(before, torch.clamp(torch.ceil(r * before), min=schedule.window))
        peaks.append(int((kept + rows).max()) if size else 0)
        if schedule.layerwise:  # the next layer computes what this one's quota keeps of the chunk
            rows = torch.minimum(rows, torch.minimum(n, torch.clamp(torch.ceil(r * n), min=schedule.window)))
    return tuple(peaks)


@dataclass
class AttentionCapture:
    """Per layer, the attention the last ``window`` tokens of one sequence's chunk pay
    to each key, summed over heads and those queries (float32)."""

    window: int
    scores: dict[int, torch.Tensor] = field(default_factory=dict)
    keep: dict[int, torch.Tensor] = field(default_factory=dict)
    """Per layer, the selection a layer-wise chunk made inside its forward
    (:func:`keep_chunk`), applied as it is after the forward."""

    def add(self, layer: int, probs: torch.Tensor, first_row: int, num_rows: int) -> None:
        """``probs``: ``[kv_heads, groups, rows, keys]`` of query rows ``first_row ..`` of a
        slice of ``num_rows`` rows; only the rows among the slice's last ``window`` count."""
        lo = max(0, num_rows - self.window - first_row)
        if lo >= probs.shape[2]:
            return
        summed = probs[:, :, lo:].float().sum(dim=(0, 1, 2))
        have = self.scores.get(layer)
        if have is None:
            self.scores[layer] = summed
            return
        if have.numel() < summed.numel():
            have = torch.cat([have, have.new_zeros(summed.numel() - have.numel())])
        have[: summed.numel()] += summed
        self.scores[layer] = have


def select(capture: AttentionCapture, schedule: PyramidSchedule, num_tokens: int,
           num_layers: int) -> list[torch.Tensor]:
    """Per layer, the sorted positions (of ``0 .. num_tokens - 1``) it keeps."""
    keep: list[torch.Tensor] = []
    recent_from = max(0, num_tokens - schedule.window)
    for layer, count in enumerate(schedule.keep_counts(num_tokens, num_layers)):
        scores = capture.scores.get(layer)
        if scores is None:
            raise ValueError(f"no attention captured for layer {layer}")
        scores = scores[:num_tokens].clone()
        if schedule.pool > 1:  # SnapKV's pooling: keep a chosen token's neighbours too
            scores = F.avg_pool1d(scores[None, None], schedule.pool, stride=1, padding=schedule.pool // 2,
                                  count_include_pad=False)[0, 0, :num_tokens]
        scores[recent_from:] = float("inf")
        chosen = torch.topk(scores, count).indices
        keep.append(torch.sort(chosen).values)
    return keep


def keep_among(scores: torch.Tensor, held: int, target: int, schedule: PyramidSchedule) -> torch.Tensor:
    """The sorted indices (of ``0 .. held - 1``) a layer holding ``held`` tokens keeps
    when it may keep ``target``: all when ``held <= target``, else its ``window`` most
    recent plus the best ``scores`` (attention paid to each; missing entries count 0;
    of equal scores, the earlier token). The one rule of :func:`reselect` and of a
    layer-wise chunk's in-forward selection
    (:meth:`~engine.model.packed_attention.PackedChunk.survivors`): both give the same
    answer on the same scores (:func:`keep_among_layers` with one layer)."""
    return keep_among_layers(scores[None], [held], [target], schedule)[0]


def keep_among_layers(scores: torch.Tensor, held: Sequence[int], targets: Sequence[int],
                      schedule: PyramidSchedule) -> list[torch.Tensor]:
    """:func:`keep_among` for every layer at once (``scores``: ``[layers, n]``, layer
    ``l`` holding ``held[l]`` tokens and keeping ``targets[l]``): one sort over all
    layers rather than a few ops per layer."""
    layers, width = len(held), max(held, default=0)
    padded = torch.zeros((layers, width))
    have = min(scores.shape[1], width)
    padded[:, :have] = scores[:, :have]
    if schedule.pool > 1:  # SnapKV's pooling: keep a chosen token's neighbours too (per layer: its own length)
        for layer, h in enumerate(held):
            padded[layer, :h] = F.avg_pool1d(padded[None, None, layer, :h], schedule.pool, stride=1,
                                             padding=schedule.pool // 2, count_include_pad=False)[0, 0, :h]
    position = torch.arange(width)
    ends = torch.tensor(list(held), dtype=torch.long)[:, None]
    padded.masked_fill_(position >= ends - schedule.window, float("inf"))  # the recent window
    padded.masked_fill_(position >= ends, float("-inf"))  # nothing past what the layer holds
    take = torch.minimum(ends, torch.tensor(list(targets), dtype=torch.long)[:, None])
    order = torch.sort(padded, dim=1, descending=True, stable=True).indices
    chosen = torch.zeros((layers, width), dtype=torch.bool).scatter_(1, order, position < take)
    return list(torch.split(chosen.nonzero()[:, 1], take[:, 0].tolist()))


def keep_chunk(scores: torch.Tensor, old: int, new: int, target: int, quota: int,
               schedule: PyramidSchedule) -> torch.Tensor:
    """A layer-wise chunk's selection in one layer, which holds ``old`` kept tokens and
    the chunk's ``new``: the sorted indices it keeps, at most ``target``. Of the chunk,
    its ``window`` most recent plus its best-scored others, ``quota`` in all (so the
    rows of the layers below are known in advance: :meth:`PyramidSchedule.chunk_rows`);
    of the old, the best-scored for the rest. A chunk's own last queries favour the
    chunk's tokens: without a quota a chunk keeps nearly all of itself, pushes older
    context out, and deeper layers compute nearly every row."""
    if old + new <= target and new <= quota:
        return torch.arange(old + new)
    chunk_keep = keep_among(scores[old : old + new], new, min(new, quota), schedule) + old
    rest = min(old, target - chunk_keep.numel())
    if rest <= 0:
        return chunk_keep
    old_scores = torch.zeros(old)
    have = scores[:old]
    old_scores[: have.numel()] = have
    old_keep = torch.sort(torch.topk(old_scores, rest).indices).values
    return torch.cat([old_keep, chunk_keep])


def reselect(packed: PackedKV, schedule: PyramidSchedule, num_tokens: int) -> list[torch.Tensor]:
    """Per layer, the sorted packed indices (of ``0 .. packed.counts[l] - 1``) it keeps
    once the sequence has ``num_tokens`` tokens (:func:`keep_among` with
    ``keep_counts(num_tokens)``), by the attention of the decode queries since the
    last selection, or of a progressive chunk's last queries (``packed.scores``)."""
    return keep_among_layers(packed.scores, packed.counts, schedule.keep_counts(num_tokens, packed.num_layers),
                             schedule)


def gather(storage: KVStorage, block_ids: Sequence[int], keep: Sequence[torch.Tensor],
           ) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per layer, copies of the K/V (``[n, kv_heads, head_dim]``) of its kept token
    positions ``keep[l]`` from the exact block table ``block_ids``."""
    lay = storage.layout
    bs = lay.block_size
    table = torch.as_tensor(list(block_ids), dtype=torch.long)
    out = []
    for layer, positions in enumerate(keep):
        slots = table[positions // bs] * bs + positions % bs
        keys = storage.keys[layer].view(lay.kv_heads, -1, lay.head_dim).index_select(1, slots)
        values = storage.values[layer].view(lay.kv_heads, -1, lay.head_dim).index_select(1, slots)
        out.append((keys.transpose(0, 1), values.transpose(0, 1)))
    return out
