"""Scheduler: which requests run in the next engine step, first come first served.

Each step decodes one token for every running request, then admits waiting
requests in arrival order while their KV reservation fits (a request that does
not fit blocks the ones behind it: strict FCFS). The step's work is returned as
a list so that a later issue can run it as one batch.

Invariants:

* admission is by reservation: the running requests' reservations
  (``ceil(min(prompt + max_tokens, prompt + RESERVE_HORIZON, max_model_len) /
  block_size)`` blocks each) never exceed the pool. A request that generates past
  its horizon may find no free block: the engine then preempts the most recently
  admitted running request (:meth:`Scheduler.preempt`), which goes back to the
  front of the queue and is recomputed later, mostly from the prefix cache;
* a request is in exactly one of ``waiting`` and ``running`` until it finishes.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from engine.core.engine_request import EngineRequest

RESERVE_HORIZON = 1024
"""Output tokens a request's admission reservation covers at most."""


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
        self.reserve_horizon = RESERVE_HORIZON

    def reservation(self, req: EngineRequest) -> int:
        """Blocks set aside for a request at admission."""
        prompt = req.num_prompt_tokens
        tokens = min(prompt + req.params.max_tokens, prompt + self.reserve_horizon, self.max_model_len)
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

    def unadmit(self, req: EngineRequest) -> None:
        """Put a request whose blocks did not fit back at the head of the queue."""
        if self.running.pop(req.request_id, None) is not None:
            self.reserved_blocks -= self.reservation(req)
        self.waiting.appendleft(req)

    def preempt_victim(self) -> EngineRequest | None:
        """The most recently admitted running request (None when none runs)."""
        return next(reversed(self.running.values()), None)

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
