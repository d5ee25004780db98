"""A request as the KV cache manager sees it: token ids plus what enters the block hashes."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from engine.kvcache.block_hash import (
    ROOT_BLOCK_HASH,
    BlockHash,
    MultiModalItem,
    hash_block_chain,
)
from engine.kvcache.module_hash import assembled_root

MAX_CACHE_SALT_CHARS = 1024


class Request:
    """Prompt and output token ids of one request, and the hash chain over its full blocks.

    Invariants:

    * ``block_hashes[i]`` is the hash of tokens ``[i*bs, (i+1)*bs)`` chained from
      block 0, once the request is bound to a block size ``bs``; only full blocks
      have a hash, so ``len(block_hashes) == num_tokens // bs``.
    * the prompt, the salt, the LoRA id and the multimodal items never change;
      output tokens are only appended.
    * with ``assembly`` (a request whose KV is built from prompt modules), the first
      ``exact_blocks`` blocks (exact KV: before the first module) chain from the root
      like any request's; from block ``exact_blocks`` on the chain continues from
      :func:`~engine.kvcache.module_hash.assembled_root` of it: those blocks are never
      found by, nor find, an exact request's.
    """

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        cache_salt: str | None = None,
        lora_id: str | int | None = None,
        mm_items: Iterable[MultiModalItem] = (),
        *,
        block_size: int | None = None,
        assembly: bytes | None = None,
        exact_blocks: int = 0,
    ) -> None:
        if not isinstance(request_id, str) or not request_id:
            raise ValueError(f"request_id must be a non-empty string, got {request_id!r}")
        prompt = list(prompt_token_ids)
        if not prompt:
            raise ValueError(f"request {request_id!r}: prompt_token_ids must not be empty")
        if cache_salt is not None and (
            not isinstance(cache_salt, str) or not cache_salt or len(cache_salt) > MAX_CACHE_SALT_CHARS
        ):
            raise ValueError(
                f"cache_salt must be a non-empty string of at most {MAX_CACHE_SALT_CHARS} "
                f"characters, got {cache_salt!r:.80}"
            )
        items = sorted(mm_items, key=lambda it: it.offset)
        for item in items:
            if item.end > len(prompt):
                raise ValueError(
                    f"multimodal item {item.identifier!r} spans [{item.offset}, {item.end}) "
                    f"beyond the prompt's {len(prompt)} tokens"
                )
        self.request_id = request_id
        self.prompt_token_ids: list[int] = prompt
        self.output_token_ids: list[int] = []
        self._all_token_ids: list[int] = list(prompt)
        self.cache_salt = cache_salt
        self.lora_id = lora_id
        self.mm_items: tuple[MultiModalItem, ...] = tuple(items)
        self.block_hashes: list[BlockHash] = []
        self.block_size: int | None = None
        self.assembly = assembly
        self.exact_blocks = exact_blocks if assembly is not None else None
        if block_size is not None:
            self.bind_block_size(block_size)

    @property
    def all_token_ids(self) -> list[int]:
        """Prompt then output token ids (do not mutate)."""
        return self._all_token_ids

    @property
    def num_tokens(self) -> int:
        return len(self._all_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    def bind_block_size(self, block_size: int) -> None:
        """Fix the block size the hashes are computed with (idempotent for the same size)."""
        if self.block_size is not None:
            if self.block_size != block_size:
                raise ValueError(
                    f"request {self.request_id!r} is bound to block size {self.block_size}, "
                    f"not {block_size}"
                )
            return
        if not isinstance(block_size, int) or block_size <= 0:
            raise ValueError(f"block_size must be a positive int, got {block_size!r}")
        self.block_size = block_size
        self._extend_block_hashes()

    def append_output_token_ids(self, token_ids: int | Iterable[int]) -> None:
        """Append generated tokens; hashes of blocks that became full are added."""
        new = [token_ids] if isinstance(token_ids, int) else list(token_ids)
        for tok in new:
            if not isinstance(tok, int) or tok < 0:
                raise ValueError(f"token ids must be non-negative ints, got {tok!r}")
        self.output_token_ids.extend(new)
        self._all_token_ids.extend(new)
        self._extend_block_hashes()

    def _extend_block_hashes(self) -> None:
        if self.block_size is None:
            return
        tokens = self._all_token_ids
        if self.exact_blocks is not None and len(self.block_hashes) <= self.exact_blocks:
            self._extend_chain(tokens[: self.exact_blocks * self.block_size])
            if len(self.block_hashes) < self.exact_blocks:
                return
            parent = self.block_hashes[-1] if self.block_hashes else ROOT_BLOCK_HASH
            assert self.assembly is not None
            self._extend_chain(tokens, assembled_root(self.assembly, parent))
        else:
            self._extend_chain(tokens)

    def _extend_chain(self, tokens: list[int], parent: BlockHash | None = None) -> None:
        assert self.block_size is not None
        start = len(self.block_hashes)
        if parent is None:
            parent = self.block_hashes[-1] if self.block_hashes else ROOT_BLOCK_HASH
        self.block_hashes.extend(
            hash_block_chain(
                tokens,
                self.block_size,
                cache_salt=self.cache_salt,
                lora_id=self.lora_id,
                mm_items=self.mm_items,
                parent=parent,
                start_block=start,
            )
        )

    def __repr__(self) -> str:
        return f"Request({self.request_id!r}, num_tokens={self.num_tokens})"
