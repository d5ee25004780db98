"""KV-cache events in vLLM's wire format: what the block pool caches, evicts and clears.

Configured like vLLM with ``--kv-events-config`` JSON (fields of vLLM's
``KVEventsConfig``): ``{"enable_kv_cache_events": true, "publisher": "zmq",
"endpoint": "tcp://127.0.0.1:5557", "replay_endpoint": "tcp://127.0.0.1:5558", "topic": "kv-events",
"buffer_steps": 10000, "hwm": 100000, "max_queue_size": 100000}``. An endpoint
with ``*``, ``::``, ``ipc://`` or ``inproc://`` is bound, another one connected, as
in vLLM; ``tcp://127.x.x.x:PORT`` is bound too, so a publisher can listen on
loopback only: the default endpoint does (vLLM's binds every interface), and
``prefixgate serve`` uses owner-only ``ipc://`` sockets, since events name every
tenant's tokens.

Wire format (the one vLLM >= 0.24 publishes): ZMQ PUB multipart
``[topic, seq (u64 big-endian, from 0), msgpack([ts, events, 0])]`` where each
event is a map tagged by ``"type"``:

* ``BlockStored``: ``block_hashes`` (each the last 8 bytes of our SHA256 block
  hash as an unsigned big-endian int, vLLM's default representation),
  ``parent_block_hash`` (same form, or nil for a chain's first block),
  ``token_ids`` (all the blocks' tokens), ``block_size``, ``lora_id``, ``medium``
  (``"GPU"``, the block pool, as vLLM names the device tier; ``"DISK"`` for a block
  written to ``--kv-offload-dir``, and at start for every block file found there),
  ``lora_name``, ``extra_keys``
  (one entry per block: nil, or a list of the LoRA id, the multimodal
  identifiers and, on block 0, the cache salt, in vLLM's order), ``group_idx`` 0;
* ``BlockRemoved``: ``block_hashes``, ``medium``, ``group_idx``: one per evicted
  block (a hash cached in two blocks is removed twice) or removed block file;
* ``AllBlocksCleared``: the prefix cache was reset, and the first event of every
  publisher (a restarted engine starts empty).

Events are collected from the engine thread without blocking it
(:class:`KvEventRecorder`, the block pool's event sink) and sent by a publisher
thread, which batches whatever has accumulated (one batch per wake-up, like
vLLM's one batch per step). The last ``buffer_steps`` batches are kept for the
replay socket (ROUTER): a request ``[b"", start_seq (8 bytes)]`` is answered with
every buffered ``[seq, payload]`` from ``start_seq`` on, then ``[-1, b""]``.
"""

from __future__ import annotations

import json
import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, fields
from typing import Any

from engine.kvcache.block_hash import BlockHash, MultiModalItem

log = logging.getLogger(__name__)

END_SEQ = (-1).to_bytes(8, "big", signed=True)
MEDIUM = "GPU"


