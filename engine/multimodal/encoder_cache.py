"""EncoderCache: image features kept by image content hash, bounded in bytes, LRU.

An image's features depend on its pixels alone (and the checkpoint), so a request
with an image seen before skips the vision tower. The key is ``(cache_salt, image
content hash)``: features themselves would leak nothing between tenants (they are
the same bits whoever computes them, and K/V reuse is isolated by the block hashes,
which carry the salt), but a hit is faster than a miss, so a shared cache would let
one tenant time whether another sent a given image. Keyed by salt too, it cannot.

Invariants: ``bytes <= max_bytes`` after every call; an entry larger than
``max_bytes`` is returned to its caller but never stored; entries hold no request
state (nothing to free when a request is cancelled or preempted).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable

import torch

EncoderKey = tuple[str | None, str]
"""``(cache_salt, image content hash)``."""


class EncoderCache:
    """Features by :data:`EncoderKey`, least recently used evicted first."""

    def __init__(self, max_bytes: int) -> None:
        if max_bytes < 0:
            raise ValueError(f"encoder cache size must be >= 0 bytes, got {max_bytes!r}")
        self.max_bytes = max_bytes
        self._entries: OrderedDict[EncoderKey, torch.Tensor] = OrderedDict()
        self.bytes = 0
        self.hits = 0
        self.misses = 0
        self.evictions = 0

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: EncoderKey) -> bool:
        return key in self._entries

    def get_or_compute(self, key: EncoderKey, compute: Callable[[], torch.Tensor]) -> torch.Tensor:
        """The features under ``key``, computed (and stored if they fit) on a miss."""
        found = self._entries.get(key)
        if found is not None:
            self._entries.move_to_end(key)
            self.hits += 1
            return found
        self.misses += 1
        features = compute()
        size = features.numel() * features.element_size()
        if size <= self.max_bytes:
            while self.bytes + size > self.max_bytes:
                _, old = self._entries.popitem(last=False)
                self.bytes -= old.numel() * old.element_size()
                self.evictions += 1
            self._entries[key] = features
            self.bytes += size
        return features
