"""Length-invariant attention: the same bits for a token whatever the sequence around it.

The engine computes a token either in one full pass over the prompt or over K/V
gathered from the prefix cache, and greedy outputs must not change between the
two. PyTorch's CPU flash-attention kernel does not allow that: its reductions
are cut by the total key length and the number of queries, so a token's
attention output moves with the length of the call (~1e-6 in float32; in
bfloat16 the output rounding turns that into logit differences of ~0.5 and
different greedy tokens). This module computes attention with plain matrix
products instead, which are row-independent on CPU (each query row's result
depends only on that row and the keys), and pads the key length to a multiple of
:data:`KV_PAD` so that vectorised reductions see the same shape of tail; padded
keys are zero and masked. Precision matches transformers' "eager" attention:
scores and probabilities in the model dtype, softmax accumulated in float32.

The mask is derived from ``position_ids``: query ``i`` attends key ``j`` iff
``j <= position_i``; this relies on key index ``j`` holding position ``j``, which
the engine's working caches guarantee (contiguous from position 0). Queries are
processed in chunks of :data:`Q_CHUNK` rows, each over the keys it can see, so a
long prefill skips the masked upper triangle and bounds its scratch memory.
"""

from __future__ import annotations

from typing import Any

import torch

ATTN_IMPLEMENTATION = "prefixgate_attention"
KV_PAD = 64
Q_CHUNK = 256


def padded_length(n: int) -> int:
    """``n`` rounded up to a multiple of :data:`KV_PAD`."""
    return -(-n // KV_PAD) * KV_PAD


def position_masked_attention(
    module: Any,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """Causal attention by position for one sequence; returns ``[1, q, heads, head_dim]``."""
    position_ids = kwargs.get("position_ids")
    if position_ids is None or query.shape[0] != 1:
        raise ValueError(f"{ATTN_IMPLEMENTATION} needs position_ids and a batch of one sequence")
    _, heads, num_q, head_dim = query.shape
    kv_heads = key.shape[1]
    group = heads // kv_heads
    scale = scaling if scaling is not None else head_dim**-0.5
    positions = position_ids[0].tolist()
    key_index = torch.arange(key.shape[2])
    out = query.new_empty((1, num_q, heads, head_dim))
    for start in range(0, num_q, Q_CHUNK):
        end = min(num_q, start + Q_CHUNK)
        rows = end - start
        seen = min(padded_length(max(positions[start:end]) + 1), key.shape[2])
        q = query[:, :, start:end].reshape(1, kv_heads, group * rows, head_dim) * scale
        scores = torch.matmul(q, key[:, :, :seen].transpose(-1, -2))
        first_hidden = min(positions[start:end]) + 1  # keys before this are seen by every row
        if first_hidden < seen:
            hidden = key_index[None, first_hidden:seen] > position_ids[0, start:end, None]
            tail = scores.view(1, kv_heads, group, rows, seen)[..., first_hidden:]
            tail.masked_fill_(hidden, float("-inf"))
        probs = torch.softmax(scores, dim=-1)  # accumulates in float32 for bfloat16 input
        chunk = torch.matmul(probs, value[:, :, :seen])
        out[:, start:end] = chunk.view(1, heads, rows, head_dim).transpose(1, 2)
    return out, None


def install(model: Any) -> None:
    """Register the attention function and make ``model`` use it.

    Raises ValueError for models whose attention is not plain causal attention
    (sliding windows, logit soft-capping), which this function does not implement.
    """
    from transformers import AttentionInterface

    config = model.config
    if getattr(config, "sliding_window", None) and getattr(config, "use_sliding_window", True):
        raise ValueError(f"sliding-window attention ({config.sliding_window}) is not supported")
    if getattr(config, "attn_logit_softcapping", None):
        raise ValueError("attention logit soft-capping is not supported")

    AttentionInterface.register(ATTN_IMPLEMENTATION, position_masked_attention)
    model.config._attn_implementation = ATTN_IMPLEMENTATION
