"""Module hashes: the names of module KV blocks and of blocks assembled from modules.

Pure Python (hashlib), like :mod:`engine.kvcache.block_hash`, whose chain rule and
serialization these reuse; only the roots differ, so no module or assembled block
can ever share a hash with a block of an exact prompt.

* A *module chain* names the blocks holding one prompt module's KV, computed on
  its own: the tokens ``anchor + module`` from position 0 (the anchor is the short
  context it was encoded after, possibly empty). Its root is
  ``SHA256("prefixgate/module/v1" | salt | model | name | anchor length)``, and the
  chain runs over every block of ``anchor + module``, the partial last block
  included (hashed with a ``P`` record and its length, so a partial block never
  equals a full one).
* An *assembled chain* names the blocks of a request whose KV was built from
  modules, from its first block that holds a module token on: the request's
  ordinary chain (:class:`~engine.kvcache.request.Request`) continued from
  ``SHA256("prefixgate/assembled/v2" | key | parent)``, ``parent`` the hash of the
  block before (the root for block 0) and ``key`` describing the segmentation and
  the recovery (:func:`assembly_key` callers build it), so equal segmented requests
  share their blocks exactly and never an exact request's. The full blocks before
  the first module (the chat head) are computed exactly and keep the exact chain.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence

from engine.kvcache.block_hash import ROOT_BLOCK_HASH, BlockHash, hash_block_tokens, pack_token_ids

_U32 = struct.Struct("<I")


def _field(data: bytes) -> bytes:
    return _U32.pack(len(data)) + data


def module_root(cache_salt: str | None, model: str, name: str, anchor_len: int) -> BlockHash:
    """Root of a module chain: distinct per salt (tenant), model, module name and encode position."""
    salt = b"\x00" if cache_salt is None else b"\x01" + cache_salt.encode("utf-8")
    return hashlib.sha256(b"prefixgate/module/v1" + _field(salt) + _field(model.encode("utf-8"))
                          + _field(name.encode("utf-8")) + _U32.pack(anchor_len)).digest()


def module_block_hashes(token_ids: Sequence[int], block_size: int, root: BlockHash) -> list[BlockHash]:
    """Hashes of every block of ``token_ids`` (anchor then module), partial last block included."""
    if not isinstance(block_size, int) or block_size <= 0:
        raise ValueError(f"block_size must be a positive int, got {block_size!r}")
    hashes: list[BlockHash] = []
    parent = root
    for start in range(0, len(token_ids), block_size):
        chunk = token_ids[start : start + block_size]
        if len(chunk) < block_size:
            parent = hashlib.sha256(parent + b"P" + _U32.pack(len(chunk)) + pack_token_ids(chunk)).digest()
        else:
            parent = hash_block_tokens(parent, chunk)
        hashes.append(parent)
    return hashes


def assembled_root(key: bytes, parent: BlockHash = ROOT_BLOCK_HASH) -> BlockHash:
    """Parent of the first assembled block of a request described by ``key``, whose
    block before it hashes to ``parent`` (the root when there is none)."""
    return hashlib.sha256(b"prefixgate/assembled/v2" + _field(key) + parent).digest()
