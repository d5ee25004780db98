"""cacheblend's probe (issue 21) on a tiny random Llama: the layer-1 KV deviation finds the
tokens whose reused K/V are off, the selection recomputes those, and a request's runs
attended as one slice compute what separate runs compute."""

from __future__ import annotations

import pytest
import torch

from engine.core.assembly import Assembly, select_deviating
from engine.model.kv_storage import KVLayout, KVStorage
from engine.model.llama import language_parts
from engine.model.runner import ModelRunner, SequenceInput

BS = 16
TABLE = [0, 1, 2, 3]
TOKENS = [200 + (j * 37) % 3000 for j in range(60)]


@pytest.fixture
def runner(tiny_model):
    config = language_parts(tiny_model)[2]
    head_dim = config.hidden_size // config.num_attention_heads
    layout = KVLayout(config.num_hidden_layers, config.num_key_value_heads, head_dim, BS, torch.float32)
    return ModelRunner(tiny_model, KVStorage(layout, 8))


def layer(runner, i: int, end: int = len(TOKENS)) -> tuple[torch.Tensor, torch.Tensor]:
    slots = torch.tensor(runner.storage.slot_ids(TABLE, 0, end))
    return runner.storage.read(i, slots)


def test_probe_ranks_the_tokens_whose_layer1_kv_was_perturbed_most(runner):
    runner.execute([SequenceInput(TOKENS, 0, TABLE, sample=True)])  # exact K/V in every layer
    exact0, exact1 = layer(runner, 0), layer(runner, 1)
    storage = runner.storage
    perturbed = {41: 3.0, 17: 1.0, 50: 0.3}  # position -> noise scale, as reused K/V would deviate
    gen = torch.Generator().manual_seed(0)
    for pos, scale in perturbed.items():
        slot = torch.tensor(storage.slot_ids(TABLE, pos, pos + 1))
        k, v = storage.read(1, slot)
        noise = torch.randn(k.shape, generator=gen) * scale
        storage.write(1, slot, k + noise, v + noise)
    k0, v0 = storage.read(0, torch.tensor(storage.slot_ids(TABLE, 30, 31)))
    storage.write(0, torch.tensor(storage.slot_ids(TABLE, 30, 31)), k0 + 5, v0 + 5)  # layer 0 gets recomputed

    deviation = runner.probe(TOKENS, 0, TABLE, keep=False)
    assert deviation is not None and deviation.shape == (len(TOKENS), 2)
    order = deviation.sum(1).argsort(descending=True).tolist()
    assert order[:3] == [41, 17, 50]
    others = [p for p in range(len(TOKENS)) if p not in perturbed]
    assert float(deviation[others].max()) < 1e-6 * float(deviation[41].sum())
    assert all(torch.allclose(a, b) for a, b in zip(layer(runner, 0), exact0, strict=True))  # rewritten exactly
    assert not torch.allclose(layer(runner, 1)[0], exact1[0])  # keep=False: layer 1 untouched

    candidates = list(range(10, 60))
    asm = Assembly([], [(59, 60)], 0, 50, candidates=candidates, module_starts=[10] * 50, budget=2)
    asm.select(deviation.tolist(), 0)
    assert asm.runs == [(17, 18), (41, 42), (59, 60)] and asm.budget == 0 and asm.num_pending == 3

    runner.probe(TOKENS, 0, TABLE, keep=True)
    assert all(torch.allclose(a, b, atol=1e-5) for a, b in zip(layer(runner, 1), exact1, strict=True))


def test_selection_weighs_keys_and_values_by_their_mean():
    # values deviate on a 100x larger scale: without normalising, they alone would decide
    deviation = [(1.0, 100.0), (9.0, 100.0), (1.0, 300.0), (1.0, 100.0)]
    assert select_deviating([4, 5, 6, 7], deviation, 2) == {5, 6}
    assert select_deviating([4, 5, 6, 7], deviation, 0) == set()
    assert select_deviating([4, 5, 6, 7], [(0.0, 0.0)] * 4, 2) == {4, 5}  # ties: the earlier positions


def test_joined_runs_compute_what_separate_runs_compute(runner, tiny_model):
    """Runs [0, 20), [25, 26), [40, 60) of one request in one forward: as one slice
    (``joins``) or three, the same K/V and logits (float32, up to rounding)."""
    runs = [(0, 20), (25, 26), (40, 60)]

    def forward(joined: bool) -> tuple[torch.Tensor, list[torch.Tensor]]:
        runner.storage.all_keys.zero_()
        runner.storage.all_values.zero_()
        seqs = [SequenceInput(TOKENS[s:e], s, TABLE, sample=e == len(TOKENS), joins=joined and i > 0)
                for i, (s, e) in enumerate(runs)]
        logits = runner.execute(seqs)
        return logits, [t for i in range(2) for t in layer(runner, i)]

    separate, kv_separate = forward(False)
    joined, kv_joined = forward(True)
    assert joined.shape == separate.shape == (1, tiny_model.config.vocab_size)
    assert torch.allclose(joined, separate, atol=1e-4)
    assert all(torch.allclose(a, b, atol=1e-5) for a, b in zip(kv_joined, kv_separate, strict=True))
    with pytest.raises(ValueError, match="joining"):
        runner.execute([SequenceInput(TOKENS[:5], 0, TABLE, sample=False),
                        SequenceInput(TOKENS[3:8], 3, TABLE, sample=False, joins=True)])
