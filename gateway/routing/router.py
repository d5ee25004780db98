"""The routing policy: which replica gets a request, and how many tokens it will find cached.

For each candidate replica ``r`` (healthy ones; every one when none is healthy)::

    hit(r)  = longest prefix of the request's block keys that r holds   (blocks,
              at most (prompt_tokens - 1) // block_size: the last token is computed)
    cost(r) = miss_weight * (prompt_tokens - block_size * hit(r))   tokens this request must prefill on r
              + queued_prefill(r)                          uncached tokens of r's in-flight requests
              + load_cost_tokens * in_flight(r)            per-request overhead (decode, scheduling)

and the replica with the lowest cost wins; ties go to fewer in-flight requests,
then to the replica chosen least recently. The cost estimates, in prompt tokens of
prefill, the work ahead of the request's first token on each replica:
``queued_prefill`` sums, over the requests routed to ``r`` and not finished, the
tokens they were predicted to compute; ``load_cost_tokens`` (default 32) is what
one such request costs besides its prefill. ``miss_weight`` (default 2) charges a
prefix recomputed elsewhere more than its own prefill time: it takes compute from
every request on that replica and a second copy of the blocks, so a hot prefix
leaves its replica only when the wait there exceeds twice the recompute. A hot
prefix thus stays on its replica while its queue holds cheap cache hits, and
spreads under real queueing (the other replica then holds it too). A request
without keys (not tokenizable) counts its prefill as 0 and is routed by load alone.

A PML prompt (``prompt_format: "pml"``) has no block keys but an
:class:`~gateway.routing.schema_affinity.Affinity`: its schema's home replica ``h``
(a consistent hash of tenant salt and schema name) counts ``prefill = 0`` and every
other replica ``prefill = affinity.tokens``, the schema's module tokens it would
compute again; its prediction is None (the engine's own module cache decides).

The prediction ``predicted_cached_tokens = block_size * hit(r)`` is what the
engine will report as ``cached_tokens`` when the index is exact (events) and no
eviction happens between routing and scheduling. Keys carry the tenant's salt in
block 0, so one tenant's blocks never count for another tenant's request.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from gateway.routing.block_index import ReplicaIndex
from gateway.routing.block_keys import RequestKeys
from gateway.routing.schema_affinity import Affinity


class Candidate(Protocol):
    name: str
    index: ReplicaIndex
    healthy: bool
    in_flight: int
    queued_prefill: int
    last_chosen: int


@dataclass(frozen=True)
class Choice:
    replica: Candidate
    hit_blocks: int
    predicted_cached_tokens: int | None
    prefill_tokens: int = 0


class Router:
    def __init__(self, load_cost_tokens: int = 32, miss_weight: float = 2.0) -> None:
        if load_cost_tokens < 0:
            raise ValueError(f"load_cost_tokens must be >= 0, got {load_cost_tokens!r}")
        if miss_weight <= 0:
            raise ValueError(f"miss_weight must be > 0, got {miss_weight!r}")
        self.load_cost_tokens = load_cost_tokens
        self.miss_weight = miss_weight
        self._clock = itertools.count(1)

    def choose(self, replicas: Sequence[Candidate], keys: RequestKeys | None,
               exclude: Sequence[Candidate] = (), affinity: Affinity | None = None) -> Choice | None:
        """The best replica outside ``exclude``, or None when there is none (``affinity``: for a
        request without ``keys``)."""
        candidates = [r for r in replicas if r not in exclude]
        healthy = [r for r in candidates if r.healthy]
        candidates = healthy or candidates
        if not candidates:
            return None
        home = max(candidates, key=lambda r: affinity.score(r.name)) if affinity is not None else None
        best: tuple[tuple[float, int, int], Candidate, int, int] | None = None
        for replica in candidates:
            hit = replica.index.hit_blocks(keys.keys, keys.max_hit_blocks) if keys is not None else 0
            if keys is not None:
                prefill = keys.num_tokens - hit * keys.block_size
            else:
                prefill = affinity.tokens if affinity is not None and replica is not home else 0
            cost = self.miss_weight * prefill + replica.queued_prefill + self.load_cost_tokens * replica.in_flight
            rank = (cost, replica.in_flight, replica.last_chosen)
            if best is None or rank < best[0]:
                best = (rank, replica, hit, prefill)
        assert best is not None
        _, replica, hit, prefill = best
        replica.last_chosen = next(self._clock)
        predicted = hit * keys.block_size if keys is not None else None
        return Choice(replica, hit, predicted, prefill)
