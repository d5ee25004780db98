"""DiskKVStore: full KV blocks as files named by their block hash, bounded in bytes, LRU.

The disk tier below the block pool (``--kv-offload-dir DIR --kv-offload-size GIB``).
A block's hash already names its content across processes (salt, LoRA and image
keys included: :mod:`engine.kvcache.block_hash`), so it names the file:
``DIR/<sha256 hex>.kv``. Torch-free: payloads are bytes, produced and consumed by
:mod:`engine.model.kv_offload`.

File format (little-endian)::

    magic  b"PGKV\\x01\\x00\\x00\\x00"            8 bytes
    fingerprint (SHA256 of model, dtype, block size, layout)   32
    block hash                                                 32
    payload length u64, payload CRC32 u32, metadata length u32 16
    metadata (JSON: what a KV event needs to announce the block)
    payload (the block's K/V, exactly ``payload_bytes`` long)

Invariants:

* a file is visible under its final name only once complete: it is written to a
  ``.tmp-*`` name (``O_CREAT | O_EXCL``, 0600) and renamed; leftovers of a crash
  are removed at start;
* a file is loaded only if its magic, fingerprint, hash, lengths and checksum all
  match; any other file met under a block name is removed (and counted as corrupt);
* ``DIR`` is 0700, files 0600; every open is relative to a descriptor of ``DIR``
  opened with ``O_NOFOLLOW``, and files are opened with ``O_NOFOLLOW``: a symlink
  is never followed (one under a block name is removed);
* ``index`` holds every block file, least recently used first; the sum of its
  sizes stays at most ``max_bytes``: the writer evicts from the front before it
  writes. At start the index is built from names, sizes and mtimes only (no file
  is read), so the first request after a restart already hits;
* one process per ``DIR`` (an exclusive ``flock`` on ``DIR/.lock``).

Threads: :meth:`put` only queues (the engine loop calls it); one writer thread
writes. :meth:`contains`, :meth:`read` and :meth:`touch` run on the loop thread;
the index is shared under a lock. A write queue holding more than
``max_pending_bytes`` drops new blocks (counted) rather than grow without bound.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import json
import logging
import os
import queue
import stat
import struct
import threading
import zlib
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from engine.kvcache.block_hash import BlockHash

logger = logging.getLogger(__name__)

MAGIC = b"PGKV\x01\x00\x00\x00"
_FIXED = struct.Struct("<8s32s32sQII")
SUFFIX = ".kv"
TMP_PREFIX = ".tmp-"
DEFAULT_MAX_PENDING_BYTES = 256 * 1024**2


def fingerprint(**fields: Any) -> bytes:
    """SHA256 of the fields that make K/V bytes interchangeable (model, dtype, block size, layout)."""
    return hashlib.sha256(json.dumps(fields, sort_keys=True, default=str).encode()).digest()


@dataclass
class DiskStats:
    """Cumulative counters: blocks loaded (hits), chains that stopped at a block not on
    disk (misses), files found corrupt or foreign, writes dropped under back-pressure."""

    hits: int = 0
    misses: int = 0
    corrupt: int = 0
    dropped: int = 0
    bytes_read: int = 0
    bytes_written: int = 0
    files_written: int = 0
    evictions: int = 0
    load_count: int = 0
    load_seconds: float = 0.0


Writer = Callable[[], bytes]
"""Produces a block's payload on the writer thread."""


