"""SamplingParams: how one request picks its tokens and when it stops."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

MAX_TOP_LOGPROBS = 20

# Temperatures below this are greedy (vLLM's rule too): dividing float32 logits by
# something as small as 1e-45 gives inf, and softmax then gives NaN probabilities.
MIN_SAMPLING_TEMPERATURE = 1e-5


@dataclass(frozen=True)
class SamplingParams:
    """Validated sampling settings; ``__post_init__`` raises ValueError naming the bad field.

    ``temperature < MIN_SAMPLING_TEMPERATURE`` (0 included) means greedy (top_p,
    top_k and seed are then irrelevant).
    A set ``seed`` makes the request's sampled tokens reproducible whatever else
    the engine runs at the same time. ``logprobs`` (None: none) asks for the
    sampled token's log-probability and that many most likely alternatives;
    ``prompt_logprobs`` the same for every prompt token after the first (such a
    request computes its whole prompt: it takes no prefix-cache hit).
    ``constraint`` is this request's own grammar state
    (:class:`engine.structured.grammar.GrammarConstraint`, one per sequence, never
    shared): the sampler masks with it and advances it.
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int | None = None
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    constraint: Any = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        if not _is_int(self.max_tokens) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an int >= 1, got {self.max_tokens!r}")
        if not _is_number(self.temperature) or not self.temperature >= 0:
            raise ValueError(f"temperature must be a number >= 0, got {self.temperature!r}")
        if not _is_number(self.top_p) or not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be a number in (0, 1], got {self.top_p!r}")
        if self.top_k is not None and (not _is_int(self.top_k) or self.top_k < 1):
            raise ValueError(f"top_k must be None or an int >= 1, got {self.top_k!r}")
        if self.seed is not None and not _is_int(self.seed):
            raise ValueError(f"seed must be None or an int, got {self.seed!r}")
        if not isinstance(self.stop, tuple) or not all(isinstance(s, str) and s for s in self.stop):
            raise ValueError(f"stop must be a tuple of non-empty strings, got {self.stop!r}")
        if not isinstance(self.stop_token_ids, tuple) or not all(
            _is_int(t) and t >= 0 for t in self.stop_token_ids
        ):
            raise ValueError(
                f"stop_token_ids must be a tuple of non-negative ints, got {self.stop_token_ids!r}"
            )

        if self.logprobs is not None and (
            not _is_int(self.logprobs) or not 0 <= self.logprobs <= MAX_TOP_LOGPROBS
        ):
            raise ValueError(
                f"logprobs must be None or an int in [0, {MAX_TOP_LOGPROBS}], got {self.logprobs!r}"
            )

        if self.prompt_logprobs is not None and (
            not _is_int(self.prompt_logprobs) or not 0 <= self.prompt_logprobs <= MAX_TOP_LOGPROBS
        ):
            raise ValueError(
                f"prompt_logprobs must be None or an int in [0, {MAX_TOP_LOGPROBS}], got {self.prompt_logprobs!r}"
            )

    @property
    def greedy(self) -> bool:
        return self.temperature < MIN_SAMPLING_TEMPERATURE


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)
