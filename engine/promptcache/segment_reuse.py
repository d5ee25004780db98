"""Chat segment reuse: a rendered chat prompt cut into position-independent documents.

With ``"segment_reuse": true`` on a chat request (or the engine's
``--segment-reuse`` default), every message content and every text content part of
at least :data:`MIN_SEGMENT_TOKENS` tokens (one KV block) becomes a
:class:`~engine.promptcache.segments.Segment` with module ``"segment"``: the engine
may reuse its KV wherever the same document appeared before, for the same cache
salt. Everything else (the chat template's glue, short messages) is computed.

Exactness of the prompt: the segments are cut from the very token ids the normal
path produced, never re-tokenized, so their concatenation *is* that prompt. A
document's segment holds the tokens whose characters lie wholly inside the
document's text in the render (from the tokenizer's offsets); documents are found
in the render in order. When the tokenizer gives no offsets, or gives other ids
than the normal path, there is no segmentation (None): the request runs as a plain
one, never with a guessed split.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from engine.promptcache.segments import Recovery, Segment, SegmentedPrompt

MIN_SEGMENT_TOKENS = 16
SEGMENT_MODULE = "segment"


def chat_documents(messages: Sequence[dict[str, Any]]) -> list[str]:
    """The texts of a chat request that may be segments: each string content and each
    text part, in order."""
    out: list[str] = []
    for message in messages:
        content = message.get("content")
        if isinstance(content, str):
            out.append(content)
        elif isinstance(content, list):
            out.extend(str(p["text"]) for p in content
                       if isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str))
    return out


def _offsets(tokenizer: Any, text: str, token_ids: list[int]) -> list[tuple[int, int]] | None:
    try:
        encoded = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    except (NotImplementedError, TypeError, ValueError):  # a slow tokenizer has no offsets
        return None
    if list(encoded["input_ids"]) != list(token_ids):
        return None
    return [(int(a), int(b)) for a, b in encoded["offset_mapping"]]


def segment_chat(tokenizer: Any, text: str, token_ids: list[int], documents: Sequence[str],
                 recovery: Recovery | None = None) -> SegmentedPrompt | None:
    """``token_ids`` (the render ``text`` tokenized by the normal path) as segments, one per
    document of at least one block; None when no document qualifies or offsets are missing."""
    offsets = _offsets(tokenizer, text, token_ids)
    if offsets is None or not token_ids:
        return None
    spans: list[tuple[int, int]] = []  # token ranges [i, j) of documents
    at = 0  # characters of the render already passed
    first = 0  # first token not yet assigned
    for doc in documents:
        if len(doc) < MIN_SEGMENT_TOKENS:  # a token has at least one character
            continue
        start = text.find(doc, at)
        if start == -1:
            continue
        end = start + len(doc)
        at = end
        i = first
        while i < len(offsets) and offsets[i][0] < start:
            i += 1
        j = i
        while j < len(offsets) and offsets[j][1] <= end:
            j += 1
        if j - i >= MIN_SEGMENT_TOKENS:
            spans.append((i, j))
            first = j
    if not spans:
        return None
    segments: list[Segment] = []
    cursor = 0
    for i, j in spans:
        if i > cursor:
            segments.append(Segment(tuple(token_ids[cursor:i])))
        segments.append(Segment(tuple(token_ids[i:j]), SEGMENT_MODULE))
        cursor = j
    if cursor < len(token_ids):
        segments.append(Segment(tuple(token_ids[cursor:])))
    return SegmentedPrompt(tuple(segments), recovery or Recovery())
