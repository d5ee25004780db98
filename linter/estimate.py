"""The hit-rate estimate: the corpus replayed now, after each rule's fix, and after all fixes.

Each body is rendered (:mod:`linter.render`), tokenized and replayed in corpus
order through :class:`~linter.replay.PrefixCacheReplay`. A rule's fix is applied
to its target bodies (fixes return the body itself when they do not apply, so
unchanged bodies reuse their block hashes); "all fixes" applies every given fix
in code order. Rates are cached prompt tokens over prompt tokens.

Per rule the estimate also keeps which requests the fix changed and how many
more tokens each request hit with it (``RuleGain.deltas``, also for requests
the fix did not change but that now reuse a fixed predecessor): the runner
gives those numbers to the rule's findings as ``tokens_lost``, so a rule's
findings and its row of the table are one measurement. A fix that changes no
request says so (``applies`` False) instead of showing a gain of zero.

``segment_reuse_tokens``: what the engine's opt-in segment reuse would add to the
hits now, for documents that move between requests (:mod:`linter.segment_reuse`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from engine import ROOT_BLOCK_HASH, hash_block_chain
from linter.divergence import common_prefix_len
from linter.render import Rendered, render
from linter.replay import DEFAULT_BLOCK_SIZE, PrefixCacheReplay
from linter.rule import Body, Fix
from linter.segment_reuse import segment_reuse_tokens
from linter.tokenizer import ApproxTokenizer, Tokenizer


@dataclass(frozen=True)
class RuleGain:
    """The replay with one rule's fix: ``changed`` requests, ``deltas`` (request -> extra cached tokens, non-zero only)."""

    code: str
    hit_rate_after: float
    cached_tokens_after: int
    tokens_gained: int
    changed: frozenset[int]
    deltas: dict[int, int]

    @property
    def applies(self) -> bool:
        return bool(self.changed)


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
    segment_reuse_tokens: int = 0  # more cached with segment reuse, on top of now (linter.segment_reuse)

    @property
    def hit_rate_with_segment_reuse(self) -> float:
        return (self.cached_tokens + self.segment_reuse_tokens) / self.prompt_tokens if self.prompt_tokens else 0.0


Prompt = tuple[int, list[bytes]]


class Prompts:
    """Turns bodies into (token count, block hashes).

    Hashing is the costly step, and most prompts repeat an earlier prompt's head
    (the family's instructions, the conversation so far). The latest prompt of
    each family and conversation is remembered (bounded); a new prompt reuses
    the hashes of the full blocks whose tokens it provably shares with one of
    them (compared token by token) and hashes only the rest, continuing the
    chain from the last shared block, so the hashes are exactly those of
    ``hash_block_chain(all tokens)``.
    """

    _MEMO_LIMIT = 20_000

    def __init__(self, tokenizer: Tokenizer, block_size: int) -> None:
        self.tokenizer = tokenizer
        self.block_size = block_size
        self._memo: dict[tuple[str, ...], tuple[list[int], list[bytes]]] = {}

    def _hashes(self, rendered: Rendered, ids: list[int]) -> list[bytes]:
        keys = (rendered.parts[: rendered.anchor_parts], rendered.parts[: rendered.static_parts])
        shared_blocks, parent = 0, ROOT_BLOCK_HASH
        reuse: list[bytes] = []
        for key in keys:
            earlier = self._memo.get(key)
            if earlier is None:
                continue
            blocks = min(common_prefix_len(ids, earlier[0]) // self.block_size, len(earlier[1]))
            if blocks > shared_blocks:
                shared_blocks, reuse = blocks, earlier[1]
            # The conversation key includes the static parts, so a conversation
            # match already covers everything the family match could.
            break
        if shared_blocks:
            parent = reuse[shared_blocks - 1]
        hashes = reuse[:shared_blocks] + hash_block_chain(ids, self.block_size, parent=parent, start_block=shared_blocks)
        if len(self._memo) >= self._MEMO_LIMIT:
            self._memo.clear()
        for key in keys:
            self._memo[key] = (ids, hashes)
        return hashes

    def of(self, body: Body) -> Prompt:
        return self.of_rendered(render(body))

    def of_rendered(self, rendered: Rendered) -> Prompt:
        if isinstance(self.tokenizer, ApproxTokenizer):
            ids = self.tokenizer.encode_parts(rendered.parts)
        else:
            ids = self.tokenizer.encode(rendered.text)
        return len(ids), self._hashes(rendered, ids)


def _replay(prompts: Sequence[Prompt], block_size: int, capacity: int | None) -> tuple[PrefixCacheReplay, list[int]]:
    """The replay and each prompt's hit in tokens."""
    replay = PrefixCacheReplay(block_size, capacity)
    hits = [replay.add_hashes(num_tokens, hashes) for num_tokens, hashes in prompts]
    return replay, hits


def _fresh(fix: Fix) -> Fix:
    """A new instance of a stateful fix (one that remembers earlier requests, :mod:`linter.first_seen`)."""
    fresh = getattr(fix, "fresh", None)
    return fresh() if callable(fresh) else fix


def _fixed(
    bodies: Sequence[Body], base: Sequence[Prompt], fixes: Sequence[tuple[Fix, set[int] | None]], make: Prompts
) -> tuple[list[Prompt], list[int]]:
    """The prompts with the fixes applied, and the indices of the bodies they changed."""
    out: list[Prompt] = []
    changed: list[int] = []
    fixes = [(_fresh(fix), where) for fix, where in fixes]
    for i, (body, prompt) in enumerate(zip(bodies, base, strict=True)):
        fixed = body
        for fix, where in fixes:
            if where is None or i in where:
                fixed = fix(fixed)
        if fixed is body:
            out.append(prompt)
        else:
            changed.append(i)
            out.append(make.of(fixed))
    return out, changed


def estimate(
    bodies: Sequence[Body],
    fixes: Mapping[str, Fix],
    tokenizer: Tokenizer,
    *,
    block_size: int = DEFAULT_BLOCK_SIZE,
    capacity_blocks: int | None = None,
    base: Sequence[Prompt] | None = None,
    targets: Mapping[str, set[int] | None] | None = None,
) -> Estimate:
    """Replay ``bodies`` now, with each fix alone, and with all fixes (see the module docstring).

    ``base`` holds the bodies' prompts when the caller already computed them;
    ``targets[code]`` limits a fix to those body indices (None or absent: all).
    """
    make = Prompts(tokenizer, block_size)
    if base is None:
        base = [make.of(body) for body in bodies]
    where = dict(targets or {})
    now, hits_now = _replay(base, block_size, capacity_blocks)
    gains: list[RuleGain] = []
    for code in sorted(fixes):
        prompts, changed = _fixed(bodies, base, [(fixes[code], where.get(code))], make)
        after, hits = _replay(prompts, block_size, capacity_blocks)
        deltas = {i: h - h0 for i, (h, h0) in enumerate(zip(hits, hits_now, strict=True)) if h != h0}
        gain = RuleGain(code, after.hit_rate, after.hit_tokens, after.hit_tokens - now.hit_tokens, frozenset(changed), deltas)
        gains.append(gain)
    if fixes:
        every = [(fixes[c], where.get(c)) for c in sorted(fixes)]
        total, _ = _replay(_fixed(bodies, base, every, make)[0], block_size, capacity_blocks)
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
        segment_reuse_tokens=segment_reuse_tokens(bodies, hits_now, tokenizer, block_size),
    )
