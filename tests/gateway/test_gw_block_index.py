"""ReplicaIndex (events, history, pending) and the routing policy, on real block keys."""

from __future__ import annotations

import msgpack
import pytest

from engine.kvcache.block_hash import hash_block_chain
from gateway.routing.block_index import ReplicaIndex
from gateway.routing.block_keys import RequestKeys
from gateway.routing.kv_events import apply_events, decode_batch
from gateway.routing.router import Router

BS = 4


def keys_of(tokens: list[int], salt: str | None = None) -> RequestKeys:
    return RequestKeys(len(tokens), tuple(hash_block_chain(tokens, BS, cache_salt=salt)), BS)


def engine_ids(tokens: list[int], salt: str | None = None) -> list[int]:
    """Stand-ins for an engine's own block hashes (vLLM sends the digest's last 8 bytes as an int)."""
    return [int.from_bytes(h[-8:], "big") ^ 0x5A5A for h in hash_block_chain(tokens, BS, cache_salt=salt)]


def test_stored_events_are_rehashed_to_gateway_keys_across_events() -> None:
    tokens = list(range(1, 21))  # 5 blocks
    ids = engine_ids(tokens, "s")
    index = ReplicaIndex(has_events=True)
    assert index.stored(ids[:2], None, tokens[:8], BS, [("s",), None]) == 2
    assert index.stored(ids[2:], ids[1], tokens[8:20], BS, [None, None, None]) == 3
    request = keys_of([*tokens, 99], "s")
    assert index.hit_blocks(request.keys) == 5
    assert index.hit_blocks(request.keys, request.max_hit_blocks) == 5
    assert index.hit_blocks(keys_of([*tokens, 99], "other").keys) == 0  # salts isolate
    assert index.hit_blocks(keys_of([*tokens, 99]).keys) == 0
    assert index.hit_blocks(keys_of([1, 2, 3, 4, 0, 0, 0, 0], "s").keys) == 1


def test_removal_counts_copies_and_clear_forgets_everything() -> None:
    tokens = list(range(8))
    ids = engine_ids(tokens)
    index = ReplicaIndex(has_events=True)
    index.stored(ids, None, tokens, BS)
    index.stored(ids, None, tokens, BS)  # a second physical copy of both blocks
    request = keys_of([*tokens, 1])
    index.removed([ids[1]])
    assert index.hit_blocks(request.keys) == 2
    index.removed([ids[1]])
    assert index.hit_blocks(request.keys) == 1
    index.cleared()
    assert index.hit_blocks(request.keys) == 0 and index.num_blocks == 0


def test_blocks_that_cannot_be_rehashed_get_no_key() -> None:
    tokens = list(range(8))
    ids = engine_ids(tokens)
    index = ReplicaIndex(has_events=True)
    assert index.stored(ids[1:], 12345, tokens[4:], BS) == 0  # unknown parent
    assert index.stored(ids[:1], None, tokens[:4], BS, [("lora-a", "salt")]) == 0  # LoRA + salt
    assert index.stored(ids, None, tokens[:6], BS) == 0  # token count is not blocks x size
    assert index.unresolved_blocks == 4 and index.hit_blocks(keys_of([*tokens, 1]).keys) == 0


def test_history_index_for_replicas_without_events_and_pending_keys() -> None:
    request = keys_of([*(range(12)), 7])
    history = ReplicaIndex(has_events=False, history_capacity=2)
    history.routed(request.keys)
    history.finished(request.keys)
    assert history.hit_blocks(request.keys) == 0  # only the 2 most recent keys are remembered
    history = ReplicaIndex(has_events=False)
    history.routed(request.keys)
    history.finished(request.keys)
    assert history.hit_blocks(request.keys) == 3
    exact = ReplicaIndex(has_events=True)
    exact.routed(request.keys)
    assert exact.hit_blocks(request.keys) == 3  # in flight: the engine caches at scheduling
    exact.finished(request.keys)
    assert exact.hit_blocks(request.keys) == 0  # done, and no event said the blocks are there


class FakeReplica:
    def __init__(self, name: str, has_events: bool = True) -> None:
        self.name = name
        self.index = ReplicaIndex(has_events=has_events)
        self.healthy = True
        self.in_flight = 0
        self.queued_prefill = 0
        self.last_chosen = 0


def test_router_prefers_the_cached_prefix_until_its_queue_costs_more() -> None:
    tokens = [*range(64), 1]  # 16 full blocks + 1 token
    request = keys_of(tokens, "t")
    a, b = FakeReplica("a"), FakeReplica("b")
    a.index.stored(engine_ids(tokens[:64], "t"), None, tokens[:64], BS, [("t",)] + [None] * 15)
    router = Router(load_cost_tokens=10, miss_weight=1.0)
    choice = router.choose([b, a], request)
    assert choice is not None and choice.replica is a and choice.predicted_cached_tokens == 64
    assert choice.prefill_tokens == 1
    a.in_flight, a.queued_prefill = 3, 3  # three cheap hits queued: 1 + 3 + 30 = 34 < 65 on b
    assert router.choose([b, a], request).replica is a  # type: ignore[union-attr]
    a.queued_prefill = 40  # a cold request queued: 1 + 40 + 30 = 71 > 65, recompute on b
    choice = router.choose([b, a], request)
    assert choice is not None and choice.replica is b and choice.predicted_cached_tokens == 0
    assert choice.prefill_tokens == 65
    assert Router(load_cost_tokens=10, miss_weight=2.0).choose([b, a], request).replica is a  # type: ignore[union-attr]
    a.in_flight = a.queued_prefill = 0
    a.healthy = False
    a.in_flight = 0
    assert router.choose([a, b], request).replica is b  # type: ignore[union-attr]
    assert router.choose([a, b], request, exclude=[b]).replica is a  # type: ignore[union-attr]
    assert router.choose([a, b], request, exclude=[a, b]) is None


