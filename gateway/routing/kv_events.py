"""KV-cache events: decoding vLLM's wire format and a subscriber thread per replica.

Wire format (vLLM ``vllm/distributed/kv_events.py``, the same from prefixgate's
engine, :mod:`engine.server.kv_event_publisher`): a ZMQ PUB socket sends multipart
messages ``[topic, seq, payload]``; ``seq`` is an 8-byte big-endian counter from
0; ``payload`` is msgpack of an event batch ``[ts, events, data_parallel_rank]``
(a map ``{"ts", "events", "data_parallel_rank"}`` is accepted too). Each event is
a map tagged by ``"type"`` (vLLM >= 0.24, after vLLM PR #42892) or, in older
versions, an array whose first element is the tag and whose fields follow in
declaration order:

* ``BlockStored``: ``block_hashes, parent_block_hash, token_ids, block_size,
  lora_id, medium, lora_name, extra_keys, group_idx, ...``;
* ``BlockRemoved``: ``block_hashes, medium, group_idx``;
* ``AllBlocksCleared``: no fields.

Block hashes are opaque (an int of the digest's last 8 bytes by default in vLLM,
bytes otherwise): the gateway rehashes the token ids itself
(:class:`gateway.routing.block_index.ReplicaIndex`). The ``medium`` may be ``GPU`` (the
device tier) or ``DISK`` (prefixgate's ``--kv-offload-dir``: the replica loads such a
block instead of recomputing it, so it counts as held); the index counts stored
copies, so a block evicted from one medium stays known while the other holds it.
Events for another medium (vLLM's CPU offloading) or another KV-cache group than 0
are ignored.

Replay: a ROUTER socket answers a request ``[b"", start_seq (8 bytes)]`` with
every buffered ``[seq, payload]`` from ``start_seq`` on, then ``[-1, b""]``. The
subscriber asks for a replay from 0 when it starts (to rebuild the index of an
engine that was already running) and, later, from the last sequence it applied
whenever it sees a gap in ``seq``. A sequence number going backwards, or a replay
that no longer starts with the batch applied last, means the engine restarted: the
replica's index is dropped and rebuilt from 0.

A gap is only seen when a later batch arrives, and PUB/SUB drops what is sent
before a subscription reaches the publisher (at start, after a reconnect). So a
subscriber that has heard nothing for ``idle_replay_s`` also asks for a replay
(from its last sequence, as for a gap): a batch lost that way is applied within
about that interval even when the engine publishes nothing after it.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import msgpack
import zmq

from gateway.routing.block_index import ReplicaIndex

log = logging.getLogger(__name__)

END_SEQ = -1
STORED_FIELDS = ("block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium",
                 "lora_name", "extra_keys", "group_idx")
REMOVED_FIELDS = ("block_hashes", "medium", "group_idx")
ROUTED_MEDIA = (None, "GPU", "DISK")


def _fields(event: Any) -> tuple[str, dict[str, Any]] | None:
    """``(type, fields)`` of one event in either layout, or None when unreadable."""
    if isinstance(event, dict) and isinstance(event.get("type"), str):
        return event["type"], event
    if isinstance(event, list | tuple) and event and isinstance(event[0], str):
        kind = event[0]
        names = STORED_FIELDS if kind == "BlockStored" else REMOVED_FIELDS if kind == "BlockRemoved" else ()
        return kind, dict(zip(names, event[1:], strict=False))
    return None


def decode_batch(payload: bytes) -> list[tuple[str, dict[str, Any]]]:
    """The events of one msgpack batch; ValueError for a payload that is not a batch."""
    try:
        batch = msgpack.unpackb(payload, raw=False, strict_map_key=False, use_list=True)
    except Exception as exc:
        raise ValueError(f"undecodable KV-event batch: {exc}") from None
    if isinstance(batch, dict):
        events = batch.get("events")
    elif isinstance(batch, list) and len(batch) >= 2:
        events = batch[1]
    else:
        events = None
    if not isinstance(events, list):
        raise ValueError("KV-event batch without an events list")
    return [parsed for parsed in map(_fields, events) if parsed is not None]


def apply_events(index: ReplicaIndex, events: list[tuple[str, dict[str, Any]]]) -> None:
    for kind, fields in events:
        if fields.get("medium") not in ROUTED_MEDIA or fields.get("group_idx") not in (None, 0):
            continue
        hashes = fields.get("block_hashes")
        if kind == "AllBlocksCleared":
            index.cleared()
        elif not isinstance(hashes, list):
            continue
        elif kind == "BlockRemoved":
            index.removed([_hashable(h) for h in hashes])
        elif kind == "BlockStored":
            tokens, size = fields.get("token_ids"), fields.get("block_size")
            if not isinstance(tokens, list) or not isinstance(size, int):
                continue
            parent = fields.get("parent_block_hash")
            extra = fields.get("extra_keys")
            index.stored([_hashable(h) for h in hashes], None if parent is None else _hashable(parent),
                         tokens, size, extra if isinstance(extra, list) else None)


def _hashable(value: Any) -> Any:
    return tuple(value) if isinstance(value, list) else value


@dataclass(frozen=True)
class EventSource:
    """Where one replica publishes: ``endpoint`` (PUB), optional ``replay_endpoint`` (ROUTER), topic."""

    endpoint: str
    replay_endpoint: str | None = None
    topic: str = ""


class KvEventSubscriber:
    """A daemon thread applying one replica's event stream to its :class:`ReplicaIndex`.

    Invariant: the index holds exactly the batches ``0 .. last_seq`` of the engine
    process that sent batch ``last_seq`` (as far as the replay buffer reaches), so
    a replay asked from ``last_seq`` must start with the very batch applied last: when
    it does not (another payload, or nothing at all), the engine restarted, the index
    is dropped and rebuilt from 0.

    ``idle_replay_s``: after that long without a batch, ask the replay socket (when
    there is one) for anything missed; ``replay_timeout_s`` bounds each wait for it.
    """

    MAX_REPLAY_BATCHES = 100_000
    """A replay longer than this is cut there (vLLM buffers 10,000 batches by default)."""

    def __init__(self, source: EventSource, index: ReplicaIndex, name: str = "",
                 on_batch: Callable[[int], None] | None = None, idle_replay_s: float = 1.0,
                 replay_timeout_s: float = 2.0) -> None:
        if idle_replay_s <= 0 or replay_timeout_s <= 0:
            raise ValueError(f"idle_replay_s and replay_timeout_s must be > 0, got {idle_replay_s}, {replay_timeout_s}")
        self.source = source
        self.index = index
        self.name = name
        self.on_batch = on_batch
        self.idle_replay_s = idle_replay_s
        self.replay_timeout_s = replay_timeout_s
        self.last_seq: int | None = None
        self.batches = 0
        self._last_payload: bytes | None = None
        self._replay_failing = False
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"prefixgate-kv-events-{name}", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 2.0) -> None:
        self._stop.set()
        self._thread.join(timeout)

    def _run(self) -> None:
        sub: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.SUBSCRIBE, self.source.topic.encode("utf-8"))
        sub.connect(self.source.endpoint)
        try:
            self._catch_up()
            heard = time.monotonic()
            while not self._stop.is_set():
                if not sub.poll(100):
                    if time.monotonic() - heard >= self.idle_replay_s:
                        self._catch_up()
                        heard = time.monotonic()
                    continue
                heard = time.monotonic()
                frames = sub.recv_multipart()
                if len(frames) == 3:
                    self._receive(int.from_bytes(frames[1], "big", signed=True), frames[2])
        except Exception:  # never let a bad stream kill the gateway; the replica falls back to pending keys
            log.exception("KV-event subscriber %s stopped", self.name)
        finally:
            sub.close(0)

    def _receive(self, seq: int, payload: bytes) -> None:
        """One batch from the live socket."""
        last = self.last_seq
        if last is not None and seq == last and payload == self._last_payload:
            return  # already applied (a replay brought it first)
        if last is not None and seq <= last:
            log.info("KV-event sequence of %s went back (%s -> %s): engine restarted", self.name, last, seq)
            self._forget()
        expected = 0 if self.last_seq is None else self.last_seq + 1
        if seq != expected and self._catch_up() and self.last_seq is not None and seq <= self.last_seq:
            return  # the replay brought it
        self._apply(seq, payload)

    def _catch_up(self) -> bool:
        """Apply what the replay socket holds after ``last_seq``, first checking that it
        still holds the batch applied last; False when there is no replay to be had."""
        batches = self._fetch(0 if self.last_seq is None else self.last_seq)
        if batches is None:
            return False
        if self.last_seq is not None and (
                not batches or (batches[0][0] == self.last_seq and batches[0][1] != self._last_payload)):
            log.info("KV-event replay of %s no longer holds batch %s: engine restarted", self.name, self.last_seq)
            self._forget()
            batches = self._fetch(0)
            if batches is None:
                return False
        for seq, payload in batches:
            if self.last_seq is None or seq > self.last_seq:
                self._apply(seq, payload)
        return True

    def _apply(self, seq: int, payload: bytes) -> None:
        try:
            apply_events(self.index, decode_batch(payload))
        except ValueError as exc:
            log.warning("KV events of %s: %s", self.name, exc)
        self.last_seq, self._last_payload = seq, payload
        self.batches += 1
        if self.on_batch is not None:
            self.on_batch(seq)

    def _forget(self) -> None:
        self.index.forget()
        self.last_seq, self._last_payload = None, None

    def _fetch(self, start: int) -> list[tuple[int, bytes]] | None:
        """The replay socket's ``[seq, payload]`` batches from ``start`` on, or None when
        there is no replay socket or it did not answer in time."""
        if self.source.replay_endpoint is None:
            return None
        sock: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        batches: list[tuple[int, bytes]] = []
        try:
            sock.connect(self.source.replay_endpoint)
            sock.send_multipart([b"", start.to_bytes(8, "big")])
            deadline = time.monotonic() + self.replay_timeout_s
            while not self._stop.is_set():
                if not sock.poll(100):
                    if time.monotonic() < deadline:
                        continue
                    if not self._replay_failing:  # once per outage: idle asks repeat every interval
                        log.warning("no replay from %s", self.source.replay_endpoint)
                    self._replay_failing = True
                    return None
                deadline = time.monotonic() + self.replay_timeout_s
                frames = sock.recv_multipart()
                if len(frames) != 3:
                    continue
                seq = int.from_bytes(frames[1], "big", signed=True)
                if seq == END_SEQ:
                    self._replay_failing = False
                    return batches
                if len(batches) < self.MAX_REPLAY_BATCHES:
                    batches.append((seq, frames[2]))
            return None
        finally:
            sock.close(0)
