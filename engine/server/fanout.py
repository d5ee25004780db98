"""ChoiceFanout: the n engine requests behind one ``n > 1`` HTTP request, as one stream.

The prompt is prefilled once: choice 0 is submitted alone, and the other n - 1
are submitted when its first output arrives, by which time its prompt blocks are
computed and hashed. They take those blocks from the prefix cache (the KV cache
manager's ref counts share them; only the prompt's last partial block, fewer
than ``block_size`` tokens, is computed again per choice). Usage counts the
prompt once: choice 0's prompt and cached tokens.

Invariants:

* :meth:`ChoiceFanout.outputs` yields ``(choice index, StepOutput)`` until every
  choice has yielded its finished output;
* when the consumer stops early (client gone, error), every engine request not
  finished is cancelled, so all their blocks are freed;
* if the engine refuses the later choices (it shut down meanwhile), they finish
  with ``abort`` instead of leaving the consumer waiting.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from engine.core.llm_engine import GenerationRequest, LLMEngine, OutputStream, StepOutput


class ChoiceFanout:
    """Submits and merges the engine requests of one HTTP request (see the module docstring)."""

    def __init__(self, engine: LLMEngine, requests: list[GenerationRequest]) -> None:
        assert requests
        self.engine = engine
        self.requests = requests
        self.streams: list[OutputStream] = []
        self._rest_submitted = len(requests) == 1

    def submit_first(self) -> None:
        """Submit choice 0; raises what ``engine.submit`` raises (ValueError, RuntimeError)."""
        self.streams.append(self.engine.submit(self.requests[0]))

    async def outputs(self) -> AsyncIterator[tuple[int, StepOutput]]:
        queue: asyncio.Queue[tuple[int, StepOutput]] = asyncio.Queue()
        tasks = [asyncio.create_task(_pump(0, self.streams[0], queue))]
        pending = len(self.requests)
        try:
            while pending:
                index, out = await queue.get()
                if not self._rest_submitted:
                    self._submit_rest(queue, tasks)
                if out.finished:
                    pending -= 1
                yield index, out
        finally:
            for task in tasks:
                task.cancel()
            for stream in self.streams:
                if not stream.finished:
                    stream.cancel()

    def _submit_rest(self, queue: asyncio.Queue[tuple[int, StepOutput]],
                     tasks: list[asyncio.Task[None]]) -> None:
        self._rest_submitted = True
        for index in range(1, len(self.requests)):
            try:
                stream = self.engine.submit(self.requests[index])
            except (ValueError, RuntimeError) as exc:
                queue.put_nowait((index, StepOutput([], "", True, "abort", 0, 0, error=str(exc))))
                continue
            self.streams.append(stream)
            tasks.append(asyncio.create_task(_pump(index, stream, queue)))


async def _pump(index: int, stream: OutputStream,
                queue: asyncio.Queue[tuple[int, StepOutput]]) -> None:
    async for out in stream:
        queue.put_nowait((index, out))
