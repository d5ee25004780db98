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
    segment lengths and module names, and the recovery (for ``cacheblend`` with the
    probe's settings: :data:`PROBE_DEPTH`, :data:`KEEP_PROBED_KV`, :data:`DEVIATION_WEIGHTS`)."""
    r = segmented.recovery
    parts = [f"{r.mode}|{r.first_tokens}|{r.fraction!r}" + (f"|{r.last_tokens}" if r.last_tokens else "")]
    if r.mode == "cacheblend":  # the probe's settings (blocks from another setting, e.g. on disk, differ)
        parts[0] += f"|probe{PROBE_DEPTH}|{int(KEEP_PROBED_KV)}|{DEVIATION_WEIGHTS!r}"
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


PROBE_DEPTH = 1
"""``cacheblend``: the probe runs layers ``0 .. PROBE_DEPTH - 1`` over the prompt (after
them every token's K/V up to layer ``PROBE_DEPTH`` are exact) and compares layer
``PROBE_DEPTH``'s. Each layer costs ``1 / num_layers`` of a full prefill. Measured on
the 6 prompts 17-22 of ``benchmarks/prompt_modules.py`` (3 of them near-ties that
every mode misses), fraction 0.15: depth 2 / 4 / 8 got the same first tokens as 1
(8 one more), mean KL 0.075 / 0.064 / 0.045: not worth 1-7 more layers."""
KEEP_PROBED_KV = True
"""``cacheblend``: keep the exact layer-``PROBE_DEPTH`` K/V the probe computed for every
token (the tokens not selected then have exact layers ``0 .. PROBE_DEPTH`` and
reused layers above). Measured (prompts 0-23, fraction 0.15): kept 21 of 24 first
tokens equal to full prefill's, not kept 20."""
DEVIATION_WEIGHTS = (1.0, 1.0)
"""``cacheblend``: how a token's key and value deviations (each divided by its mean
over the candidates) add up to its score. Measured (prompts 0-23, fraction 0.15):
both or keys only 21 of 24 first tokens, values only 20."""


def blend_budget(num_candidates: int, num_module_tokens: int, fraction: float) -> int:
    """``cacheblend``: how many of the candidates to recompute: ``ceil(fraction *
    module tokens)``, at most all candidates."""
    return min(num_candidates, math.ceil(fraction * num_module_tokens - 1e-9))


def select_deviating(candidates: list[int], deviation: list[tuple[float, float]], budget: int) -> set[int]:
    """The ``budget`` candidates whose layer-1 K/V deviate most (``deviation[i]``: the
    squared key and value distances of ``candidates[i]``, see
    :meth:`~engine.model.llama.LlamaForward.probe`), ties to the earlier position.
    Keys and values are weighed by :data:`DEVIATION_WEIGHTS` after dividing each by
    its mean, so neither dominates by scale."""
    if budget <= 0 or not candidates:
        return set()
    n = len(candidates)
    means = [max(sum(d[c] for d in deviation) / n, 1e-30) for c in range(2)]
    score = [sum(w * d[c] / means[c] for c, w in enumerate(DEVIATION_WEIGHTS)) for d in deviation]
    ranked = sorted(range(n), key=lambda i: (-score[i], candidates[i]))
    return {candidates[i] for i in ranked[:budget]}


def missed_context(candidates: list[int], module_starts: list[int], anchor_len: int) -> list[tuple[float, float]]:
    """A stand-in for the deviation where no probe can run (the generic forward): the
    share of its full-prefill context each candidate's module KV did not see (a token
    at offset ``j`` of a module at ``o`` saw ``anchor_len + j`` of its ``o + j``
    predecessors), as both columns. ``module_starts[i]``: the start of ``candidates[i]``'s module."""
    return [((o - anchor_len) / p, (o - anchor_len) / p) if p else (0.0, 0.0)
            for p, o in zip(candidates, module_starts, strict=True)]


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
    candidates: list[int] = field(default_factory=list)
    """``cacheblend``: the module positions (past the hit, not in ``runs``) the probe's
    selection chooses among, in order; ``module_starts[i]`` is the start of
    ``candidates[i]``'s module."""
    module_starts: list[int] = field(default_factory=list)
    budget: int = 0
    """``cacheblend``: how many candidates to add to ``runs`` once the probe has measured
    their deviation (:meth:`~engine.core.module_assembler.ModuleAssembler.probed`);
    0 once added (or with nothing to choose)."""
    probed: int = field(default=0, init=False)
    """``cacheblend``: the probe has measured positions ``hit .. probed - 1`` (it runs in
    position order, in chunks of one or more steps: :meth:`next_probe`)."""
    deviation: list[tuple[float, float]] = field(default_factory=list, init=False)
    """The probe's deviations so far, one pair per position from :attr:`hit` on."""

    def __post_init__(self) -> None:
        self.probed = self.hit

    @property
    def active(self) -> bool:
        """Work left to schedule: encodes, the copies, the probe or runs."""
        return not self.copied or self.budget > 0 or bool(self.runs)

    @property
    def num_pending(self) -> int:
        return (sum(len(u.tokens) - u.encoded for u in self.uses) + sum(e - s for s, e in self.runs)
                + self.budget)

    @property
    def probe_span(self) -> tuple[int, int]:
        """The positions the probe computes layer 0 of: from the hit to the last candidate."""
        return self.hit, self.candidates[-1] + 1

    def next_probe(self, most: int) -> tuple[int, int]:
        """The next chunk of the probe: up to ``most`` (at least one) positions from
        :attr:`probed` on, within :attr:`probe_span`. Changes nothing."""
        end = self.probe_span[1]
        return self.probed, min(end, self.probed + max(most, 1))

    def add_probe(self, start: int, deviation: list[tuple[float, float]] | None, anchor_len: int) -> None:
        """A probe chunk from ``start`` measured ``deviation`` (one pair per position;
        None: no probe can run here). Once the whole span is measured (or at once with
        None), :meth:`select` adds the recovery tokens to ``runs``."""
        if start != self.probed:
            raise ValueError(f"probe chunk at {start}, expected {self.probed}")
        if deviation is None:
            self.select(None, anchor_len)
            return
        self.deviation.extend(deviation)
        self.probed = start + len(deviation)
        if self.probed >= self.probe_span[1]:
            self.select(self.deviation, anchor_len)
            self.deviation = []

    def select(self, deviation: list[tuple[float, float]] | None, anchor_len: int) -> None:
        """Add the ``budget`` most deviating candidates to ``runs`` (``deviation``: one
        pair per position of :attr:`probe_span`; None: no probe ran, rank by
        :func:`missed_context`)."""
        if deviation is None:
            scores = missed_context(self.candidates, self.module_starts, anchor_len)
        else:
            scores = [deviation[p - self.hit] for p in self.candidates]
        chosen = select_deviating(self.candidates, scores, self.budget)
        self.runs = _merge(chosen | {p for s, e in self.runs for p in range(s, e)})
        self.budget = 0

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


def plan_runs(segmented: SegmentedPrompt, num_cached: int, num_tokens: int) -> list[tuple[int, int]]:
    """Positions to compute (after the hit ``num_cached``), as sorted runs: the plain
    segments, ``epic``'s recovery tokens, the last prompt token and, for a request
    re-admitted after preemption, its generated tokens (up to ``num_tokens``).
    ``cacheblend``'s tokens are chosen later, by the probe (:func:`blend_candidates`)."""
    rec: Recovery = segmented.recovery
    todo: set[int] = set()
    offset = 0
    for seg in segmented.segments:
        n = len(seg.token_ids)
        if seg.module is None:
            todo.update(range(offset, offset + n))
        elif rec.mode == "epic":
            todo.update(range(offset, offset + min(rec.first_tokens, n)))
            todo.update(range(offset + n - min(rec.last_tokens, n), offset + n))
        offset += n
    todo.update(range(offset - 1, num_tokens))
    return _merge({p for p in todo if p >= num_cached})


def blend_candidates(segmented: SegmentedPrompt, num_cached: int, runs: list[tuple[int, int]],
                     ) -> tuple[list[int], list[int], int]:
    """``cacheblend``: the module positions past the hit not in ``runs`` (the
    candidates), their modules' starts, and how many of them to recompute
    (:func:`blend_budget` of the module tokens past the hit); nothing for other modes."""
    if segmented.recovery.mode != "cacheblend":
        return [], [], 0
    planned = {p for s, e in runs for p in range(s, e)}
    candidates: list[int] = []
    starts: list[int] = []
    num_module = 0
    offset = 0
    for seg in segmented.segments:
        n = len(seg.token_ids)
        if seg.module is not None:
            mine = [p for p in range(max(offset, num_cached), offset + n)]
            num_module += len(mine)
            candidates += [p for p in mine if p not in planned]
            starts += [offset] * (len(candidates) - len(starts))
        offset += n
    return candidates, starts, blend_budget(len(candidates), num_module, segmented.recovery.fraction)
