"""Compiled per-layer ops (benchmarks/compiled_kernels.py, an experiment of issue 27) keep eager's bits.

The written-out RMSNorm sum must be ATen's order exactly (checked eagerly, no
compiler), and the compiled kernels must equal the eager ops at any row count, in
float32 (the tiny model's dtype) and bfloat16, with the tiny model's shapes; a
whole tiny-model forward through :meth:`CompiledLayers.run` must give the eager
forward's logits and K/V for a prefill chunk, decodes and a mixed step. The bundled
model's figures are ``benchmarks/compiled_layers.py``'s.
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from engine.model import llama
from engine.model.kv_storage import KVLayout, KVStorage
from engine.model.runner import ModelRunner, SequenceInput

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "benchmarks"))
from compiled_kernels import CompiledLayers, aten_row_sum, rms_norm, sum_lanes

needs_compiler = pytest.mark.skipif(shutil.which("g++") is None and shutil.which("c++") is None,
                                    reason="inductor's CPU backend needs a C++ compiler (.ci/run installs g++)")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("width", [64, 100, 576, 2048, 8240])
def test_written_out_rms_norm_is_torchs_bits(dtype, width):
    lanes = sum_lanes()
    assert lanes is not None
    gen = torch.Generator().manual_seed(width)
    x = (torch.randn((37, width), generator=gen) * 30 * torch.rand((37, 1), generator=gen)).to(dtype)
    weight = torch.randn(width, generator=gen).to(dtype)
    squares = x.float().square()
    assert torch.equal(aten_row_sum(squares, lanes), squares.sum(-1))
    assert torch.equal(rms_norm(x, weight, 1e-5, lanes), weight * F.rms_norm(x, (width,), eps=1e-5))
    # a wrong lane count is caught: the check is not vacuous
    other = 16 if lanes != 16 else 8
    assert not torch.equal(aten_row_sum(squares, other), squares.sum(-1))


@needs_compiler
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_compiled_kernels_equal_eager_at_any_row_count(dtype):
    layers = CompiledLayers(1e-6, 4, 2, 16, 64, 128, dtype)
    assert layers.check(rows=(1, 2, 5, 8, 33, 100)) == []


@needs_compiler
def test_compiled_forward_gives_eager_logits_and_kv(tiny_model):
    config = tiny_model.config
    layout = KVLayout(num_layers=config.num_hidden_layers, kv_heads=config.num_key_value_heads,
                      head_dim=config.hidden_size // config.num_attention_heads, block_size=16, dtype=torch.float32)
    storage = KVStorage(layout, 64)
    runner = ModelRunner(tiny_model, storage)
    forward = runner._llama
    assert forward is not None
    compiled = CompiledLayers(forward.eps, forward.num_heads, forward.kv_heads, forward.head_dim,
                              config.hidden_size, config.intermediate_size, torch.float32)
    eager_call = forward.__call__

    def compiled_call(input_ids, positions, batch, logit_rows, embeds=None):
        assert embeds is None
        with torch.inference_mode():
            hidden = F.embedding(input_ids, forward.embed)
            cos, signed_sin = forward._angles(hidden, positions)
            hidden = compiled.run(forward.layers, hidden, cos, signed_sin, batch, forward.scale)
            return forward.lm_head(llama._rms_norm(hidden[logit_rows], forward.norm, forward.eps))

    gen = torch.Generator().manual_seed(0)

    def tokens(n):
        return torch.randint(10, 1000, (n,), generator=gen).tolist()

    tables = [list(range(8 * s, 8 * s + 8)) for s in range(8)]
    steps = [
        [SequenceInput(tokens(40), 0, tables[s], True) for s in range(3)],  # prefill chunks
        [SequenceInput(tokens(1), 40, tables[0], True)],  # a lone decode
        [SequenceInput(tokens(1), 41, tables[s], True) for s in range(3)],  # decodes
        [SequenceInput(tokens(23), 0, tables[3], True), SequenceInput(tokens(1), 42, tables[0], True)],  # mixed
    ]
    for seqs in steps:
        before = storage.all_keys.clone(), storage.all_values.clone()
        results = []
        for call in (eager_call, compiled_call):
            storage.all_keys.copy_(before[0])
            storage.all_values.copy_(before[1])
            runner._llama = type("Forward", (), {"row_multiple": forward.row_multiple,
                                                 "__call__": staticmethod(call)})()
            logits = runner.execute(seqs)
            results.append((logits, storage.all_keys.clone(), storage.all_values.clone()))
        (eager_logits, eager_keys, eager_values), (got_logits, got_keys, got_values) = results
        assert torch.equal(got_logits, eager_logits)
        assert torch.equal(got_keys, eager_keys) and torch.equal(got_values, eager_values)
        assert not torch.equal(eager_keys, before[0])  # the step wrote K/V
