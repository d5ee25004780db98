"""KVOffload: the engine's KV blocks to and from the disk tier (``--kv-offload-dir``).

The tensor side of :class:`~engine.kvcache.disk_store.DiskKVStore`. Two paths, both
on the engine loop thread:

* **save** (:meth:`KVOffload.save`), after each successful forward: every block that
  became full in that forward and is neither on disk nor queued is copied out of
  :class:`~engine.model.kv_storage.KVStorage` at this step boundary (one copy per
  layer for all of them, :meth:`KVStorage.copy_blocks`) and handed to the store's
  writer thread, which turns each copy into bytes (numpy, no torch parallel work
  off the loop thread) and writes it. The forward never waits for the disk.
* **load** (:meth:`KVOffload.load`), the scheduler's admission path through
  :meth:`KVCacheManager.load_blocks`: the files of a request's hash chain past its
  RAM hit are read, checked, and copied into freshly popped blocks, which the
  manager then caches like any computed block.

The payload of a block is its K/V as ``[layers, 2, kv_heads, block_size, head_dim]``
in the cache's dtype; the store's fingerprint covers that layout, the dtype, the
block size and the model (its name and a sample of its weights), so a file of
another model or layout is never loaded. K/V bytes round-trip exactly, so a
request served from disk computes the same logits as one served from RAM or
computed from scratch.

Invariants: only full blocks whose K/V were written by a finished forward are
saved; a block is loaded only into a block popped for it and cached only after
its bytes are in place; every counter the metrics show lives in ``store.stats``.
"""

from __future__ import annotations

import functools
import hashlib
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from engine.kvcache.block_hash import BlockHash, MultiModalItem
from engine.kvcache.block_pool import BlockEventSink
from engine.kvcache.disk_store import DiskKVStore, fingerprint
from engine.kvcache.request import Request
from engine.model.kv_storage import GIB, KVStorage

DISK_MEDIUM = "DISK"
PAYLOAD_LAYOUT = "[layers, 2, kv_heads, block_size, head_dim]"

SaveItem = tuple[Request, int, int, Sequence[int]]
"""A scheduled sequence after its forward: request, first and end position computed, block table."""


