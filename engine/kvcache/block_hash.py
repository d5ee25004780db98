"""Block hashing: the SHA256 hash chain that names every full block of KV cache.

Pure Python (hashlib, array, struct). No torch: the linter and the gateway import
this module to reason with exactly the hashes the engine uses.

The chain
---------
``hash(block i) = SHA256(encode(parent, tokens_i, extra_keys_i))`` where ``parent``
is the hash of block ``i - 1`` and, for block 0, :data:`ROOT_BLOCK_HASH`.

Byte serialization (version 1), explicit so it is identical across processes,
machines and Python versions (no pickle, no ``hash()``)::

    parent              32 bytes (a SHA256 digest)
    block size          block 0 only: b"B" | u32 LE 4 | u32 LE block_size
    token ids           block_size x u32 little-endian
    extra keys          zero or more of: tag (1 byte) | u32 LE byte length | bytes

The token field has a fixed length within a chain and the extra keys are
tag-length-value records, so every message parses one way. The block size is
written once, in block 0, and reaches every later block through the parent:
chains built with different block sizes never share a hash, and later blocks pay
nothing for it (hashing cost is dominated by per-block overhead).

Extra key tags:

* ``S``: the request's ``cache_salt`` (UTF-8), first block only;
* ``L``: a LoRA adapter id given as a string (UTF-8), every block;
* ``N``: a LoRA adapter id given as an integer (decimal ASCII), every block;
* ``M``: a multimodal item, on every block its placeholder range overlaps, in
  prompt order (one block may carry several items). Payload: the identifier
  (UTF-8), then the item's offset relative to the block's first token (i64 LE,
  negative when it began in an earlier block) and its length (u32 LE). The range
  matters: with identifiers alone, images ``a`` and ``b`` laid out as
  ``[a a a b]`` and ``[a b b b]`` over identical placeholder tokens would collide.

Only full blocks get a hash: a partial last block is never looked up or cached.
"""

from __future__ import annotations

import hashlib
import struct
import sys
from array import array
from collections.abc import Sequence
from dataclasses import dataclass

BlockHash = bytes
"""A 32-byte SHA256 digest."""

ROOT_BLOCK_HASH: BlockHash = hashlib.sha256(b"prefixgate/block-hash/v1/root").digest()
"""Parent of the first block of every chain: SHA256 of ``b"prefixgate/block-hash/v1/root"``."""

_U32 = struct.Struct("<I")
_MAX_TOKEN_ID = 2**32 - 1


@dataclass(frozen=True, slots=True)
class MultiModalItem:
    """A multimodal input (an image) occupying ``length`` placeholder tokens at ``offset``.

    ``identifier`` is a content hash of the item (the engine uses SHA256 of the
    decoded bytes), so two prompts with the same image at the same place share blocks.
    """

    identifier: str
    offset: int
    length: int

    def __post_init__(self) -> None:
        if not isinstance(self.identifier, str) or not self.identifier:
            raise ValueError(f"multimodal identifier must be a non-empty string, got {self.identifier!r}")
        if not isinstance(self.offset, int) or self.offset < 0:
            raise ValueError(f"multimodal offset must be a non-negative int, got {self.offset!r}")
        if not isinstance(self.length, int) or self.length <= 0:
            raise ValueError(f"multimodal length must be a positive int, got {self.length!r}")

    @property
    def end(self) -> int:
        return self.offset + self.length


def _tagged(tag: bytes, payload: bytes) -> bytes:
    return tag + _U32.pack(len(payload)) + payload


def encode_salt(cache_salt: str | None) -> bytes:
    """Serialized extra key for a cache salt (empty for None)."""
    return b"" if cache_salt is None else _tagged(b"S", cache_salt.encode("utf-8"))


def encode_lora(lora_id: str | int | None) -> bytes:
    """Serialized extra key for a LoRA id (empty for None)."""
    if lora_id is None:
        return b""
    if isinstance(lora_id, bool):
        raise ValueError(f"lora_id must be a str or int, got {lora_id!r}")
    if isinstance(lora_id, int):
        return _tagged(b"N", str(lora_id).encode("ascii"))
    return _tagged(b"L", lora_id.encode("utf-8"))


_MM_RANGE = struct.Struct("<qI")


