"""The engine's KV-event publisher and the gateway's subscriber, over real ZMQ on loopback.

A real ``KVCacheManager`` publishes what it caches, evicts and clears; the
gateway's index, rebuilt from the events' token ids, must hold exactly the keys
the gateway computes for the same prompts (which, for prefixgate's engine, are
the engine's own block hashes), lose them on eviction and on a reset, and be
rebuilt by the replay socket for a subscriber that starts late.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator

import pytest
from support.net import free_port

from engine.kvcache.block_hash import hash_block_chain
from engine.kvcache.kv_cache_manager import KVCacheManager
from engine.kvcache.request import Request
from engine.server.kv_event_publisher import KvEventPublisher, KVEventsConfig
from gateway.routing.block_index import ReplicaIndex
from gateway.routing.kv_events import EventSource, KvEventSubscriber

BS = 4


class Watch:
    """Wakes a waiter whenever a subscriber applied a batch."""

    def __init__(self) -> None:
        self.cond = threading.Condition()

    def notify(self, seq: int) -> None:
        with self.cond:
            self.cond.notify_all()

    def until(self, predicate: Callable[[], bool], timeout: float = 10.0) -> None:
        deadline = time.monotonic() + timeout
        with self.cond:
            while not predicate():
                left = deadline - time.monotonic()
                assert left > 0, "the subscriber never reached the expected state"
                self.cond.wait(left)


@pytest.fixture
def publisher() -> Iterator[tuple[KvEventPublisher, str, str]]:
    port, replay = free_port(), free_port()
    config = KVEventsConfig.from_json(
        f'{{"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": "tcp://127.0.0.1:{port}", '
        f'"replay_endpoint": "tcp://127.0.0.1:{replay}", "topic": "kv-events"}}')
    pub = KvEventPublisher(config)
    pub.start()
    yield pub, f"tcp://127.0.0.1:{port}", f"tcp://127.0.0.1:{replay}"
    pub.shutdown()


def _run(manager: KVCacheManager, rid: str, tokens: list[int], salt: str | None) -> Request:
    request = Request(rid, tokens, cache_salt=salt)
    hit, n = manager.get_computed_blocks(request)
    assert manager.allocate_slots(request, len(tokens) - n, n, hit) is not None
    return request


def _rebind(config: KVEventsConfig) -> KvEventPublisher:
    """A new publisher on the same ports (ZMQ releases a closed socket's port asynchronously)."""
    import zmq

    deadline = time.monotonic() + 10
    while True:
        try:
            return KvEventPublisher(config)
        except zmq.ZMQError:
            assert time.monotonic() < deadline, "the old publisher's ports were never released"
            time.sleep(0.05)


@contextlib.contextmanager
def _restarted(pub: KvEventPublisher) -> Iterator[tuple[KvEventPublisher, KVCacheManager]]:
    """Stop ``pub`` and start a new engine process's publisher on the same ports (its
    sequence starts again at 0), with the new process's empty KV cache manager."""
    pub.shutdown()
    fresh = _rebind(pub.config)
    fresh.start()
    try:
        manager = KVCacheManager(num_blocks=64, block_size=BS)
        manager.block_pool.event_sink = fresh.recorder
        yield fresh, manager
    finally:
        fresh.shutdown()


def _subscriber(endpoint: str, replay: str, watch: Watch, idle_replay_s: float = 1.0) -> KvEventSubscriber:
    sub = KvEventSubscriber(EventSource(endpoint, replay, "kv-events"), ReplicaIndex(has_events=True), "r0",
                            on_batch=watch.notify, idle_replay_s=idle_replay_s)
    sub.start()
    return sub


def test_events_round_trip_store_evict_clear_and_replay(publisher) -> None:
    pub, endpoint, replay = publisher
    manager = KVCacheManager(num_blocks=8, block_size=BS)
    manager.block_pool.event_sink = pub.recorder
    watch = Watch()
    early = _subscriber(endpoint, replay, watch)
    try:
        tokens = list(range(100, 118))  # 4 full blocks + 2 tokens
        request = _run(manager, "a", tokens, "tenant-a")
        keys = hash_block_chain(tokens, BS, cache_salt="tenant-a")
        assert keys == request.block_hashes  # the gateway's keys are this engine's hashes
        watch.until(lambda: early.index.hit_blocks(keys) == 4)
        assert early.index.hit_blocks(hash_block_chain(tokens, BS, cache_salt="tenant-b")) == 0
        assert early.index.hit_blocks(hash_block_chain(tokens, BS)) == 0

        # A continuation hits block 0..3 and caches one more: its parent is a hit block.
        longer = [*tokens, 1, 2, 3, 4, 5]
        _run(manager, "b", longer, "tenant-a")
        watch.until(lambda: early.index.hit_blocks(hash_block_chain(longer, BS, cache_salt="tenant-a")) == 5)

        # A late subscriber rebuilds the same index from the replay socket.
        late = _subscriber(endpoint, replay, watch)
        try:
            watch.until(lambda: late.index.num_blocks == early.index.num_blocks == 5)
        finally:
            late.stop()

        # Free both and fill the pool with another prompt: the old blocks are evicted.
        manager.free("a")
        manager.free("b")
        other = list(range(500, 532))  # 8 blocks: the whole pool
        _run(manager, "c", other, None)
        watch.until(lambda: early.index.hit_blocks(keys) == 0)
        assert early.index.hit_blocks(hash_block_chain(other, BS)) == 8
        manager.free("c")
        assert manager.reset_prefix_cache()
        watch.until(lambda: early.index.num_blocks == 0)
        assert early.index.unresolved_blocks == 0
    finally:
        early.stop()


@pytest.fixture
def silent_endpoint() -> Iterator[str]:
    """A PUB socket that never sends: a subscriber on it only learns by replays."""
    import zmq

    silent = zmq.Context.instance().socket(zmq.PUB)
    silent.setsockopt(zmq.LINGER, 0)
    port = silent.bind_to_random_port("tcp://127.0.0.1")
    yield f"tcp://127.0.0.1:{port}"
    silent.close(0)


def test_a_batch_lost_on_the_live_socket_arrives_by_the_idle_replay(publisher, silent_endpoint: str) -> None:
    """PUB/SUB drops what is sent before the subscription lands; nothing later reveals the gap.

    The subscriber's live socket listens to a PUB that never sends: only the
    replay socket can bring the engine's batches. The first comes with the
    replay at start; the second, published after it, only with an idle replay.
    """
    pub, _, replay = publisher
    manager = KVCacheManager(num_blocks=16, block_size=BS)
    manager.block_pool.event_sink = pub.recorder
    first, second = list(range(9)), list(range(100, 109))
    _run(manager, "a", first, None)
    watch = Watch()
    sub = _subscriber(silent_endpoint, replay, watch, idle_replay_s=0.2)
    try:
        watch.until(lambda: sub.index.hit_blocks(hash_block_chain(first, BS)) == 2)
        _run(manager, "b", second, None)
        watch.until(lambda: sub.index.hit_blocks(hash_block_chain(second, BS)) == 2)
        assert sub.index.num_blocks == 4
    finally:
        sub.stop()


def _publish(manager: KVCacheManager, pub: KvEventPublisher, rid: str, tokens: list[int]) -> None:
    """Cache ``tokens`` and wait until the publisher sent them in a batch of their own."""
    before = pub.published
    _run(manager, rid, tokens, None)
    deadline = time.monotonic() + 10
    while pub.published == before:
        assert time.monotonic() < deadline, "the publisher never sent the batch"
        time.sleep(0.01)


@pytest.mark.parametrize("new_batches", [1, 6])
def test_a_restart_seen_only_by_the_replay_rebuilds_the_index(publisher, silent_endpoint: str,
                                                              new_batches: int) -> None:
    """The engine restarts while the live socket stays silent (every batch lost).

    The idle replay asks for the batch applied last: the new process either has
    fewer batches (the reply is empty) or another batch under that number (another
    payload). Either way the old blocks go and the new process's are indexed.
    """
    pub, _, replay = publisher
    manager = KVCacheManager(num_blocks=16, block_size=BS)
    manager.block_pool.event_sink = pub.recorder
    watch = Watch()
    sub = _subscriber(silent_endpoint, replay, watch, idle_replay_s=0.2)
    old = [list(range(10 * i, 10 * i + 9)) for i in range(3)]
    try:
        for i, tokens in enumerate(old):
            _publish(manager, pub, f"a{i}", tokens)
        watch.until(lambda: sub.last_seq == pub.published - 1 and sub.index.num_blocks == 6)
        old_last = sub.last_seq
        assert old_last is not None
        with _restarted(pub) as (fresh, manager2):
            new = [list(range(1000 + 10 * i, 1000 + 10 * i + 5)) for i in range(new_batches)]
            for i, tokens in enumerate(new):
                _publish(manager2, fresh, f"z{i}", tokens)
            assert (fresh.published - 1 > old_last) == (new_batches > 1)
            watch.until(lambda: all(sub.index.hit_blocks(hash_block_chain(t, BS)) == 1 for t in new))
            watch.until(lambda: sub.index.num_blocks == len(new))
            assert all(sub.index.hit_blocks(hash_block_chain(t, BS)) == 0 for t in old)
    finally:
        sub.stop()


def test_subscriber_intervals_must_be_positive() -> None:
    source = EventSource("tcp://127.0.0.1:1")
    with pytest.raises(ValueError, match="idle_replay_s"):
        KvEventSubscriber(source, ReplicaIndex(has_events=True), idle_replay_s=0)


def test_a_restarted_engine_empties_the_index(publisher) -> None:
    pub, endpoint, replay = publisher
    manager = KVCacheManager(num_blocks=16, block_size=BS)
    manager.block_pool.event_sink = pub.recorder
    watch = Watch()
    sub = _subscriber(endpoint, replay, watch)
    try:
        for i in range(3):  # three batches: the old process got to seq >= 3 (its first is the clear)
            _run(manager, f"a{i}", list(range(10 * i, 10 * i + 9)), None)
            watch.until(lambda i=i: sub.index.num_blocks == 2 * (i + 1))
        with _restarted(pub) as (_, manager2):
            # The subscriber reconnects on its own; the engine keeps publishing meanwhile.
            for i in range(40):
                tokens = list(range(1000 + 10 * i, 1000 + 10 * i + 5))
                _run(manager2, f"z{i}", tokens, None)
                try:
                    watch.until(lambda tokens=tokens: sub.index.hit_blocks(hash_block_chain(tokens, BS)) == 1, 0.25)
                    break
                except AssertionError:
                    continue
            else:
                pytest.fail("the subscriber never saw the restarted engine")
            assert sub.index.hit_blocks(hash_block_chain(list(range(9)), BS)) == 0
    finally:
        sub.stop()


@pytest.mark.parametrize("text, message", [
    ("nope", "not JSON"),
    ('{"enable_kv_cache_events": true, "bogus": 1}', "unknown field"),
    ('{"enable_kv_cache_events": true, "publisher": "kafka"}', "publisher"),
    ('{"enable_kv_cache_events": true, "hwm": 0}', "hwm"),
])
def test_bad_kv_events_config_is_a_value_error(text: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        KVEventsConfig.from_json(text)


def test_disabled_config_publishes_nothing() -> None:
    assert not KVEventsConfig.from_json('{"enable_kv_cache_events": false}').enabled
    assert not KVEventsConfig.from_json('{"enable_kv_cache_events": true, "publisher": "null"}').enabled
    assert KVEventsConfig.from_json('{"enable_kv_cache_events": true}').enabled
