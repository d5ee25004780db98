"""PackedLinear: a row's bits do not depend on how many rows share the call (every row
count the runner uses, up to 512, any offset), in bfloat16 and float32; bfloat16 tiles
compute ``F.linear``'s bits."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine.model.linear import FREE_ROWS, ROW_TILE, PackedLinear, _packing_available, row_invariant
from engine.model.llama import LlamaForward

# The bundled SmolLM2-135M's projections: [q; k; v], o, [gate; up], down, LM head.
SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536), (49152, 576)]
ROWS = [4, 8, 12, 16, 20, 28, 32, 36, 64, 100, 256, 512]  # the runner pads to a multiple of 4
DTYPES = [torch.bfloat16, torch.float32]


def needs_packing(dtype):
    return pytest.mark.skipif(not _packing_available(dtype), reason=f"oneDNN has no {dtype} kernels on this CPU")


@pytest.mark.parametrize("dtype", [pytest.param(d, marks=needs_packing(d)) for d in DTYPES], ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_a_row_gets_the_same_bits_at_every_row_count(shape, dtype):
    generator = torch.Generator().manual_seed(sum(shape))
    weight = (torch.randn(shape, generator=generator) * 0.05).to(dtype)
    before = weight.clone()
    linear = PackedLinear(weight)
    assert linear.is_packed
    x = torch.randn((max(ROWS) + 8, shape[1]), generator=generator).to(dtype)
    with torch.inference_mode():
        full = linear(x)
        for rows in ROWS:
            assert torch.equal(linear(x[:rows]), full[:rows]), rows
            assert torch.equal(linear(x[8 : 8 + rows]), full[8 : 8 + rows]), rows
        assert torch.allclose(full.float(), F.linear(x, weight).float(), rtol=1e-2, atol=1e-2)
    assert torch.equal(weight, before)


@needs_packing(torch.bfloat16)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_bfloat16_tiles_compute_f_linear_bits(shape):
    generator = torch.Generator().manual_seed(sum(shape))
    weight = (torch.randn(shape, generator=generator) * 0.05).to(torch.bfloat16)
    linear = PackedLinear(weight)
    x = torch.randn((3 * ROW_TILE, shape[1]), generator=generator).to(torch.bfloat16)
    with torch.inference_mode():
        for rows in (1, 4, 12, ROW_TILE):
            assert torch.equal(linear(x[:rows]), F.linear(x[:rows], weight)), rows
        tiles = torch.cat([F.linear(x[k : k + ROW_TILE], weight) for k in range(0, len(x), ROW_TILE)])
        assert torch.equal(linear(x), tiles)


@pytest.mark.parametrize("exact_rows", [0, 1, 31, 32, 33, 100, 300])
def test_rows_past_exact_rows_go_in_one_call_and_the_others_keep_their_bits(exact_rows):
    """``exact_rows``: the rows before it keep the bits of the tiled product; the tiles
    that hold them are computed as without it, the rows after them in one call of a
    multiple of FREE_ROWS rows and one of the rest."""
    generator = torch.Generator().manual_seed(exact_rows)
    weight = (torch.randn((576, 576), generator=generator) * 0.05).to(torch.bfloat16)
    linear = PackedLinear(weight)
    x = torch.randn((300, 576), generator=generator).to(torch.bfloat16)
    calls = []
    product = linear._product
    linear._product = lambda rows: calls.append(rows.shape[0]) or product(rows)
    with torch.inference_mode():
        tiled = linear(x)
        calls.clear()
        split = linear(x, exact_rows)
    assert torch.equal(split[:exact_rows], tiled[:exact_rows])
    torch.testing.assert_close(split.float(), F.linear(x, weight).float(), rtol=1e-2, atol=1e-2)
    tiled = min(300, -(-exact_rows // ROW_TILE) * ROW_TILE)
    rest = 300 - tiled
    expected = [min(ROW_TILE, tiled - k) for k in range(0, tiled, ROW_TILE)]
    expected += [c for c in (rest // FREE_ROWS * FREE_ROWS, rest % FREE_ROWS) if c]
    assert calls == expected


def test_the_check_rejects_a_product_whose_rows_depend_on_the_count():
    weight = torch.randn(64, 32)

    def per_row(x):  # elementwise: a row's bits depend on nothing else
        return x[:, :1] * weight[:, 0]

    def drifting(x):  # rounds differently above 8 rows, as a GEMM changing its blocking would
        return per_row(x) + (1e-3 if x.shape[0] > 8 else 0.0)

    assert row_invariant(per_row, 32, torch.float32)
    assert not row_invariant(drifting, 32, torch.float32)


@needs_packing(torch.bfloat16)
def test_bfloat16_llama_forward_packs_every_projection(tiny_model):
    import copy

    model = copy.deepcopy(tiny_model).to(torch.bfloat16)
    forward = LlamaForward(model)
    projections = [p for layer in forward.layers for p in (layer.qkv, layer.o, layer.gate_up, layer.down)]
    assert all(p.is_packed for p in [*projections, forward.lm_head])
    # The fused matrices are still what the transformers modules compute with.
    attn = model.model.layers[0].self_attn
    assert attn.q_proj.weight.untyped_storage().data_ptr() == forward.layers[0].qkv.weight.untyped_storage().data_ptr()


@pytest.mark.parametrize("dtype", [pytest.param(d, marks=needs_packing(d)) for d in DTYPES], ids=str)
@pytest.mark.parametrize("shape", SHAPES[:4], ids=lambda s: f"{s[0]}x{s[1]}")
def test_any_rows_is_true_only_where_a_lone_row_gets_its_batched_bits(shape, dtype):
    """``any_rows`` (which lets the runner skip padding a lone decode row to 4) is a
    claim about every count 1-32, checked here beyond the construction probe."""
    generator = torch.Generator().manual_seed(sum(shape) + 1)
    linear = PackedLinear((torch.randn(shape, generator=generator) * 0.05).to(dtype))
    x = torch.randn((ROW_TILE + 8, shape[1]), generator=generator).to(dtype)
    with torch.inference_mode():
        full = linear(x[:ROW_TILE])
        same = all(torch.equal(linear(x[k : k + rows]), full[k : k + rows])
                   for rows in range(1, ROW_TILE + 1) for k in (0, ROW_TILE - rows))
    if linear.any_rows:
        assert same
    assert linear.any_rows or not row_invariant(linear._product, shape[1], dtype, (1, 2, 3, 5, 7))


def test_the_lone_row_probe_rejects_a_product_that_rounds_few_rows_differently():
    weight = torch.randn(64, 32)

    def lone_differs(x):  # like oneDNN's float32 kernel on a lone row
        return x[:, :1] * weight[:, 0] + (1e-3 if x.shape[0] < 4 else 0.0)

    assert row_invariant(lone_differs, 32, torch.float32)  # multiples of 4 agree
    assert not row_invariant(lone_differs, 32, torch.float32, (1, 2, 3))


def test_the_forward_pads_rows_only_where_some_product_needs_it(tiny_model):
    import copy

    from engine.model.attention import ROW_MULTIPLE

    for dtype in (torch.bfloat16, torch.float32):
        forward = LlamaForward(copy.deepcopy(tiny_model).to(dtype))
        products = [forward.lm_head, *(p for x in forward.layers for p in (x.qkv, x.o, x.gate_up, x.down))]
        assert forward.row_multiple == (1 if all(p.any_rows for p in products) else ROW_MULTIPLE)
