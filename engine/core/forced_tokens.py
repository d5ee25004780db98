"""ForcedTokens: a sampling constraint that admits exactly one given token sequence.

Teacher forcing through the sampler's constraint interface (``mask`` / ``accept``,
as :mod:`engine.structured.grammar` implements it): the request generates exactly
``tokens``, and with ``SamplingParams.logprobs`` set it reports each one's
log-probability under the raw model distribution (the sampler scores before any
constraint). So a continuation can be scored under whatever KV the request decodes
with, compressed or exact (``benchmarks/kv_compression.py``). One object per request:
it advances as tokens are accepted.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


class ForcedTokens:
    """Allows ``tokens[i]`` at step ``i``; give the request ``max_tokens=len(tokens)``."""

    def __init__(self, tokens: Sequence[int]) -> None:
        if not tokens:
            raise ValueError("ForcedTokens needs at least one token")
        self.tokens = list(tokens)
        self.step = 0

    def mask(self, logits: torch.Tensor) -> torch.Tensor:
        """``logits`` with every token but the next forced one at -inf (a new tensor)."""
        if self.step >= len(self.tokens):
            raise ValueError(f"all {len(self.tokens)} forced tokens were already generated")
        out = torch.full_like(logits, float("-inf"))
        token = self.tokens[self.step]
        out[token] = logits[token]
        return out

    def accept(self, token: int) -> None:
        if token != self.tokens[self.step]:
            raise ValueError(f"forced token {self.tokens[self.step]} expected, got {token}")
        self.step += 1
