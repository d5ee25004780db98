"""Block keys: the names of the KV blocks a request will use on an engine, computed in the gateway.

A request's keys are the engine's own hash chain (:func:`engine.hash_block_chain`,
pure Python) over the token ids the engine will compute, with the salt the
gateway derived for the tenant as block 0's extra key. For a prefixgate engine the
keys are therefore equal to the engine's block hashes; for any engine (vLLM
included) the gateway rehashes the token ids of the engine's KV events the same
way (:mod:`gateway.routing.block_index`), so the engine's hash function and seed never
matter.

Invariants:

* token ids are the engine's: the chat template and message normalization of
  :class:`engine.contract.chat.ChatRenderer` over :class:`engine.contract.chat_tokenizer.ChatTokenizer`;
  a completion prompt string is encoded with the tokenizer's special tokens, a
  prompt given as token ids is used as is;
* only full blocks have keys, and a hit can never cover the prompt's last token
  (its logits must be computed), so :attr:`RequestKeys.max_hit_blocks` is
  ``(num_tokens - 1) // block_size``;
* a request the gateway cannot tokenize (a template error, a body the engine will
  reject) has no keys: it is routed by load alone, never refused here;
* a request with images gets keys only for the full blocks before the message that
  holds its first image (:meth:`BlockKeyer.tokens_before_images`), never for a block
  an image may overlap: the engine keys those by the image's content hash and
  position, which depend on the model's image processor and placeholder expansion
  that the gateway does not load. :attr:`RequestKeys.num_tokens` is then a lower
  bound (those tokens and one more).

Tokens before the first image: the message holding it and everything after are
rendered with that message's content replaced by each of two special tokens of the
tokenizer and :data:`TEXT_PROBES` (a word, a newline) and the longest token prefix common to all
renders is kept. Special tokens are never merged with their neighbours, and the word
and the newline catch a template text that merges with the first content character,
so what is kept does not depend on what the engine puts first in that message (its
text, or its image placeholder: some templates, LLaVA's, put images first). The
assumption is that the engine renders an image inside its own message.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from engine.contract.chat import ChatRenderer
from engine.contract.chat_tokenizer import ChatTokenizer
from engine.contract.limits import BLOCK_SIZE
from engine.kvcache.block_hash import BlockHash, hash_block_chain

log = logging.getLogger(__name__)

DEFAULT_BLOCK_SIZE = BLOCK_SIZE
TEXT_PROBES = (" x", "\n")
IMAGE_PART_TYPES = ("image_url", "input_image")


@dataclass(frozen=True)
class RequestKeys:
    """The token count and full-block keys of one request (salt included in block 0)."""

    num_tokens: int
    keys: tuple[BlockHash, ...]
    block_size: int

    @property
    def max_hit_blocks(self) -> int:
        """Blocks a hit may cover: never the block holding the last prompt token."""
        return min(len(self.keys), max(0, (self.num_tokens - 1) // self.block_size))


class BlockKeyer:
    """Computes :class:`RequestKeys` for upstream request bodies; thread-safe."""

    def __init__(self, tokenizer: ChatTokenizer, block_size: int = DEFAULT_BLOCK_SIZE) -> None:
        if not isinstance(block_size, int) or block_size <= 0:
            raise ValueError(f"block_size must be a positive int, got {block_size!r}")
        self.tokenizer = tokenizer
        self.block_size = block_size
        self.renderer = ChatRenderer(tokenizer)

    @classmethod
    def from_model_dir(cls, model_dir: Path, block_size: int = DEFAULT_BLOCK_SIZE) -> BlockKeyer:
        return cls(ChatTokenizer(model_dir), block_size)

    def token_ids(self, endpoint: str, body: dict[str, Any]) -> list[int] | None:
        """The prompt token ids the engine will compute, or None when they cannot be known
        (images included: see :meth:`keys`)."""
        found = self._token_ids(endpoint, body)
        return found[0] if found is not None and found[1] else None

    def _token_ids(self, endpoint: str, body: dict[str, Any]) -> tuple[list[int], bool] | None:
        """The prompt token ids and True; or the ids before the first image and False; or None."""
        try:
            if endpoint == "responses":
                from gateway.responses.body import chat_view

                body, endpoint = chat_view(body) or {}, "chat.completions"
            if endpoint == "chat.completions":
                messages, tools = body.get("messages"), body.get("tools")
                if not isinstance(messages, list) or not messages:
                    return None
                if tools is not None and not isinstance(tools, list):
                    return None
                first = _first_image_message(messages)
                if first is not None:
                    prefix = self.tokens_before_images(messages, tools or None, first)
                    return None if prefix is None else (prefix, False)
                return self.renderer.render(messages, tools or None).token_ids, True
            prompt = body.get("prompt")
            if isinstance(prompt, str):
                return self.renderer.encode(prompt), True
            if isinstance(prompt, list) and prompt and all(isinstance(t, int) and t >= 0 for t in prompt):
                return list(prompt), True
        except Exception as exc:  # APIError for bad messages or images, template errors
            log.debug("no block keys for this request: %s", exc)
        return None

    def tokens_before_images(self, messages: list[Any], tools: list[Any] | None, first: int) -> list[int] | None:
        """The engine's token ids before message ``first`` (the first with an image) begins its
        content (see the module docstring); None when the tokenizer has no two special tokens."""
        listed = getattr(self.tokenizer, "special_added_tokens", None)
        specials: list[str] = list(listed())[:2] if callable(listed) else []
        if len(specials) < 2:
            return None
        common: list[int] | None = None
        for probe in (*specials, *TEXT_PROBES):
            probed = [*messages[:first], {**messages[first], "content": probe},
                      *(_without_images(m, probe) for m in messages[first + 1 :])]
            ids = self.renderer.render(probed, tools).token_ids
            common = ids if common is None else common[: _common_prefix(common, ids)]
        return common

    def keys(self, endpoint: str, body: dict[str, Any], salt: str | None) -> RequestKeys | None:
        found = self._token_ids(endpoint, body)
        if found is None:
            return None
        token_ids, complete = found
        chain = tuple(self.chain(token_ids, salt))
        return RequestKeys(len(token_ids) + (0 if complete else 1), chain, self.block_size)

    def chain(self, token_ids: list[int], salt: str | None) -> list[BlockHash]:
        return hash_block_chain(token_ids, self.block_size, cache_salt=salt)


def _is_image(part: object) -> bool:
    return isinstance(part, dict) and part.get("type") in IMAGE_PART_TYPES


def _first_image_message(messages: list[Any]) -> int | None:
    for index, message in enumerate(messages):
        content = message.get("content") if isinstance(message, dict) else None
        if isinstance(content, list) and any(_is_image(part) for part in content):
            return index
    return None


def _without_images(message: Any, probe: str) -> Any:
    """``message`` with each image part replaced by a text part (it lies past the prefix kept)."""
    content = message.get("content") if isinstance(message, dict) else None
    if not isinstance(content, list):
        return message
    return {**message, "content": [{"type": "text", "text": probe} if _is_image(p) else p for p in content]}


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    return next((i for i in range(n) if a[i] != b[i]), n)
