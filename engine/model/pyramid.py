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
    chunk: int = 128

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


    def held_counts(self, prefill_tokens: int, total_tokens: int, num_layers: int) -> list[int]:
        """The most tokens each layer of a request whose prefill ends at ``prefill_tokens``
        holds while it grows to ``total_tokens``: with re-selection, what the last
        selection kept plus the ``window`` decoded since (or a progressive chunk);
        without, the prefill's selection plus every decoded token (or a chunk)."""
        chunk = max(self.window, self.chunk) if self.progressive else 0  # while prefilling
        at_prefill = self.keep_counts(prefill_tokens, num_layers)
        if self.reselect:
            return [min(total_tokens, max(p + chunk, keep + self.window))
                    for p, keep in zip(at_prefill, self.keep_counts(total_tokens, num_layers), strict=True)]
        return [min(total_tokens, keep + max(total_tokens - prefill_tokens, chunk)) for keep in at_prefill]


@dataclass
class AttentionCapture:
    """Per layer, the attention the last ``window`` tokens of one sequence's chunk pay
    to each key, summed over heads and those queries (float32)."""

    window: int
    scores: dict[int, torch.Tensor] = field(default_factory=dict)

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


def reselect(packed: PackedKV, schedule: PyramidSchedule, num_tokens: int) -> list[torch.Tensor]:
    """Per layer, the sorted packed indices (of ``0 .. packed.counts[l] - 1``) it keeps
    once the sequence has ``num_tokens`` tokens: all when the layer holds no more than
    ``keep_counts(num_tokens)``, else its ``window`` most recent plus the most attended
    by the decode queries since the last selection (``packed.scores``)."""
    keep: list[torch.Tensor] = []
    targets = schedule.keep_counts(num_tokens, packed.num_layers)
    for layer, (held, target) in enumerate(zip(packed.counts, targets, strict=True)):
        if held <= target:
            keep.append(torch.arange(held))
            continue
        scores = torch.zeros(held)
        have = packed.scores[layer, :held]
        scores[: have.numel()] = have
        if schedule.pool > 1:
            scores = F.avg_pool1d(scores[None, None], schedule.pool, stride=1, padding=schedule.pool // 2,
                                  count_include_pad=False)[0, 0, :held]
        scores[max(0, held - schedule.window):] = float("inf")
        keep.append(torch.sort(torch.topk(scores, target).indices).values)
    return keep


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