def encode_mm(item: MultiModalItem, block_start: int) -> bytes:
    """Serialized extra key for one multimodal item within the block starting at ``block_start``."""
    payload = item.identifier.encode("utf-8")
    return _tagged(b"M", _U32.pack(len(payload)) + payload + _MM_RANGE.pack(item.offset - block_start, item.length))


def pack_token_ids(token_ids: Sequence[int]) -> bytes:
    """Token ids as little-endian u32 bytes; ValueError for ids outside [0, 2**32)."""
    try:
        arr = array("I", token_ids)
    except (OverflowError, TypeError) as exc:
        bad = next((t for t in token_ids if not isinstance(t, int) or not 0 <= t <= _MAX_TOKEN_ID), None)
        raise ValueError(f"token ids must be ints in [0, 2**32), got {bad!r}") from exc
    if arr.itemsize != 4:  # pragma: no cover - exotic platforms only
        return struct.pack(f"<{len(token_ids)}I", *token_ids)
    if sys.byteorder == "big":  # pragma: no cover
        arr.byteswap()
    return arr.tobytes()


def block_size_header(block_size: int) -> bytes:
    """The block-size record that follows the root in block 0's serialization."""
    return b"B" + _U32.pack(4) + _U32.pack(block_size)


def hash_block_tokens(parent: BlockHash, token_ids: Sequence[int], extra: bytes = b"") -> BlockHash:
    """Hash of one block given its parent's hash, its token ids and its encoded extra keys.

    When ``parent`` is :data:`ROOT_BLOCK_HASH` the block is a chain's first, and the
    block-size record (``len(token_ids)``) is serialized after it.
    """
    head = parent + block_size_header(len(token_ids)) if parent == ROOT_BLOCK_HASH else parent
    return hashlib.sha256(head + pack_token_ids(token_ids) + extra).digest()


def mm_extra_keys(
    items: Sequence[MultiModalItem], start: int, end: int
) -> bytes:
    """Encoded keys of the items whose placeholder range overlaps [start, end)."""
    return b"".join(encode_mm(it, start) for it in items if it.offset < end and it.end > start)


def hash_block_chain(
    token_ids: Sequence[int],
    block_size: int,
    *,
    cache_salt: str | None = None,
    lora_id: str | int | None = None,
    mm_items: Sequence[MultiModalItem] = (),
    parent: BlockHash = ROOT_BLOCK_HASH,
    start_block: int = 0,
) -> list[BlockHash]:
    """Hashes of every full block of ``token_ids``, starting at block ``start_block``.

    ``parent`` must be the hash of block ``start_block - 1`` (the root for block 0),
    so a caller can extend a chain incrementally as tokens are appended. The salt
    enters block 0 only; the LoRA id every block; each multimodal item every block
    its range overlaps. ``mm_items`` must be sorted by offset.
    """
    if not isinstance(block_size, int) or block_size <= 0:
        raise ValueError(f"block_size must be a positive int, got {block_size!r}")
    num_full = len(token_ids) // block_size
    if start_block >= num_full:
        return []
    begin = start_block * block_size
    end = num_full * block_size
    packed = pack_token_ids(token_ids if begin == 0 and end == len(token_ids) else token_ids[begin:end])
    stride = 4 * block_size
    lora = encode_lora(lora_id)
    salt = encode_salt(cache_salt)
    sha256 = hashlib.sha256
    hashes: list[BlockHash] = []
    offsets = range(0, len(packed), stride)
    if start_block == 0:
        extra = lora
        if mm_items:
            extra += mm_extra_keys(mm_items, 0, block_size)
        parent = sha256(parent + block_size_header(block_size) + packed[:stride] + extra + salt).digest()
        hashes.append(parent)
        offsets = offsets[1:]
    if not mm_items and not lora:
        # Fast path (measured fastest on CPython 3.11): a slice, one concatenation
        # and one SHA256 call per block.
        for i in offsets:
            parent = sha256(parent + packed[i : i + stride]).digest()
            hashes.append(parent)
        return hashes
    for i in offsets:
        extra = lora
        if mm_items:
            start = begin + i // 4
            extra += mm_extra_keys(mm_items, start, start + block_size)
        parent = sha256(parent + packed[i : i + stride] + extra).digest()
        hashes.append(parent)
    return hashes
