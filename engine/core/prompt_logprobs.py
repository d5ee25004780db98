"""PromptLogprobs: the log-probability of every prompt token under the tokens before it.

vLLM's ``prompt_logprobs``: for prompt token ``p >= 1``, the log-softmax of the logits
at position ``p - 1`` evaluated at token ``p``, its rank among the vocabulary and the
``top`` most likely tokens; None for token 0. The logits of a prefill chunk
``[start, end)`` give the entries of tokens ``start + 1 .. end`` (those inside the
prompt): :meth:`PromptLogprobs.rows_for` says how many of its rows, :meth:`add`
scores them. The scores are computed :data:`SCORE_ROWS` rows at a time in float32,
so a long chunk never holds a float32 copy of all its logits.

A request asking for them computes its whole prompt (the scheduler gives it no
prefix-cache hit, as vLLM does): reused K/V have no logits. Preempted and
recomputed, it overwrites the same entries with the same values.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from engine.core.output_stream import TokenLogprobs

SCORE_ROWS = 128
"""Rows per float32 log-softmax."""


class PromptLogprobs:
    """The entries of one request's prompt, filled chunk by chunk."""

    def __init__(self, prompt: Sequence[int], top: int) -> None:
        self.prompt = prompt
        self.top = top
        self.entries: list[TokenLogprobs | None] = [None] * len(prompt)

    def rows_for(self, start: int, end: int) -> int:
        """How many rows of a chunk computing positions ``[start, end)`` predict a prompt token."""
        return max(0, min(end, len(self.prompt) - 1) - start)

    def add(self, start: int, logits: torch.Tensor) -> None:
        """Score ``logits`` (``[n, vocab]``, rows at positions ``start .. start + n - 1``)
        against prompt tokens ``start + 1 .. start + n``."""
        n = logits.shape[0]
        targets = torch.tensor(self.prompt[start + 1 : start + 1 + n], dtype=torch.long)
        for lo in range(0, n, SCORE_ROWS):
            logp = torch.log_softmax(logits[lo : lo + SCORE_ROWS].float(), dim=-1)
            tgt = targets[lo : lo + SCORE_ROWS]
            chosen = logp.gather(1, tgt[:, None])
            ranks = (logp > chosen).sum(dim=1) + 1
            best = torch.topk(logp, self.top, dim=-1) if self.top else None
            for i, (token, value, rank) in enumerate(zip(tgt.tolist(), chosen[:, 0].tolist(), ranks.tolist(),
                                                         strict=True)):
                top = [] if best is None else list(zip(best.indices[i].tolist(), best.values[i].tolist(), strict=True))
                self.entries[start + 1 + lo + i] = TokenLogprobs(token, value, top, rank)
