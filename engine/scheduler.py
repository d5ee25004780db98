"""Scheduler: which requests run in the next engine step, first come first served.

Each step decodes one token for every running request, then admits waiting
requests in arrival order while their KV reservation fits (a request that does
not fit blocks the ones behind it: strict FCFS). The step's work is returned as
a list so that a later issue can run it as one batch.

Invariants:

* every admitted request's worst case fits: the sum of the running requests'
  reservations (``ceil(min(prompt + max_tokens, max_model_len) / block_size)``
  blocks each) never exceeds the pool, so ``allocate_slots`` cannot fail for a
  running request;
* a request is in exactly one of ``waiting`` and ``running`` until it finishes.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from engine.llm_engine import EngineRequest


@dataclass
class SchedulerOutput:
    """One step's work: tokens to decode for running requests, then prompts to prefill."""

    decodes: list[EngineRequest] = field(default_factory=list)
    prefills: list[EngineRequest] = field(default_factory=list)

    @property
    def empty(self) -> bool:
        return not self.decodes and not self.prefills


class Scheduler:
    """FCFS admission under a block budget; at most ``max_num_seqs`` running at once."""

    def __init__(self, num_blocks: int, block_size: int, max_model_len: int, max_num_seqs: int = 16) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.max_num_seqs = max_num_seqs
        self.waiting: deque[EngineRequest] = deque()
        self.running: dict[str, EngineRequest] = {}
        self.reserved_blocks = 0

    def reservation(self, req: EngineRequest) -> int:
        """Blocks a request may need at most."""
        tokens = min(req.num_prompt_tokens + req.params.max_tokens, self.max_model_len)
        return -(-tokens // self.block_size)

    def add(self, req: EngineRequest) -> None:
        self.waiting.append(req)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput(decodes=list(self.running.values()))
        while self.waiting and len(self.running) < self.max_num_seqs:
            req = self.waiting[0]
            need = self.reservation(req)
            if self.reserved_blocks + need > self.num_blocks:
                break
            self.waiting.popleft()
            self.running[req.request_id] = req
            self.reserved_blocks += need
            out.prefills.append(req)
        return out

    def remove(self, request_id: str) -> EngineRequest | None:
        """Take a request out of the queues (finished or aborted); None if unknown."""
        req = self.running.pop(request_id, None)
        if req is not None:
            self.reserved_blocks -= self.reservation(req)
            return req
        for i, waiting in enumerate(self.waiting):
            if waiting.request_id == request_id:
                del self.waiting[i]
                return waiting
        return None

    def all_requests(self) -> list[EngineRequest]:
        return [*self.running.values(), *self.waiting]
