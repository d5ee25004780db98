"""Sampler: picks the next token from one request's logits.

Greedy when ``params.greedy`` (temperature below 1e-5, 0 included: tinier
temperatures overflow the division); otherwise logits are divided by the
temperature, cut to the ``top_k`` largest and to the smallest set whose
probability reaches ``top_p``, and a token is drawn with the request's own
``torch.Generator``, so a seeded request draws the same tokens whatever else runs.
A request with a grammar ``constraint`` samples from the tokens the grammar
allows, and the constraint then advances past the token picked.
:func:`token_logprobs` reports log-probabilities of the raw model distribution
(before temperature, top-k/p and the grammar), as vLLM does by default.
"""

from __future__ import annotations

import torch

from engine.core.output_stream import TokenLogprobs
from engine.core.sampling_params import SamplingParams


def make_generator(params: SamplingParams, fallback_seed: int) -> torch.Generator:
    """The request's generator: seeded with ``params.seed`` when set, else ``fallback_seed``."""
    gen = torch.Generator()
    gen.manual_seed(params.seed if params.seed is not None else fallback_seed)
    return gen


def sample(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator) -> int:
    """One token id from 1-D float logits."""
    if params.constraint is not None:
        token = _pick(params.constraint.mask(logits), params, generator)
        params.constraint.accept(token)
        return token
    return _pick(logits, params, generator)


def token_logprobs(logits: torch.Tensor, token: int, top: int) -> TokenLogprobs:
    """The log-probability of ``token`` and of the ``top`` most likely tokens."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    best = torch.topk(logp, top) if top else None
    alternatives = [] if best is None else list(zip(best.indices.tolist(), best.values.tolist(), strict=True))
    return TokenLogprobs(token, float(logp[token]), alternatives)


def _pick(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator) -> int:
    if params.greedy:
        return int(torch.argmax(logits).item())
    scaled = logits.float() / params.temperature
    if params.top_k is not None and params.top_k < scaled.numel():
        kth = torch.topk(scaled, params.top_k).values[-1]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    if params.top_p < 1.0:
        scaled = _top_p_filter(scaled, params.top_p)
    probs = torch.softmax(scaled, dim=-1)
    return int(torch.multinomial(probs, 1, generator=generator).item())


def _top_p_filter(logits: torch.Tensor, top_p: float) -> torch.Tensor:
    """Keep the most likely tokens whose cumulative probability first reaches ``top_p``."""
    sorted_logits, order = torch.sort(logits, descending=True)
    cumulative = torch.softmax(sorted_logits, dim=-1).cumsum(dim=-1)
    # Drop a token when the tokens before it already reach top_p (the first always stays).
    drop_sorted = (cumulative - torch.softmax(sorted_logits, dim=-1)) >= top_p
    drop = torch.zeros_like(drop_sorted).scatter(0, order, drop_sorted)
    return logits.masked_fill(drop, float("-inf"))