class DiskKVStore:
    """Block files under ``path``, at most ``max_bytes`` in all (see the module docstring)."""

    def __init__(self, path: str, max_bytes: int, fp: bytes, payload_bytes: int, *,
                 max_pending_bytes: int = DEFAULT_MAX_PENDING_BYTES,
                 on_stored: Callable[[BlockHash, dict[str, Any]], None] | None = None,
                 on_removed: Callable[[BlockHash], None] | None = None) -> None:
        if max_bytes <= 0:
            raise ValueError(f"kv offload size must be > 0 bytes, got {max_bytes!r}")
        if len(fp) != 32 or payload_bytes <= 0:
            raise ValueError("fingerprint must be 32 bytes and payload_bytes positive")
        self.path = os.path.abspath(os.path.expanduser(path))
        self.max_bytes = max_bytes
        self.fp = fp
        self.payload_bytes = payload_bytes
        self.file_bytes_max = _FIXED.size + payload_bytes
        self.max_pending_bytes = max_pending_bytes
        self.on_stored = on_stored
        self.on_removed = on_removed
        self.stats = DiskStats()
        self._lock = threading.Lock()
        self.index: OrderedDict[BlockHash, int] = OrderedDict()
        self.total_bytes = 0
        self._pending: set[BlockHash] = set()
        self._pending_bytes = 0
        self._queue: queue.SimpleQueue[tuple[BlockHash, Writer, dict[str, Any]] | None] = queue.SimpleQueue()
        self._dir_fd = _open_private_dir(self.path)
        self._lock_fd = _lock_dir(self._dir_fd, self.path)
        self._scan()
        self._thread = threading.Thread(target=self._write_loop, name="prefixgate-kv-offload", daemon=True)
        self._thread.start()

    # ---------------------------------------------------------------- start-up
    def _scan(self) -> None:
        """Index block files by name, size and mtime (oldest first); remove temp leftovers,
        symlinks and files whose size cannot be a block file. Reads no file."""
        found: list[tuple[float, BlockHash, int]] = []
        with os.scandir(self._dir_fd) as entries:
            for entry in entries:
                name = entry.name
                if name.startswith(TMP_PREFIX):
                    self._unlink(name)
                    continue
                block_hash = _hash_of(name)
                if block_hash is None:
                    continue
                st = entry.stat(follow_symlinks=False)
                if not stat.S_ISREG(st.st_mode) or not _FIXED.size + self.payload_bytes < st.st_size:
                    self._unlink(name)
                    self.stats.corrupt += 1
                    continue
                found.append((st.st_mtime, block_hash, st.st_size))
        found.sort(key=lambda f: f[0])
        for _, block_hash, size in found:
            self.index[block_hash] = size
            self.total_bytes += size
        self._evict_to(self.max_bytes)
        logger.info("KV offload: %d blocks on disk (%.1f MiB of %.1f MiB) in %s", len(self.index),
                    self.total_bytes / 2**20, self.max_bytes / 2**20, self.path)

    # -------------------------------------------------------------- loop thread
    def contains(self, block_hash: BlockHash) -> bool:
        with self._lock:
            return block_hash in self.index

    def wanted(self, block_hash: BlockHash) -> bool:
        """Neither on disk nor queued: worth copying out for :meth:`put`."""
        with self._lock:
            return block_hash not in self.index and block_hash not in self._pending

    def __len__(self) -> int:
        with self._lock:
            return len(self.index)

    def put(self, block_hash: BlockHash, payload: Writer, meta: dict[str, Any], size_hint: int) -> bool:
        """Queue a block for writing unless it is on disk, queued, or the queue is full.
        ``payload`` runs on the writer thread. Returns whether it was queued."""
        with self._lock:
            if block_hash in self.index or block_hash in self._pending:
                return False
            if self._pending_bytes + size_hint > self.max_pending_bytes:
                self.stats.dropped += 1
                return False
            self._pending.add(block_hash)
            self._pending_bytes += size_hint
        self._queue.put((block_hash, payload, {**meta, "_size": size_hint}))
        return True

    def read(self, block_hash: BlockHash) -> bytes | None:
        """The payload of ``block_hash``'s file, or None (not there, or removed as corrupt).
        A hit moves the file to the most-recently-used end."""
        if not self.contains(block_hash):
            return None
        name = block_hash.hex() + SUFFIX
        try:
            fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=self._dir_fd)
        except OSError as exc:
            self._drop(block_hash, corrupt=exc.errno == errno.ELOOP)
            return None
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or st.st_size > self.file_bytes_max + (1 << 20):
                self._drop(block_hash, corrupt=True)
                return None
            data = _read_all(fd, st.st_size)
        finally:
            os.close(fd)
        payload = self._check(block_hash, data)
        if payload is None:
            self._drop(block_hash, corrupt=True)
            return None
        with self._lock:
            self.stats.bytes_read += len(data)
            if block_hash in self.index:
                self.index.move_to_end(block_hash)
        with contextlib.suppress(OSError):  # the LRU order survives a restart
            os.utime(name, dir_fd=self._dir_fd, follow_symlinks=False)
        return payload

    def read_meta(self, block_hash: BlockHash) -> dict[str, Any] | None:
        """The metadata of a block file (reads its header only), or None when unreadable."""
        try:
            fd = os.open(block_hash.hex() + SUFFIX, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=self._dir_fd)
        except OSError:
            return None
        try:
            head = os.pread(fd, _FIXED.size, 0)
            if len(head) < _FIXED.size:
                return None
            magic, fp, h, _, _, meta_len = _FIXED.unpack(head)
            if magic != MAGIC or fp != self.fp or h != block_hash or meta_len > 1 << 20:
                return None
            meta: dict[str, Any] = json.loads(os.pread(fd, meta_len, _FIXED.size))
            return meta
        except (OSError, ValueError):
            return None
        finally:
            os.close(fd)

    def hashes(self) -> list[BlockHash]:
        """Every indexed block, least recently used first."""
        with self._lock:
            return list(self.index)

    def flush(self, timeout: float | None = None) -> None:
        """Wait until every block queued so far is written or dropped (tests, shutdown)."""
        done = threading.Event()
        self._queue.put((b"", lambda: b"", {"_flush": done}))
        done.wait(timeout)

    def close(self) -> None:
        """Finish queued writes, stop the writer, release ``DIR``."""
        if self._thread.is_alive():
            self._queue.put(None)
            self._thread.join()
        for fd in (self._lock_fd, self._dir_fd):
            with contextlib.suppress(OSError):
                os.close(fd)

    # ------------------------------------------------------------ writer thread
    def _write_loop(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            block_hash, payload_fn, meta = item
            flush = meta.pop("_flush", None)
            if flush is not None:
                flush.set()
                continue
            size = meta.pop("_size")
            try:
                self._write(block_hash, payload_fn(), meta)
            except Exception:  # a full or broken disk must not stop the engine
                logger.exception("KV offload: writing block %s failed", block_hash.hex()[:16])
            finally:
                with self._lock:
                    self._pending.discard(block_hash)
                    self._pending_bytes -= size

    def _write(self, block_hash: BlockHash, payload: bytes, meta: dict[str, Any]) -> None:
        if len(payload) != self.payload_bytes:
            raise ValueError(f"payload of {len(payload)} bytes, expected {self.payload_bytes}")
        meta_bytes = json.dumps(meta, separators=(",", ":")).encode()
        head = _FIXED.pack(MAGIC, self.fp, block_hash, len(payload), zlib.crc32(payload), len(meta_bytes))
        size = len(head) + len(meta_bytes) + len(payload)
        if size > self.max_bytes:
            return
        self._evict_to(self.max_bytes - size)
        name = block_hash.hex() + SUFFIX
        tmp = f"{TMP_PREFIX}{block_hash.hex()}-{os.getpid()}"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600,
                     dir_fd=self._dir_fd)
        try:
            for part in (head, meta_bytes, payload):
                view = memoryview(part)
                while view:
                    view = view[os.write(fd, view):]
        except BaseException:
            os.close(fd)
            self._unlink(tmp)
            raise
        os.close(fd)
        os.rename(tmp, name, src_dir_fd=self._dir_fd, dst_dir_fd=self._dir_fd)
        with self._lock:
            old = self.index.pop(block_hash, None)
            self.total_bytes += size - (old or 0)
            self.index[block_hash] = size
            self.stats.bytes_written += size
            self.stats.files_written += 1
        if self.on_stored is not None:
            self.on_stored(block_hash, meta)

    # ------------------------------------------------------------------ helpers
    def _check(self, block_hash: BlockHash, data: bytes) -> bytes | None:
        if len(data) < _FIXED.size:
            return None
        magic, fp, h, payload_len, crc, meta_len = _FIXED.unpack_from(data)
        start = _FIXED.size + meta_len
        if (magic != MAGIC or fp != self.fp or h != block_hash or payload_len != self.payload_bytes
                or len(data) != start + payload_len):
            return None
        payload = data[start:]
        if zlib.crc32(payload) != crc:
            return None
        return payload

    def _evict_to(self, limit: int) -> None:
        while True:
            with self._lock:
                if self.total_bytes <= limit or not self.index:
                    return
                block_hash = next(iter(self.index))
            self._drop(block_hash, corrupt=False, eviction=True)

    def _drop(self, block_hash: BlockHash, *, corrupt: bool, eviction: bool = False) -> None:
        with self._lock:
            size = self.index.pop(block_hash, None)
            if size is None:
                return
            self.total_bytes -= size
            self.stats.corrupt += corrupt
            self.stats.evictions += eviction
        if corrupt:
            logger.warning("KV offload: removed unusable block file %s", block_hash.hex()[:16])
        self._unlink(block_hash.hex() + SUFFIX)
        if self.on_removed is not None:
            self.on_removed(block_hash)

    def _unlink(self, name: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(name, dir_fd=self._dir_fd)


def _hash_of(name: str) -> BlockHash | None:
    if not name.endswith(SUFFIX) or len(name) != 64 + len(SUFFIX):
        return None
    try:
        return bytes.fromhex(name[:64])
    except ValueError:
        return None


def _open_private_dir(path: str) -> int:
    """Create ``path`` 0700 (or check it), refuse a symlink or someone else's directory,
    make it 0700, and return a descriptor of it opened without following symlinks."""
    try:
        os.makedirs(path, mode=0o700, exist_ok=True)
    except FileExistsError:
        raise ValueError(f"--kv-offload-dir {path!r} exists and is not a directory") from None
    st = os.lstat(path)
    if stat.S_ISLNK(st.st_mode) or not stat.S_ISDIR(st.st_mode):
        raise ValueError(f"--kv-offload-dir {path!r} is a symlink or not a directory")
    if st.st_uid != os.getuid():
        raise ValueError(f"--kv-offload-dir {path!r} belongs to another user")
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    if stat.S_IMODE(os.fstat(fd).st_mode) != 0o700:
        logger.warning("KV offload: %s made private (0700)", path)
        os.fchmod(fd, 0o700)
    return fd


def _lock_dir(dir_fd: int, path: str) -> int:
    fd = os.open(".lock", os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600, dir_fd=dir_fd)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise ValueError(f"--kv-offload-dir {path!r} is used by another engine") from None
    return fd


def _read_all(fd: int, size: int) -> bytes:
    chunks: list[bytes] = []
    left = size
    while left > 0:
        chunk = os.read(fd, left)
        if not chunk:
            break
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)



__all__ = ["DiskKVStore", "DiskStats", "fingerprint"]
