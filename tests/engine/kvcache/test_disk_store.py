"""DiskKVStore: round trip, integrity (corrupt, truncated, foreign files), permissions,
symlinks, LRU at the size bound, restart from names and sizes, one process per directory."""

from __future__ import annotations

import hashlib
import os
import stat
from pathlib import Path

import pytest

from engine.kvcache.disk_store import SUFFIX, DiskKVStore, fingerprint

PAYLOAD = 1000
FP = fingerprint(model="m", dtype="float32", block_size=16, layout="x")


def h(i: int) -> bytes:
    return hashlib.sha256(f"block-{i}".encode()).digest()


def payload(i: int) -> bytes:
    return bytes([i % 256]) * PAYLOAD


def make(path, max_bytes=10**6, fp=FP, **kw) -> DiskKVStore:
    return DiskKVStore(str(path), max_bytes, fp, PAYLOAD, **kw)


def put(store, i, meta=None):
    assert store.put(h(i), lambda: payload(i), meta or {"first": i}, PAYLOAD)


def file_of(store, i):
    return os.path.join(store.path, h(i).hex() + SUFFIX)


@pytest.fixture
def store(tmp_path):
    s = make(tmp_path / "kv")
    yield s
    s.close()


def test_round_trip_and_permissions(store):
    put(store, 1, {"first": 0, "tokens": [1, 2]})
    store.flush()
    assert store.contains(h(1)) and store.read(h(1)) == payload(1)
    assert store.read_meta(h(1)) == {"first": 0, "tokens": [1, 2]}
    assert store.read(h(2)) is None
    assert stat.S_IMODE(os.stat(store.path).st_mode) == 0o700
    assert stat.S_IMODE(os.stat(file_of(store, 1)).st_mode) == 0o600
    assert store.stats.bytes_written == os.path.getsize(file_of(store, 1))
    assert store.stats.bytes_read == store.stats.bytes_written


def test_a_block_already_on_disk_or_queued_is_not_queued_again(store):
    put(store, 1)
    store.flush()
    assert not store.put(h(1), lambda: payload(1), {}, PAYLOAD)
    assert not store.wanted(h(1)) and store.wanted(h(2))


@pytest.mark.parametrize("damage", ["flip_payload", "truncate", "flip_header", "empty"])
def test_a_damaged_file_is_never_loaded_and_is_removed(store, damage):
    put(store, 1)
    store.flush()
    path = file_of(store, 1)
    data = bytearray(Path(path).read_bytes())
    if damage == "flip_payload":
        data[-5] ^= 0xFF
    elif damage == "truncate":
        data = data[:-10]
    elif damage == "flip_header":
        data[12] ^= 0xFF  # inside the fingerprint
    else:
        data = bytearray()
    Path(path).write_bytes(bytes(data))
    assert store.read(h(1)) is None
    assert not os.path.exists(path) and not store.contains(h(1))
    assert store.stats.corrupt == 1


def test_a_file_under_another_blocks_name_is_not_loaded(store):
    put(store, 1)
    put(store, 2)
    store.flush()
    os.replace(file_of(store, 1), file_of(store, 2))  # block 1's bytes named as block 2
    assert store.read(h(2)) is None
    assert store.stats.corrupt == 1


def test_a_foreign_fingerprint_is_never_loaded(tmp_path):
    a = make(tmp_path / "kv")
    put(a, 1)
    a.flush()
    a.close()
    b = make(tmp_path / "kv", fp=fingerprint(model="other", dtype="float32", block_size=16, layout="x"))
    try:
        assert b.contains(h(1))  # indexed by name at start ...
        assert b.read(h(1)) is None  # ... but never loaded, and removed
        assert not os.path.exists(file_of(b, 1))
    finally:
        b.close()


def test_symlinks_are_never_followed(tmp_path, store):
    secret = tmp_path / "secret"
    secret.write_bytes(b"x" * 2000)
    os.symlink(secret, file_of(store, 7))
    store.close()
    again = make(tmp_path / "kv")  # the scan removes a symlink under a block name
    try:
        assert not again.contains(h(7)) and not os.path.lexists(file_of(again, 7))
        assert secret.read_bytes() == b"x" * 2000
    finally:
        again.close()
    link = tmp_path / "link"
    os.symlink(tmp_path / "kv", link)
    with pytest.raises(ValueError, match="symlink"):
        make(link)


def test_an_existing_directory_is_made_private(tmp_path):
    d = tmp_path / "open"
    d.mkdir(mode=0o755)
    os.chmod(d, 0o755)
    s = make(d)
    s.close()
    assert stat.S_IMODE(os.stat(d).st_mode) == 0o700


def test_lru_eviction_keeps_the_total_under_the_bound(tmp_path):
    s = make(tmp_path / "kv", max_bytes=3 * 1150)  # 3 files of ~1.1 kB
    try:
        for i in range(3):
            put(s, i)
        s.flush()
        assert s.read(h(0)) is not None  # block 0 becomes the most recently used
        put(s, 3)
        s.flush()
        assert s.total_bytes <= s.max_bytes
        assert s.contains(h(0)) and not s.contains(h(1)) and s.contains(h(3))
        assert sorted(n for n in os.listdir(s.path) if n.endswith(SUFFIX)) == sorted(
            x.hex() + SUFFIX for x in s.hashes())
        assert s.stats.evictions == 1
    finally:
        s.close()


def test_restart_indexes_names_and_drops_partial_writes(tmp_path):
    a = make(tmp_path / "kv")
    for i in range(3):
        put(a, i)
    a.flush()
    a.close()
    (tmp_path / "kv" / (".tmp-" + h(9).hex() + "-1")).write_bytes(b"partial")
    b = make(tmp_path / "kv")
    try:
        assert len(b) == 3 and all(b.contains(h(i)) for i in range(3))
        assert b.stats.bytes_read == 0  # indexed without reading
        assert not any(n.startswith(".tmp-") for n in os.listdir(b.path))
        assert b.read(h(2)) == payload(2)
    finally:
        b.close()


def test_one_process_per_directory(store, tmp_path):
    with pytest.raises(ValueError, match="another engine"):
        make(tmp_path / "kv")


def test_events_for_written_and_removed_files(tmp_path):
    seen = []
    s = make(tmp_path / "kv", max_bytes=2 * 1200, on_stored=lambda bh, m: seen.append(("stored", bh, m["first"])),
             on_removed=lambda bh: seen.append(("removed", bh)))
    try:
        for i in range(3):
            put(s, i)
        s.flush()
        assert seen == [("stored", h(0), 0), ("stored", h(1), 1), ("removed", h(0)), ("stored", h(2), 2)]
    finally:
        s.close()


def test_a_full_write_queue_drops_blocks(tmp_path):
    s = make(tmp_path / "kv", max_pending_bytes=PAYLOAD)
    try:
        import threading

        gate = threading.Event()
        assert s.put(h(1), lambda: (gate.wait(10), payload(1))[1], {"first": 0}, PAYLOAD)
        assert not s.put(h(2), lambda: payload(2), {"first": 1}, PAYLOAD)
        assert s.stats.dropped == 1
        gate.set()
        s.flush()
        assert s.contains(h(1)) and not s.contains(h(2))
    finally:
        s.close()
