"""PackedLinear: the oneDNN-packed projections compute ``F.linear``'s bits, row by row, at
every row count the runner uses; float32 stays on ``F.linear``."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine.model.linear import PackedLinear, _packing_available
from engine.model.llama import LlamaForward

# The bundled SmolLM2-135M's projections: [q; k; v], o, [gate; up], down, LM head.
SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536), (49152, 576)]
ROWS = [1, 2, 3, 4, 5, 8, 12, 16, 20, 64, 100, 256, 512]

needs_packing = pytest.mark.skipif(
    not _packing_available(torch.bfloat16), reason="oneDNN has no bfloat16 kernels on this CPU"
)


@needs_packing
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_packed_bfloat16_is_f_linear_bit_for_bit(shape):
    generator = torch.Generator().manual_seed(sum(shape))
    weight = (torch.randn(shape, generator=generator) * 0.05).to(torch.bfloat16)
    before = weight.clone()
    linear = PackedLinear(weight)
    assert linear.is_packed
    x = torch.randn((max(ROWS), shape[1]), generator=generator).to(torch.bfloat16)
    with torch.inference_mode():
        full = linear(x)
        assert torch.equal(full, F.linear(x, weight))
        for rows in ROWS:
            assert torch.equal(linear(x[:rows]), F.linear(x[:rows], weight)), rows
            if rows % 4 == 0:  # the runner's row multiple: a row's bits do not depend on the count
                assert torch.equal(linear(x[:rows]), full[:rows]), rows
    assert torch.equal(weight, before)


def test_float32_is_not_packed_and_stays_f_linear():
    weight = torch.randn(96, 64)
    linear = PackedLinear(weight)
    assert not linear.is_packed
    x = torch.randn(8, 64)
    assert torch.equal(linear(x), F.linear(x, weight))


@needs_packing
def test_bfloat16_llama_forward_packs_every_projection(tiny_model):
    import copy

    model = copy.deepcopy(tiny_model).to(torch.bfloat16)
    forward = LlamaForward(model)
    projections = [p for layer in forward.layers for p in (layer.qkv, layer.o, layer.gate_up, layer.down)]
    assert all(p.is_packed for p in [*projections, forward.lm_head])
    # The fused matrices are still what the transformers modules compute with.
    attn = model.model.layers[0].self_attn
    assert attn.q_proj.weight.untyped_storage().data_ptr() == forward.layers[0].qkv.weight.untyped_storage().data_ptr()
