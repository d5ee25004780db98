"""Run prompts through an in-process engine at once; what each request produced."""

from __future__ import annotations

import asyncio
import itertools
from typing import Any

from engine.core.llm_engine import GenerationRequest, LLMEngine, SamplingParams

_ids = itertools.count()


def tokens_and_logprobs(engine: LLMEngine, prompts: list[list[int]], **params: Any) -> list[tuple[list, list]]:
    """Submit every prompt together (``params``: :class:`SamplingParams` fields); per
    request, its tokens and its ``(token, logprob, top)`` triples."""

    async def go() -> list:
        streams = [engine.submit(GenerationRequest(f"run-{next(_ids)}", p, SamplingParams(**params)))
                   for p in prompts]
        return await asyncio.gather(*(s.collect() for s in streams))

    return [([t for o in outs for t in o.new_token_ids],
             [(x.token_id, x.logprob, x.top) for o in outs for x in o.logprobs or []])
            for outs in asyncio.run(go())]
