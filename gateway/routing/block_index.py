"""ReplicaIndex: which block keys one replica holds, as the gateway knows it.

Three sources, all in gateway keys (:mod:`gateway.routing.block_keys`):

* **events** (exact): ``BlockStored`` / ``BlockRemoved`` / ``AllBlocksCleared``
  from the replica's KV-event stream. A stored block's key is recomputed from
  the event's token ids: ``key = hash_block_tokens(parent key, tokens, extras)``,
  where the parent key is found through the engine's parent hash, and block 0
  (no parent) takes the cache salt from its ``extra_keys`` entry (vLLM and
  prefixgate put ``(salt,)`` there). Blocks whose extra keys hold anything else
  (LoRA, images, prompt embeddings) get no key: a gateway request never matches
  them. A key is present while more stored copies than removals were seen
  (engines may cache one hash in several blocks and remove each copy).
* **history** (approximate): for a replica that publishes no events, the keys of
  the requests the gateway routed to it, most recent last, bounded by
  ``history_capacity`` blocks; evictions are not seen.
* **pending**: the keys of requests routed to the replica that have not finished
  yet. Engines cache a request's blocks when they schedule it, before its
  events can arrive, so a request queued behind another with the same prefix
  will hit them.

``hit_blocks`` is the longest prefix of a request's keys held by the replica.
All methods are thread-safe (events are applied by the subscriber's thread).
"""

from __future__ import annotations

import threading
from collections import Counter, OrderedDict
from collections.abc import Hashable, Sequence
from typing import Any

from engine.kvcache.block_hash import ROOT_BLOCK_HASH, BlockHash, encode_salt, hash_block_tokens

DEFAULT_HISTORY_CAPACITY = 1 << 16


def salt_of(extra: Any) -> tuple[bool, str | None]:
    """``(usable, salt)`` for block 0's extra keys: None/empty -> no salt; ``(salt,)`` -> salt."""
    if extra is None or (isinstance(extra, list | tuple) and not extra):
        return True, None
    if isinstance(extra, list | tuple) and len(extra) == 1 and isinstance(extra[0], str):
        return True, extra[0]
    return False, None


class ReplicaIndex:
    def __init__(self, *, has_events: bool = False, history_capacity: int = DEFAULT_HISTORY_CAPACITY) -> None:
        self._lock = threading.Lock()
        self.has_events = has_events
        self._counts: Counter[BlockHash] = Counter()
        self._engine_to_key: dict[Hashable, BlockHash] = {}
        self._history: OrderedDict[BlockHash, None] = OrderedDict()
        self._history_capacity = history_capacity
        self._pending: Counter[BlockHash] = Counter()
        self.unresolved_blocks = 0

    # ---------------------------------------------------------------- events
    def stored(self, block_hashes: Sequence[Hashable], parent: Hashable | None, token_ids: Sequence[int],
               block_size: int, extra_keys: Sequence[Any] | None = None) -> int:
        """Apply a ``BlockStored``; returns how many blocks got a key."""
        if block_size <= 0 or len(token_ids) != len(block_hashes) * block_size:
            with self._lock:
                self.unresolved_blocks += len(block_hashes)
            return 0
        with self._lock:
            self.has_events = True
            if parent is None:
                key: BlockHash | None = ROOT_BLOCK_HASH
            else:
                key = self._engine_to_key.get(parent)
            resolved = 0
            for i, engine_hash in enumerate(block_hashes):
                extra = extra_keys[i] if extra_keys is not None and i < len(extra_keys) else None
                key = self._child_key(key, parent is None and i == 0, token_ids[i * block_size:(i + 1) * block_size],
                                      extra)
                if key is None:
                    self.unresolved_blocks += len(block_hashes) - i
                    break
                self._engine_to_key[engine_hash] = key
                self._counts[key] += 1
                resolved += 1
            return resolved

    @staticmethod
    def _child_key(parent_key: BlockHash | None, first: bool, tokens: Sequence[int], extra: Any) -> BlockHash | None:
        if parent_key is None:
            return None
        if first:
            usable, salt = salt_of(extra)
            if not usable:
                return None
            return hash_block_tokens(ROOT_BLOCK_HASH, tokens, encode_salt(salt))
        if extra:  # LoRA, multimodal or prompt-embedding keys: never a gateway request's block
            return None
        return hash_block_tokens(parent_key, tokens)

    def removed(self, block_hashes: Sequence[Hashable]) -> None:
        with self._lock:
            self.has_events = True
            for engine_hash in block_hashes:
                key = self._engine_to_key.get(engine_hash)
                if key is None:
                    continue
                self._counts[key] -= 1
                if self._counts[key] <= 0:
                    del self._counts[key]
                    del self._engine_to_key[engine_hash]

    def cleared(self) -> None:
        with self._lock:
            self.has_events = True
            self._counts.clear()
            self._engine_to_key.clear()

    def forget(self) -> None:
        """Drop everything the replica was known to hold (it left the pool or restarted)."""
        with self._lock:
            self._counts.clear()
            self._engine_to_key.clear()
            self._history.clear()

    # --------------------------------------------------------------- routing
    def routed(self, keys: Sequence[BlockHash]) -> None:
        """A request with ``keys`` was sent to this replica."""
        with self._lock:
            self._pending.update(keys)
            if not self.has_events:
                for key in keys:
                    self._history[key] = None
                    self._history.move_to_end(key)
                while len(self._history) > self._history_capacity:
                    self._history.popitem(last=False)

    def finished(self, keys: Sequence[BlockHash]) -> None:
        with self._lock:
            self._pending.subtract(keys)
            for key in keys:
                if self._pending[key] <= 0:
                    del self._pending[key]

    def hit_blocks(self, keys: Sequence[BlockHash], limit: int | None = None) -> int:
        """Length of the longest prefix of ``keys`` this replica holds (at most ``limit``)."""
        limit = len(keys) if limit is None else min(limit, len(keys))
        with self._lock:
            known = self._counts if self.has_events else self._history
            pending = self._pending
            n = 0
            while n < limit and (keys[n] in known or keys[n] in pending):
                n += 1
            return n

    @property
    def num_blocks(self) -> int:
        """Distinct keys known to be held (events), or remembered (history)."""
        with self._lock:
            return len(self._counts) if self.has_events else len(self._history)