def test_router_without_keys_balances_by_load_and_round_robin() -> None:
    replicas = [FakeReplica(n) for n in "abc"]
    router = Router()
    picked = [router.choose(replicas, None).replica.name for _ in range(6)]  # type: ignore[union-attr]
    assert picked == ["a", "b", "c", "a", "b", "c"]
    replicas[0].in_flight = 1
    assert router.choose(replicas, None).replica.name != "a"  # type: ignore[union-attr]


def test_another_tenants_blocks_never_attract_a_request() -> None:
    tokens = [*(range(64)), 1]
    a, b = FakeReplica("a"), FakeReplica("b")
    a.index.stored(engine_ids(tokens[:64], "tenant-a"), None, tokens[:64], BS, [("tenant-a",)] + [None] * 15)
    b.in_flight = 0
    a.last_chosen, b.last_chosen = 0, 1  # a would win a tie
    choice = Router().choose([a, b], keys_of(tokens, "tenant-b"))
    assert choice is not None and choice.hit_blocks == 0 and choice.predicted_cached_tokens == 0


@pytest.mark.parametrize("layout", ["map", "array"])
def test_both_vllm_event_layouts_decode_to_the_same_index(layout: str) -> None:
    tokens = list(range(8))
    ids = engine_ids(tokens, "s")
    if layout == "map":  # vLLM >= 0.24: tagged maps in an array batch
        events = [
            {"type": "BlockStored", "block_hashes": ids, "parent_block_hash": None, "token_ids": tokens,
             "block_size": BS, "lora_id": None, "medium": "GPU", "lora_name": None,
             "extra_keys": [["s"], None], "group_idx": 0, "kv_cache_spec_kind": "full_attention"},
            {"type": "BlockStored", "block_hashes": [7], "parent_block_hash": None, "token_ids": tokens[:4],
             "block_size": BS, "lora_id": None, "medium": "CPU"},  # another tier: ignored
            {"type": "BlockRemoved", "block_hashes": [ids[1]], "medium": "GPU"},
        ]
    else:  # older vLLM: array-like events, tag first
        events = [
            ["BlockStored", ids, None, tokens, BS, None, "GPU", None, [["s"], None]],
            ["BlockStored", [7], None, tokens[:4], BS, None, "CPU"],
            ["BlockRemoved", [ids[1]], "GPU"],
        ]
    index = ReplicaIndex(has_events=True)
    apply_events(index, decode_batch(msgpack.packb([1.5, events, 0])))
    assert index.hit_blocks(keys_of([*tokens, 1], "s").keys) == 1 and index.num_blocks == 1
    apply_events(index, decode_batch(msgpack.packb({"ts": 2.0, "events": [{"type": "AllBlocksCleared"}]})))
    assert index.num_blocks == 0
    with pytest.raises(ValueError):
        decode_batch(b"\xc1")


def test_router_sends_a_pml_schema_to_its_home_until_its_queue_costs_more() -> None:
    from gateway.routing.schema_affinity import Affinity, SchemaAffinity, affinity_key

    replicas = [FakeReplica(n) for n in "abc"]
    router = Router(load_cost_tokens=10, miss_weight=2.0)
    homes = {}
    for schema in ("rag", "faq", "docs", "code", "trip", "law"):
        affinity = Affinity(affinity_key("salt", schema), 100)
        home = max(replicas, key=lambda r, a=affinity: a.score(r.name))
        for _ in range(3):  # the same schema always lands on its home, whatever the round-robin says
            choice = router.choose(replicas, None, affinity=affinity)
            assert choice is not None and choice.replica is home
            assert choice.prefill_tokens == 0 and choice.predicted_cached_tokens is None
        homes[schema] = home.name
    assert len(set(homes.values())) > 1  # schemas spread over the replicas
    rag = Affinity(affinity_key("salt", "rag"), 100)
    home = next(r for r in replicas if r.name == homes["rag"])
    assert Affinity(affinity_key("other-tenant", "rag"), 100).key != rag.key
    home.queued_prefill = 150  # 150 < 2 * 100 elsewhere: stays
    assert router.choose(replicas, None, affinity=rag).replica is home  # type: ignore[union-attr]
    home.queued_prefill = 250  # 250 > 200: recomputed elsewhere, charged the schema's tokens
    choice = router.choose(replicas, None, affinity=rag)
    assert choice is not None and choice.replica is not home and choice.prefill_tokens == 100
    home.queued_prefill = 0
    fallback = router.choose(replicas, None, exclude=[home], affinity=rag)  # a retry: next-best replica
    assert fallback is not None and fallback.replica is not home
    # Removing another replica does not move the schema (rendezvous hashing).
    assert router.choose([r for r in replicas if r is home or r is not fallback.replica], None,
                         affinity=rag).replica is home  # type: ignore[union-attr]

    known = SchemaAffinity()
    body = {"prompt_format": "pml", "prompt": '<prompt schema="rag"><doc/>Q?</prompt>', "cache_salt": "salt"}
    assert known.of("completions", body) == Affinity(rag.key, 512)  # size unknown: the default
    known.registered("salt", "rag", 100)
    assert known.of("completions", body) == rag
    known.deleted("salt", "rag")
    assert known.of("completions", body).tokens == 512  # type: ignore[union-attr]
    assert known.of("chat.completions", body) is None
    assert known.of("completions", {**body, "prompt_format": "text"}) is None
    assert known.of("completions", {**body, "prompt": "<prompt schema='rag'>unclosed"}) is None
    assert known.of("completions", {**body, "prompt": "<prompt>no schema</prompt>"}) is None
