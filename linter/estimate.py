"""The hit-rate estimate: the corpus replayed now, after each rule's fix, and after all fixes.

Each body is rendered (:mod:`linter.render`), tokenized and replayed in corpus
order through :class:`~linter.replay.PrefixCacheReplay`. A rule's fix is applied
to every body (fixes return the body itself when they do not apply, so unchanged
bodies reuse their block hashes); "all fixes" applies every given fix in code
order. Rates are cached prompt tokens over prompt tokens.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from linter.render import render
from linter.replay import DEFAULT_BLOCK_SIZE, PrefixCacheReplay
from linter.rule import Body, Fix
from linter.tokenizer import ApproxTokenizer, Tokenizer


@dataclass(frozen=True)
class RuleGain:
    code: str
    hit_rate_after: float
    cached_tokens_after: int
    tokens_gained: int


@dataclass(frozen=True)
class Estimate:
    requests: int
    prompt_tokens: int
    cached_tokens: int
    hit_rate: float
    cached_tokens_after_fixes: int
    hit_rate_after_fixes: float
    per_rule: tuple[RuleGain, ...]
    tokenizer: str
    block_size: int
    capacity_blocks: int | None


Prompt = tuple[int, list[bytes]]


class _Prompts:
    def __init__(self, tokenizer: Tokenizer, block_size: int) -> None:
        self.tokenizer = tokenizer
        self.hasher = PrefixCacheReplay(block_size)

    def of(self, body: Body) -> Prompt:
        rendered = render(body)
        if isinstance(self.tokenizer, ApproxTokenizer):
            ids = self.tokenizer.encode_parts(rendered.parts)
        else:
            ids = self.tokenizer.encode(rendered.text)
        return len(ids), self.hasher.hashes(ids)


def _replay(prompts: Sequence[Prompt], block_size: int, capacity: int | None) -> PrefixCacheReplay:
    replay = PrefixCacheReplay(block_size, capacity)
    for num_tokens, hashes in prompts:
        replay.add_hashes(num_tokens, hashes)
    return replay


def _fixed(bodies: Sequence[Body], base: Sequence[Prompt], fixes: Sequence[Fix], make: _Prompts) -> list[Prompt]:
    out: list[Prompt] = []
    for body, prompt in zip(bodies, base, strict=True):
        fixed = body
        for fix in fixes:
            fixed = fix(fixed)
        out.append(prompt if fixed is body else make.of(fixed))
    return out


def estimate(
    bodies: Sequence[Body],
    fixes: Mapping[str, Fix],
    tokenizer: Tokenizer,
    *,
    block_size: int = DEFAULT_BLOCK_SIZE,
    capacity_blocks: int | None = None,
) -> Estimate:
    """Replay ``bodies`` now, with each fix alone, and with all fixes (see the module docstring)."""
    make = _Prompts(tokenizer, block_size)
    base = [make.of(body) for body in bodies]
    now = _replay(base, block_size, capacity_blocks)
    gains: list[RuleGain] = []
    for code in sorted(fixes):
        after = _replay(_fixed(bodies, base, [fixes[code]], make), block_size, capacity_blocks)
        gains.append(RuleGain(code, after.hit_rate, after.hit_tokens, after.hit_tokens - now.hit_tokens))
    if fixes:
        total = _replay(_fixed(bodies, base, [fixes[c] for c in sorted(fixes)], make), block_size, capacity_blocks)
    else:
        total = now
    return Estimate(
        requests=now.requests,
        prompt_tokens=now.prompt_tokens,
        cached_tokens=now.hit_tokens,
        hit_rate=now.hit_rate,
        cached_tokens_after_fixes=total.hit_tokens,
        hit_rate_after_fixes=total.hit_rate,
        per_rule=tuple(gains),
        tokenizer=getattr(tokenizer, "name", type(tokenizer).__name__),
        block_size=block_size,
        capacity_blocks=capacity_blocks,
    )
