"""PackedDecodes against a float64 reference: compressed requests of different held
counts per layer, their pages spread over the layer pages of blocks taken in a
shuffled order, decoded together. Each new token's K/V land in its packed slot of
every layer (read back through PackedKV), its output is softmax attention over that
layer's held tokens plus itself, and the recorded scores are those probabilities
summed over heads, zero past each count."""

from __future__ import annotations

import random

import torch

from engine.model.kv_storage import KVLayout, KVStorage
from engine.model.packed_attention import PackedDecodes
from engine.model.packed_kv import PackedKV

LAYERS, HEADS, KV_HEADS, HEAD_DIM, BS = 4, 6, 2, 8, 4


def test_packed_decodes_match_reference_attention_and_record_scores():
    torch.manual_seed(0)
    storage = KVStorage(KVLayout(LAYERS, KV_HEADS, HEAD_DIM, BS, torch.float32), 64)
    blocks = list(range(64))
    random.Random(0).shuffle(blocks)
    held = [[13, 9, 6, 3], [21, 14, 5, 4], [7, 7, 7, 7]]  # per sequence, tokens per layer
    packed, data = [], []
    for counts in held:
        p = PackedKV(storage, counts)
        need = p.blocks_for([c + 1 for c in counts], BS)
        p.add_blocks(blocks[:need])
        del blocks[:need]
        p.fill(1)
        kv = [(torch.randn(c, KV_HEADS, HEAD_DIM), torch.randn(c, KV_HEADS, HEAD_DIM)) for c in counts]
        p.load(kv)
        packed.append(p)
        data.append(kv)
    rows = [0, 2, 3]  # batch rows of the three sequences; row 1 belongs to someone else
    t = 4
    query = torch.randn(t, HEADS, HEAD_DIM)
    key, value = torch.randn(t, KV_HEADS, HEAD_DIM), torch.randn(t, KV_HEADS, HEAD_DIM)
    scale = HEAD_DIM**-0.5
    decodes = PackedDecodes(rows, packed)
    outs = []
    with torch.inference_mode():
        for layer in range(LAYERS):
            out = query.new_zeros((t, HEADS * HEAD_DIM))
            decodes.attend(layer, query, key, value, scale, out)
            outs.append(out)
    assert all(torch.equal(out[1], torch.zeros(HEADS * HEAD_DIM)) for out in outs)
    recorded = decodes.scores.clone()
    decodes.advance()
    groups = HEADS // KV_HEADS
    for i, (p, row) in enumerate(zip(packed, rows, strict=True)):
        assert p.counts == [c + 1 for c in held[i]]
        assert p.since_selection == 1
        for layer in range(LAYERS):
            count = held[i][layer]
            stored_k, stored_v = p.read(layer, torch.arange(count + 1))
            keys = torch.cat([data[i][layer][0], key[row : row + 1]])
            values = torch.cat([data[i][layer][1], value[row : row + 1]])
            assert torch.equal(stored_k, keys) and torch.equal(stored_v, values)
            q = query[row].double().view(KV_HEADS, groups, HEAD_DIM) * scale
            probs = torch.softmax(torch.einsum("hgd,khd->hgk", q, keys.double()), dim=-1)
            want = torch.einsum("hgk,khd->hgd", probs, values.double()).reshape(-1)
            torch.testing.assert_close(outs[layer][row].double(), want, rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(recorded[layer, i, : count + 1].double(), probs.sum(dim=(0, 1)),
                                       rtol=1e-5, atol=1e-6)
            assert not recorded[layer, i, count + 1 :].any()
            torch.testing.assert_close(p.scores[layer, : count + 1], recorded[layer, i, : count + 1])


def test_reselect_keeps_each_layers_chosen_tokens_and_gives_blocks_back():
    """PackedKV.reselect, twice in a row (the storage's scratch reused, then grown): each
    layer holds exactly its kept tokens' K/V, in order, from the first pages on; the
    blocks no page needs are returned and no longer held."""
    torch.manual_seed(1)
    storage = KVStorage(KVLayout(LAYERS, KV_HEADS, HEAD_DIM, BS, torch.float32), 64)
    blocks = list(range(64))
    random.Random(1).shuffle(blocks)
    counts = [37, 22, 15, 9]
    p = PackedKV(storage, counts)
    p.add_blocks(blocks[: p.blocks_for(counts, BS)])
    p.fill()
    data = [(torch.randn(c, KV_HEADS, HEAD_DIM), torch.randn(c, KV_HEADS, HEAD_DIM)) for c in counts]
    p.load(data)
    gen = torch.Generator().manual_seed(2)
    for share in (0.5, 0.4):
        held = list(p.counts)
        keep = [torch.sort(torch.randperm(c, generator=gen)[: max(1, int(share * c))]).values for c in held]
        before = list(p.blocks)
        released = p.reselect(keep)
        assert p.counts == [k.numel() for k in keep]
        assert sorted(released + p.blocks) == sorted(before) and len(p.blocks) == p.blocks_for(p.counts, BS)
        data = [(k[idx], v[idx]) for (k, v), idx in zip(data, keep, strict=True)]
        for layer, (keys, values) in enumerate(data):
            got_k, got_v = p.read(layer, torch.arange(p.counts[layer]))
            assert torch.equal(got_k, keys) and torch.equal(got_v, values), layer
        assert all(pg % p.stride in p.blocks for pages in p.pages for pg in pages)  # pages of held blocks only
    before = storage.scratch(10)[0]
    assert storage.scratch(5)[0].data_ptr() == before.data_ptr()  # reused
    assert storage.scratch(10_000)[0].shape == (10_000, HEAD_DIM)
