"""Assembly: the plan for one segmented request's KV (which modules, which runs to compute).

Plain data and pure functions (no torch, no cache): :mod:`engine.core.module_assembler`
fills and executes the plan. See there for the whole mechanism.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass, field

from engine.kvcache.block_hash import BlockHash
from engine.kvcache.kv_cache_block import KVCacheBlock
from engine.promptcache.segments import Recovery, SegmentedPrompt

ANCHOR_MAX_TOKENS = 0
"""Longest first segment used as the anchor modules are encoded after. 0: modules are
encoded alone at position 0. Measured (``benchmarks/prompt_modules.py``, 12 prompts of
4 documents, bundled model) against an anchor of the prompt's head (the chat
template's system turn and user header, <= 64 tokens): with ``epic`` (16 tokens)
first-token agreement 83% vs 67% and mean KL 0.103 vs 0.199; ``none`` 67% / 0.30 vs
58% / 0.28; ``cacheblend`` 0.15: 83% / 0.076 vs 83% / 0.095. Without an anchor a
module's KV also does not depend on the prompt's head, so one encoding serves every
system prompt."""


def assembly_key(segmented: SegmentedPrompt) -> bytes:
    """What, besides the tokens and the salt, an assembled request's KV depends on:
    segment lengths and module names, and the recovery."""
    r = segmented.recovery
    parts = [f"{r.mode}|{r.first_tokens}|{r.fraction!r}" + (f"|{r.last_tokens}" if r.last_tokens else "")]
    parts += [f"{len(s.token_ids)}:{s.module or ''}" for s in segmented.segments]
    return hashlib.sha256("\x00".join(parts).encode("utf-8")).digest()


def exact_head_tokens(segmented: SegmentedPrompt) -> int:
    """Tokens before the first module: computed with exactly their real context (the
    chat head), so their full blocks keep the exact chain and hit the prefix cache."""
    offset = 0
    for seg in segmented.segments:
        if seg.module is not None:
            return offset
        offset += len(seg.token_ids)
    return offset


def anchor_of(segmented: SegmentedPrompt) -> tuple[int, ...]:
    """The tokens modules of this prompt are encoded after (see the module docstring)."""
    first = segmented.segments[0]
    if first.module is None and len(first.token_ids) <= ANCHOR_MAX_TOKENS and len(segmented.segments) > 1:
        return first.token_ids
    return ()


def cacheblend_positions(modules: list[tuple[int, int]], fraction: float, anchor_len: int) -> list[set[int]]:
    """Offsets to recompute within each module ``(offset, length)`` under ``cacheblend``
    (simplified): ``ceil(fraction * reused tokens)`` tokens in all.

    CacheBlend recomputes the tokens whose KV deviates most from a full prefill,
    found by a first-layers pass. Without that pass, this ranks tokens by the share
    of their full-prefill context that their module KV did not see: a token at
    offset ``j`` of a module placed at ``o`` (encoded after ``anchor_len`` tokens)
    saw ``anchor_len + j`` of its ``o + j`` predecessors, so it missed
    ``(o - anchor_len) / (o + j)``: the first tokens of the later modules first.
    Each module's choice is a prefix of it, so the recomputed tokens form one run
    per module."""
    total = sum(n for _, n in modules)
    budget = min(total, math.ceil(fraction * total - 1e-9))
    scored = sorted(((-(o - anchor_len) / (o + j), k, j) for k, (o, n) in enumerate(modules) for j in range(n)))
    chosen: list[set[int]] = [set() for _ in modules]
    for _, k, j in scored[:budget]:
        chosen[k].add(j)
    return chosen


@dataclass
class ModuleUse:
    """One module segment of a request and the module blocks it holds."""

    name: str
    offset: int
    length: int
    tokens: list[int]
    anchor_len: int
    hashes: list[BlockHash]
    blocks: list[KVCacheBlock] = field(default_factory=list)
    encoded: int = 0
    """Tokens of ``tokens`` whose K/V are written or scheduled."""


@dataclass
class Assembly:
    """A segmented request's assembly state for one admission (rebuilt after preemption)."""

    uses: list[ModuleUse]
    runs: list[tuple[int, int]]
    hit: int
    """Prompt tokens found on the assembled chain (neither copied nor computed)."""
    num_reused: int
    """Module tokens copied and not recomputed (from modules already cached)."""
    copied: bool = False

    @property
    def active(self) -> bool:
        """Work left to schedule: encodes, the copies or runs."""
        return not self.copied or bool(self.runs)

    @property
    def num_pending(self) -> int:
        return sum(len(u.tokens) - u.encoded for u in self.uses) + sum(e - s for s, e in self.runs)

    def frontier(self, end: int) -> int:
        """The request's ``num_computed_tokens`` after a forward that reached ``end``:
        the first position still to compute (everything before it is final)."""
        return self.runs[0][0] if self.runs else end


def _merge(positions: set[int]) -> list[tuple[int, int]]:
    runs: list[tuple[int, int]] = []
    for p in sorted(positions):
        if runs and runs[-1][1] == p:
            runs[-1] = (runs[-1][0], p + 1)
        else:
            runs.append((p, p + 1))
    return runs


def plan_runs(segmented: SegmentedPrompt, num_cached: int, num_tokens: int, anchor_len: int = 0) -> list[tuple[int, int]]:
    """Positions to compute (after the hit ``num_cached``), as sorted runs: the plain
    segments, the recovery tokens, the last prompt token and, for a request
    re-admitted after preemption, its generated tokens (up to ``num_tokens``)."""
    rec: Recovery = segmented.recovery
    todo: set[int] = set()
    modules: list[tuple[int, int]] = []
    offset = 0
    for seg in segmented.segments:
        n = len(seg.token_ids)
        if seg.module is None:
            todo.update(range(offset, offset + n))
        elif rec.mode == "epic":
            todo.update(range(offset, offset + min(rec.first_tokens, n)))
            todo.update(range(offset + n - min(rec.last_tokens, n), offset + n))
        else:
            modules.append((offset, n))
        offset += n
    if rec.mode == "cacheblend":
        for (o, _), chosen in zip(modules, cacheblend_positions(modules, rec.fraction, anchor_len), strict=True):
            todo.update(o + j for j in chosen)
    todo.update(range(offset - 1, num_tokens))
    return _merge({p for p in todo if p >= num_cached})