def model_fingerprint(model: Any) -> str:
    """The model's name and a SHA256 over a strided sample of every parameter (cheap at any size)."""
    digest = hashlib.sha256(str(getattr(model.config, "name_or_path", "")).encode())
    for name, param in model.named_parameters():
        flat = param.detach().reshape(-1)
        sample = flat[:: max(1, flat.numel() // 1024)][:1024].float().contiguous()
        digest.update(name.encode())
        digest.update(sample.numpy().tobytes())
    return digest.hexdigest()


class KVOffload:
    """Saves full blocks to and loads them from a :class:`DiskKVStore`."""

    def __init__(self, storage: KVStorage, path: str, size_gib: float, model_id: str,
                 event_sink: Callable[[], BlockEventSink | None] = lambda: None) -> None:
        lay = storage.layout
        self.storage = storage
        self.block_size = lay.block_size
        self._event_sink = event_sink
        fp = fingerprint(model=model_id, dtype=str(lay.dtype), block_size=lay.block_size, num_layers=lay.num_layers,
                         kv_heads=lay.kv_heads, head_dim=lay.head_dim, layout=PAYLOAD_LAYOUT)
        self.store = DiskKVStore(path, int(size_gib * GIB), fp, lay.bytes_per_block,
                                 on_stored=self._stored, on_removed=self._removed)
        self.stats = self.store.stats

    # ------------------------------------------------------------------- save
    def save(self, sequences: Sequence[SaveItem]) -> int:
        """Queue every block that became full in these sequences' forward; returns how many."""
        bs = self.block_size
        picked: dict[BlockHash, tuple[int, dict[str, Any]]] = {}
        for req, start, end, block_ids in sequences:
            hashes = req.block_hashes
            for i in range(start // bs, min(end // bs, len(hashes))):
                h = hashes[i]
                if h not in picked and self.store.wanted(h):
                    picked[h] = (block_ids[i], _meta(req, i, bs))
        if not picked:
            return 0
        copies = self.storage.copy_blocks([bid for bid, _ in picked.values()])
        rows = copies.view(torch.uint8).numpy()  # shares memory; the writer calls tobytes()
        size = self.storage.layout.bytes_per_block
        queued = 0
        for i, (h, (_, meta)) in enumerate(picked.items()):
            queued += self.store.put(h, functools.partial(_row_bytes, rows, i), meta, size)
        return queued

    # ------------------------------------------------------------------- load
    def available(self, hashes: Sequence[BlockHash]) -> int:
        """How many leading ``hashes`` have a file; a chain stopping short counts one miss."""
        n = 0
        while n < len(hashes) and self.store.contains(hashes[n]):
            n += 1
        if n < len(hashes):
            self.stats.misses += 1
        return n

    def load(self, hashes: Sequence[BlockHash], block_ids: Sequence[int]) -> int:
        """Read the leading ``hashes``' files (stopping at the first unusable one) into ``block_ids``."""
        t0 = time.perf_counter()
        payloads: list[bytes] = []
        for h in hashes:
            payload = self.store.read(h)
            if payload is None:
                break
            payloads.append(payload)
        if payloads:
            lay = self.storage.layout
            buf = bytearray(b"".join(payloads))
            blocks = torch.frombuffer(buf, dtype=lay.dtype).view(
                len(payloads), lay.num_layers, 2, lay.kv_heads, lay.block_size, lay.head_dim)
            self.storage.load_blocks(block_ids[:len(payloads)], blocks)
        self.stats.hits += len(payloads)
        self.stats.load_count += 1
        self.stats.load_seconds += time.perf_counter() - t0
        return len(payloads)

    # ----------------------------------------------------------------- events
    def announce_existing(self) -> threading.Thread:
        """Announce every block file found at start (``medium`` DISK) from a background
        thread: reads each file's header only, emits chains in block order."""

        def run() -> None:
            found = [(h, m) for h in self.store.hashes() if (m := self.store.read_meta(h)) is not None]
            found.sort(key=lambda hm: int(hm[1].get("first", 0)))
            for h, meta in found:
                self._stored(h, meta)

        thread = threading.Thread(target=run, name="prefixgate-kv-offload-announce", daemon=True)
        thread.start()
        return thread

    def _stored(self, block_hash: BlockHash, meta: dict[str, Any]) -> None:
        sink = self._event_sink()
        if sink is None:
            return
        parent = meta.get("parent")
        mm = [MultiModalItem(str(i), int(o), int(n)) for i, o, n in meta.get("mm", [])]
        sink.blocks_stored([block_hash], None if parent is None else bytes.fromhex(parent), meta["tokens"],
                           self.block_size, int(meta["first"]), meta.get("salt"), meta.get("lora"), mm,
                           medium=DISK_MEDIUM)

    def _removed(self, block_hash: BlockHash) -> None:
        sink = self._event_sink()
        if sink is not None:
            sink.block_removed(block_hash, medium=DISK_MEDIUM)

    def close(self) -> None:
        """Finish queued writes and release the directory."""
        self.store.close()


def _row_bytes(rows: Any, i: int) -> bytes:
    """Block ``i``'s payload (a numpy copy: no torch work on the writer thread)."""
    return bytes(rows[i].tobytes())


def _meta(req: Request, i: int, bs: int) -> dict[str, Any]:
    """What a KV event needs to announce block ``i`` of ``req`` (stored in the file's header)."""
    start, end = i * bs, (i + 1) * bs
    return {
        "first": i,
        "parent": req.block_hashes[i - 1].hex() if i else None,
        "tokens": list(req.all_token_ids[start:end]),
        "salt": req.cache_salt if i == 0 else None,
        "lora": req.lora_id,
        "mm": [[m.identifier, m.offset, m.length] for m in req.mm_items if m.offset < end and m.offset + m.length > start],
    }
