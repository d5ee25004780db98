"""ModuleAssembler: builds a segmented request's KV from prompt modules (issue 21).

A request that carries a :class:`~engine.promptcache.segments.SegmentedPrompt` has
its KV assembled instead of computed in full:

1. **Module KV** lives in the block pool, in blocks named by a module chain
   (:mod:`engine.kvcache.module_hash`: salt, model, module name, then the tokens).
   A module is encoded once, on its own, at position 0 (optionally after an anchor,
   the prompt's first segment, when :data:`~engine.core.assembly.ANCHOR_MAX_TOKENS`
   allows: off by default, measured there). The module's blocks hold ``anchor +
   module`` from position 0; a
   missing module (or the missing tail of one) is encoded as extra sequences of the
   request's own prefill, chunked under the step's token budget. Its blocks are
   cached under their hashes only once that forward is done, so nobody reads a
   half-written module; two requests missing the same module in the same step both
   encode it (the pool allows two blocks per hash).
2. **Copy**: once every module of the request is encoded, its rows are copied into
   the request's own blocks, keys re-rotated by RoPE for the position delta
   (:class:`~engine.model.kv_shift.KVCopy`, done by the engine before the forward);
   the request then drops its references on the module blocks, which stay cached
   (ref 0, LRU-evictable like any block).
3. **Runs**: the uncached segments, the recovery tokens and the last prompt token
   are computed as runs of the request (several sequences of one request in one
   forward, in position order, attended as one slice: each token attends to every
   position up to its own), chunked under the budget; the last run samples.

The request's own blocks are allocated for its whole prompt at admission. The full
blocks before its first module (the chat head, computed exactly) are on the exact
chain and shared with exact requests both ways; the rest carry an *assembled* hash
chain (:func:`assembly_key`): equal segmented requests (same tokens, segmentation,
recovery, salt) reuse each other's blocks exactly; an exact request never finds
them, nor they an exact request's.

Recovery (:class:`~engine.promptcache.segments.Recovery`): ``none`` recomputes only
the uncached segments; ``epic`` also the first ``first_tokens`` tokens of every
reused module (and its last ``last_tokens``); ``cacheblend`` the ``fraction`` of the
module tokens whose K/V deviate most from what this prompt gives them. Those are
found by a *probe* in the step of the copies (``SchedulerOutput.probes``, run by the
engine after the copies, before the forward): layer 0 over the request's tokens
from its hit on (a token's layer-0 K/V depend only on the token and its position,
so those are exact), then layer 1's K/V of the same tokens, exact too, compared
with the copied ones (:meth:`~engine.model.llama.LlamaForward.probe`). The most
deviating module tokens join the runs (:meth:`ModuleAssembler.probed`, from the next step on); the
probe's exact layer-0 K/V stay, and so do its layer-1 K/V
(:data:`~engine.core.assembly.KEEP_PROBED_KV`). A forward that cannot probe (the
generic transformers one) ranks by :func:`~engine.core.assembly.missed_context`.
"""

from __future__ import annotations

from collections.abc import Callable

from engine.core.assembly import Assembly, ModuleUse, anchor_of, blend_candidates, plan_runs
from engine.core.engine_request import EngineRequest
from engine.kvcache.block_hash import BlockHash
from engine.kvcache.kv_cache_block import KVCacheBlock
from engine.kvcache.kv_cache_manager import KVCacheManager
from engine.kvcache.module_hash import module_block_hashes, module_root
from engine.model.kv_shift import KVCopy


