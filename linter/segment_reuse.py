"""What segment reuse would win: documents that move between requests, beyond the prefix hit.

The engine's opt-in ``segment_reuse`` (docs/prompt_modules.md) reuses the KV of a
chat message, or of a text content part, of at least one block wherever the same
text appeared before for the same tenant, even when the exact prefix broke before
it (documents retrieved in another order, a tool result inserted in the middle).
Prefix caching cannot hit those tokens; this estimate counts them.

For each request in corpus order: every message part (``kind == "message"`` in
:mod:`linter.render`) of at least ``block_size`` tokens whose exact text appeared
in an earlier request, counted for its tokens past the request's prefix hit, in
whole blocks. Token positions come from tokenizing the rendered parts one by one
(a close estimate for an exact tokenizer, the same rule as the replay for the
approximate one). The set of documents seen is bounded (:data:`MAX_DOCUMENTS`;
cleared when full), as the engine's cache would evict too. Nothing here changes a
rule's figures.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

from linter.render import render
from linter.rule import Body
from linter.tokenizer import ApproxTokenizer, Tokenizer

MAX_DOCUMENTS = 200_000


def _part_tokens(tokenizer: Tokenizer, parts: Sequence[str]) -> list[int]:
    if isinstance(tokenizer, ApproxTokenizer):
        return [len(tokenizer.encode_parts([p])) if p else 0 for p in parts]
    return [len(tokenizer.encode(p)) if p else 0 for p in parts]


def segment_reuse_tokens(bodies: Sequence[Body], hits: Sequence[int], tokenizer: Tokenizer, block_size: int) -> int:
    """Prompt tokens segment reuse would serve from cache on top of the prefix hits ``hits``
    (one per body, from the replay of the same bodies)."""
    seen: set[bytes] = set()
    won = 0
    for body, hit in zip(bodies, hits, strict=True):
        rendered = render(body)
        counts = _part_tokens(tokenizer, rendered.parts)
        start = 0
        found: list[bytes] = []
        for text, kind, count in zip(rendered.parts, rendered.kinds, counts, strict=True):
            end = start + count
            if kind == "message" and count >= block_size:
                key = hashlib.blake2b(text.encode("utf-8", "surrogatepass"), digest_size=16).digest()
                found.append(key)
                if key in seen:
                    past_hit = end - max(start, hit)
                    if past_hit > 0:
                        won += past_hit // block_size * block_size
            start = end
        if len(seen) + len(found) > MAX_DOCUMENTS:
            seen.clear()
        seen.update(found)
    return won