@dataclass(frozen=True)
class KVEventsConfig:
    enable_kv_cache_events: bool = False
    publisher: str | None = None
    endpoint: str = "tcp://127.0.0.1:5557"  # vLLM's default binds tcp://*; ours stays on loopback
    replay_endpoint: str | None = None
    buffer_steps: int = 10_000
    hwm: int = 100_000
    max_queue_size: int = 100_000
    topic: str = ""

    @classmethod
    def from_json(cls, text: str) -> KVEventsConfig:
        """Parse ``--kv-events-config``; ValueError naming the bad field."""
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"--kv-events-config is not JSON: {exc}") from None
        if not isinstance(data, dict):
            raise ValueError(f"--kv-events-config must be a JSON object, got {text!r}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"--kv-events-config: unknown field(s) {unknown}")
        config = cls(**data)
        if not isinstance(config.enable_kv_cache_events, bool):
            raise ValueError(f"enable_kv_cache_events must be true/false, got {config.enable_kv_cache_events!r}")
        if config.publisher not in (None, "null", "zmq"):
            raise ValueError(f"publisher must be 'zmq' or 'null', got {config.publisher!r}")
        for name in ("buffer_steps", "hwm", "max_queue_size"):
            value = getattr(config, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if not isinstance(config.endpoint, str) or not isinstance(config.topic, str):
            raise ValueError("endpoint and topic must be strings")
        return config

    @property
    def enabled(self) -> bool:
        publisher = self.publisher or ("zmq" if self.enable_kv_cache_events else "null")
        return self.enable_kv_cache_events and publisher == "zmq"


def external_hash(block_hash: BlockHash) -> int:
    """vLLM's default wire form of a block hash: the digest's last 8 bytes, big-endian, unsigned."""
    return int.from_bytes(block_hash[-8:], "big")


def _extra_keys(first_block: int, num_blocks: int, block_size: int, salt: str | None,
                lora_id: str | int | None, mm_items: Sequence[MultiModalItem]) -> list[list[Any] | None]:
    out: list[list[Any] | None] = []
    for i in range(first_block, first_block + num_blocks):
        start, end = i * block_size, (i + 1) * block_size
        keys: list[Any] = [] if lora_id is None else [lora_id]
        keys += [[item.identifier, item.offset - start] for item in mm_items if item.offset < end and item.end > start]
        if i == 0 and salt is not None:
            keys.append(salt)
        out.append(keys or None)
    return out


class KvEventRecorder:
    """The block pool's event sink: turns pool changes into vLLM-shaped events (engine thread)."""

    def __init__(self, events: queue.SimpleQueue[dict[str, Any]]) -> None:
        self._events = events

    def blocks_stored(self, hashes: Sequence[BlockHash], parent: BlockHash | None, token_ids: Sequence[int],
                      block_size: int, first_block: int, cache_salt: str | None, lora_id: str | int | None,
                      mm_items: Sequence[MultiModalItem], medium: str = MEDIUM) -> None:
        if not hashes:
            return
        self._events.put({
            "type": "BlockStored",
            "block_hashes": [external_hash(h) for h in hashes],
            "parent_block_hash": None if parent is None else external_hash(parent),
            "token_ids": list(token_ids),
            "block_size": block_size,
            "lora_id": lora_id if isinstance(lora_id, int) else None,
            "medium": medium,
            "lora_name": lora_id if isinstance(lora_id, str) else None,
            "extra_keys": _extra_keys(first_block, len(hashes), block_size, cache_salt, lora_id, mm_items),
            "group_idx": 0,
        })

    def block_removed(self, block_hash: BlockHash, medium: str = MEDIUM) -> None:
        self._events.put({"type": "BlockRemoved", "block_hashes": [external_hash(block_hash)],
                          "medium": medium, "group_idx": 0})

    def all_cleared(self) -> None:
        self._events.put({"type": "AllBlocksCleared"})


class KvEventPublisher:
    """The ZMQ PUB (+ ROUTER replay) thread. ``start()``, then give ``recorder`` to the block pool."""

    def __init__(self, config: KVEventsConfig) -> None:
        import msgpack
        import zmq

        self.config = config
        self._packb = msgpack.packb
        self._events: queue.SimpleQueue[dict[str, Any]] = queue.SimpleQueue()
        self.recorder = KvEventRecorder(self._events)
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=config.buffer_steps)
        self._seq = 0
        self._stop = threading.Event()
        ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
        self._pub = ctx.socket(zmq.PUB)
        self._pub.set_hwm(config.hwm)
        endpoint = config.endpoint
        if "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://", "tcp://127.")):
            self._pub.bind(endpoint)
        else:
            self._pub.connect(endpoint)
        self._replay: zmq.Socket[bytes] | None = None
        if config.replay_endpoint is not None:
            self._replay = ctx.socket(zmq.ROUTER)
            self._replay.bind(config.replay_endpoint)
        self._topic = config.topic.encode("utf-8")
        self._thread = threading.Thread(target=self._run, name="prefixgate-kv-events", daemon=True)

    def start(self) -> None:
        # A fresh engine holds nothing: say so first, so subscribers drop what an earlier
        # process on the same endpoint had published.
        self._events.put({"type": "AllBlocksCleared"})
        self._thread.start()
        log.info("publishing KV events on %s (replay %s)", self.config.endpoint, self.config.replay_endpoint)

    @property
    def published(self) -> int:
        """How many batches this publisher has sent (the next batch's sequence number)."""
        return self._seq

    def shutdown(self, timeout: float = 2.0) -> None:
        self._stop.set()
        self._thread.join(timeout)
        self._pub.close(0)
        if self._replay is not None:
            self._replay.close(0)

    def _run(self) -> None:
        while not self._stop.is_set():
            if self._replay is not None and self._replay.poll(0):
                self._serve_replay()
            try:
                first = self._events.get(timeout=0.05)
            except queue.Empty:
                continue
            events = [first]
            while len(events) < self.config.max_queue_size:
                try:
                    events.append(self._events.get_nowait())
                except queue.Empty:
                    break
            self._send(events)

    def _send(self, events: list[dict[str, Any]]) -> None:
        payload = self._packb([time.time(), events, 0])
        seq = self._seq
        self._seq += 1
        self._pub.send_multipart([self._topic, seq.to_bytes(8, "big"), payload])
        self._buffer.append((seq, payload))

    def _serve_replay(self) -> None:
        assert self._replay is not None
        frames = self._replay.recv_multipart()
        if len(frames) != 3:
            return
        client, _, start = frames
        first = int.from_bytes(start, "big")
        for seq, payload in list(self._buffer):
            if seq >= first:
                self._replay.send_multipart([client, b"", seq.to_bytes(8, "big"), payload])
        self._replay.send_multipart([client, b"", END_SEQ, b""])