class ModuleAssembler:
    """The scheduler's helper for segmented requests: plans, holds module blocks,
    hands out encode chunks, copies and runs. Changes the cache only through the
    :class:`KVCacheManager` (module holds, caching finished module blocks)."""

    def __init__(self, kv_cache_manager: KVCacheManager, model: str) -> None:
        self.kvm = kv_cache_manager
        self.block_size = kv_cache_manager.block_size
        self.model = model
        self.module_tokens_reused = 0
        self.module_tokens_encoded = 0
        self._module_hashes: set[BlockHash] = set()

    @property
    def num_module_blocks(self) -> int:
        """Cached module blocks in the pool (held or evictable)."""
        cached = self.kvm.block_pool.cached
        self._module_hashes = {h for h in self._module_hashes if h in cached}
        return sum(len(cached[h]) for h in self._module_hashes)

    def admit(self, req: EngineRequest, hits: list[KVCacheBlock], num_cached: int) -> bool:
        """Plan ``req``'s assembly after its (assembled-chain) hit, hold its module
        blocks and allocate slots for its whole prompt; False, changing nothing, when
        the blocks do not fit."""
        segmented = req.segmented
        assert segmented is not None
        anchor = list(anchor_of(segmented))
        pool = self.kvm.block_pool
        uses: list[ModuleUse] = []
        offset = 0
        for seg in segmented.segments:
            n = len(seg.token_ids)
            if seg.module is not None and offset + n > num_cached:
                tokens = [*anchor, *seg.token_ids]
                root = module_root(req.kv.cache_salt, self.model, seg.module, len(anchor))
                uses.append(ModuleUse(seg.module, offset, n, tokens, len(anchor),
                                      module_block_hashes(tokens, self.block_size, root)))
            offset += n
        module_hits: list[KVCacheBlock] = []
        num_new = 0
        held: set[int] = set()
        for use in uses:
            for h in use.hashes:
                block = pool.get_cached_block(h)
                if block is None or block.block_id in held:
                    break
                use.blocks.append(block)
                held.add(block.block_id)
            use.encoded = min(len(use.blocks) * self.block_size, len(use.tokens))
            module_hits.extend(use.blocks)
            num_new += len(use.hashes) - len(use.blocks)
        # Take every hit (the request's and the modules') before popping any new block,
        # so no pop evicts a hit still in the free queue.
        bs = self.block_size
        num_request_new = -(-req.kv.num_tokens // bs) - len(hits)
        evictable = sum(1 for b in [*hits, *module_hits] if b.ref_cnt == 0)
        if num_request_new + num_new > self.kvm.num_free_blocks - evictable:
            return False
        self.kvm.hold_module_blocks(req.request_id, module_hits, 0)
        allocated = self.kvm.allocate_slots(req.kv, req.kv.num_tokens - num_cached, num_cached, hits)
        new = self.kvm.hold_module_blocks(req.request_id, [], num_new)
        assert allocated is not None and new is not None, "checked above"
        for use in uses:
            k = len(use.hashes) - len(use.blocks)
            use.blocks.extend(new[:k])
            new = new[k:]
        runs = plan_runs(segmented, num_cached, req.kv.num_tokens)
        candidates, starts, budget = blend_candidates(segmented, num_cached, runs)
        computed = {p for s, e in runs for p in range(s, e)}
        reused = sum(1 for u in uses if u.encoded == len(u.tokens)
                     for p in range(max(u.offset, num_cached), u.offset + u.length) if p not in computed)
        if budget and reused:  # the selection recomputes ``budget`` of the module tokens
            reused -= budget * reused // len(candidates)
        req.assembly = Assembly(uses, runs, num_cached, reused, candidates=candidates, module_starts=starts,
                                budget=budget)
        return True

    def schedule(self, req: EngineRequest, allowance: int, take: Callable[[int, int, bool], int] | None = None,
                 ) -> tuple[list[tuple[list[int], int, list[int]]], list[KVCopy], list[tuple[int, int]], bool]:
        """Up to ``allowance`` tokens of ``req``'s assembly this step: encode chunks
        ``(token_ids, start, block_ids)``, copies, runs ``(start, n)``, in that order,
        and whether the request's probe goes on this step, after the copies
        (``cacheblend``: then no runs this step; the scheduler sizes the probe's chunk,
        :meth:`probed` adds the selection to the runs after the last). Copies come
        only in a step after the last encode chunk's forward. ``take(start, n, first)``
        says how many of a run's next ``n`` tokens from ``start`` the step's cost still
        allows (at least one for the ``first`` run; without it, all)."""
        asm = req.assembly
        assert asm is not None
        encodes: list[tuple[list[int], int, list[int]]] = []
        used = 0
        pending = [u for u in asm.uses if u.encoded < len(u.tokens)]
        for use in pending:
            if used >= allowance:
                break
            n = min(len(use.tokens) - use.encoded, allowance - used)
            encodes.append((use.tokens[use.encoded : use.encoded + n], use.encoded, [b.block_id for b in use.blocks]))
            use.encoded += n
            used += n
            self.module_tokens_encoded += n
        if pending:
            return encodes, [], [], False
        copies = [] if asm.copied else self._copies(req, asm)
        if asm.budget > 0:
            return encodes, copies, [], True
        runs: list[tuple[int, int]] = []
        while asm.runs and used < allowance:
            start, end = asm.runs[0]
            n = min(end - start, allowance - used)
            if take is not None:
                n = take(start, n, not runs)
                if n <= 0:
                    break
            runs.append((start, n))
            used += n
            asm.runs[0] = (start + n, end)
            if start + n == end:
                asm.runs.pop(0)
        return encodes, copies, runs, False

    def probed(self, req: EngineRequest, start: int, deviation: list[tuple[float, float]] | None) -> None:
        """A chunk of ``req``'s probe from ``start`` is done; after the last, recompute
        the tokens its selection picks (:meth:`Assembly.add_probe`). Changes no block."""
        asm = req.assembly
        assert asm is not None and asm.copied and asm.budget > 0
        asm.add_probe(start, deviation, len(anchor_of(req.segmented)) if req.segmented is not None else 0)

    def _copies(self, req: EngineRequest, asm: Assembly) -> list[KVCopy]:
        """The copies of every module into ``req``'s blocks; caches freshly encoded
        module blocks and drops ``req``'s references on them (see the module docstring)."""
        pool = self.kvm.block_pool
        dst = tuple(self.kvm.get_block_ids(req.request_id))
        first = asm.hit  # positions before it are on the assembled chain: not copied
        copies: list[KVCopy] = []
        for use in asm.uses:
            for block, h in zip(use.blocks, use.hashes, strict=True):
                if block.block_hash is None:
                    pool.cache_block(block, h)
                    self._module_hashes.add(h)
            skip = max(first - use.offset, 0)
            copies.append(KVCopy(tuple(b.block_id for b in use.blocks), use.anchor_len + skip, dst,
                                 use.offset + skip, use.length - skip, use.offset - use.anchor_len))
        asm.copied = True
        self.module_tokens_reused += asm.num_reused
        self.kvm.release_module_blocks(req.request_id)
        return copies

    def release(self, req: EngineRequest) -> None:
        """Forget ``req``'s assembly (preempted or finished) and its module holds;
        blocks of an unfinished encode were never cached, so nothing finds them."""
        self.kvm.release_module_blocks(req.request_id)
        req.assembly = None
