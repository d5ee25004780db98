"""paged_attention at long contexts in bfloat16: a token's output has the same bits in a
256-row prefill chunk, in a 16-row tail and as a lone decode (the shapes of a cold
prefill, a warm cache hit and a decode step), at 2k-8k keys. Before the product of
probabilities and values ran in tiles of at most 16 rows, the 48-row tail rounded some
rows differently from the 768-row chunk at 2k keys (SmolLM2's 9 heads over 3 KV heads)."""

from __future__ import annotations

import pytest
import torch

from engine.model.attention import (
    AttentionBatch,
    DecodeGroup,
    SequenceSlice,
    padded_length,
    paged_attention,
)
from engine.model.kv_storage import KVLayout, KVStorage

HEADS, KV_HEADS, HEAD_DIM, BS = 9, 3, 64, 16


def attend(storage, queries, keys, values, start, end, decode):
    """Outputs of positions ``start .. end - 1`` computed in one call (a decode when
    ``decode``), as the runner lays it out (rows padded to 4, table to the padded length)."""
    table = list(range(padded_length(end) // BS))
    n = end - start
    pad = -n % 4
    slots = torch.tensor(storage.slot_ids(table, start, end) + [storage.pad_slot] * pad)

    def padded(t):
        return torch.cat([t[start:end], t.new_zeros((pad, *t.shape[1:]))])

    if decode:
        batch = AttentionBatch(storage, slots, [], [DecodeGroup.build([0], [start], [table], storage)])
    else:
        batch = AttentionBatch(storage, slots, [SequenceSlice(0, n, start, storage.rows(table))])
    with torch.inference_mode():
        return paged_attention(0, padded(queries), padded(keys), padded(values), batch, HEAD_DIM**-0.5)[:n]


@pytest.mark.parametrize("length", [2048, 4096, 8192])
def test_a_token_gets_the_same_bits_in_a_chunk_a_tail_and_a_decode(length):
    generator = torch.Generator().manual_seed(length)
    layout = KVLayout(num_layers=1, kv_heads=KV_HEADS, head_dim=HEAD_DIM, block_size=BS, dtype=torch.bfloat16)
    storage = KVStorage(layout, length // BS)

    def rand(heads):
        return torch.randn((length, heads, HEAD_DIM), generator=generator).to(torch.bfloat16)

    queries, keys, values = rand(HEADS) * 3, rand(KV_HEADS), rand(KV_HEADS)
    table = list(range(length // BS))
    with torch.inference_mode():
        storage.write(0, torch.tensor(storage.slot_ids(table, 0, length)), keys, values)
    chunk = attend(storage, queries, keys, values, length - 256, length, decode=False)
    tail = attend(storage, queries, keys, values, length - 16, length, decode=False)
    assert torch.equal(tail, chunk[-16:])
    for back in (1, 2, 5, 16):
        alone = attend(storage, queries, keys, values, length - back, length - back + 1, decode=True)
        assert torch.equal(alone[0], chunk[-back]), back


def test_scores_as_keys_first_change_no_bit(monkeypatch):
    """A decode and a short tail compute scores as ``K @ q^T`` only where this machine
    gives ``q @ K^T``'s bits (checked once on a probe): their outputs equal those with
    every scores product as ``q @ K^T``, whichever way the probe went."""
    from engine.model import attention

    length = 2048
    generator = torch.Generator().manual_seed(7)
    layout = KVLayout(num_layers=1, kv_heads=KV_HEADS, head_dim=HEAD_DIM, block_size=BS, dtype=torch.bfloat16)
    storage = KVStorage(layout, length // BS)

    def rand(heads):
        return torch.randn((length, heads, HEAD_DIM), generator=generator).to(torch.bfloat16)

    queries, keys, values = rand(HEADS) * 3, rand(KV_HEADS), rand(KV_HEADS)
    with torch.inference_mode():
        storage.write(0, torch.tensor(storage.slot_ids(list(range(length // BS)), 0, length)), keys, values)
    outputs, few = {}, attention.KEYS_FIRST_ROWS
    for rows in (few, 0):
        monkeypatch.setattr(attention, "KEYS_FIRST_ROWS", rows)
        outputs[rows] = (attend(storage, queries, keys, values, length - 16, length, decode=False),
                         attend(storage, queries, keys, values, length - 1, length, decode=True))
    # where this CPU's kernels disagree (seen on an AMD EPYC), the probe keeps every
    # product as q @ K^T: the outputs are equal either way
    assert torch.equal(outputs[0][0], outputs[few][0])
    assert torch.equal(outputs[0][1], outputs[few][1])
