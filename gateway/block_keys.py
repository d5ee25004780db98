"""Block keys: the names of the KV blocks a request will use on an engine, computed in the gateway.

A request's keys are the engine's own hash chain (:func:`engine.hash_block_chain`,
pure Python) over the token ids the engine will compute, with the salt the
gateway derived for the tenant as block 0's extra key. For a prefixgate engine the
keys are therefore equal to the engine's block hashes; for any engine (vLLM
included) the gateway rehashes the token ids of the engine's KV events the same
way (:mod:`gateway.block_index`), so the engine's hash function and seed never
matter.

Invariants:

* token ids are the engine's: the chat template and message normalization of
  :class:`engine.chat.ChatRenderer` over :class:`gateway.chat_tokenizer.ChatTokenizer`;
  a completion prompt string is encoded with the tokenizer's special tokens, a
  prompt given as token ids is used as is;
* only full blocks have keys, and a hit can never cover the prompt's last token
  (its logits must be computed), so :attr:`RequestKeys.max_hit_blocks` is
  ``(num_tokens - 1) // block_size``;
* a request the gateway cannot tokenize (images, a template error, a body the
  engine will reject) has no keys: it is routed by load alone, never refused here.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from engine.kvcache.block_hash import BlockHash, hash_block_chain
from engine.server.chat import ChatRenderer
from gateway.chat_tokenizer import ChatTokenizer

log = logging.getLogger(__name__)

DEFAULT_BLOCK_SIZE = 16


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
        """The prompt token ids the engine will compute, or None when they cannot be known."""
        try:
            if endpoint == "responses":
                from gateway.responses_body import chat_view

                body, endpoint = chat_view(body) or {}, "chat.completions"
            if endpoint == "chat.completions":
                messages, tools = body.get("messages"), body.get("tools")
                if not isinstance(messages, list) or not messages:
                    return None
                if tools is not None and not isinstance(tools, list):
                    return None
                return self.renderer.render(messages, tools or None).token_ids
            prompt = body.get("prompt")
            if isinstance(prompt, str):
                return self.renderer.encode(prompt)
            if isinstance(prompt, list) and prompt and all(isinstance(t, int) and t >= 0 for t in prompt):
                return list(prompt)
        except Exception as exc:  # APIError for bad messages or images, template errors
            log.debug("no block keys for this request: %s", exc)
        return None

    def keys(self, endpoint: str, body: dict[str, Any], salt: str | None) -> RequestKeys | None:
        token_ids = self.token_ids(endpoint, body)
        if token_ids is None:
            return None
        return RequestKeys(len(token_ids), tuple(self.chain(token_ids, salt)), self.block_size)

    def chain(self, token_ids: list[int], salt: str | None) -> list[BlockHash]:
        return hash_block_chain(token_ids, self.block_size, cache_salt=salt)
