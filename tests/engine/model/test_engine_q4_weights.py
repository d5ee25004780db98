"""Q4_1 weights: read from the bundled GGUF as shipped (dequantized, they are the
converted checkpoint bit for bit), and multiplied by Int4Linear row-invariantly."""

from __future__ import annotations

import pytest
import torch

from engine.config import EngineConfig
from engine.model.linear import ROW_TILE, Int4Linear
from engine.model.q4_weights import Q4Matrix, gguf_file, read_q4_layers

ROWS = [4, 8, 12, 28, 32, 36, 64, 100, 256]


def random_q4(out: int, cols: int, seed: int) -> Q4Matrix:
    generator = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 16, (out, cols), generator=generator, dtype=torch.uint8)
    d = (torch.rand((out, cols // 32), generator=generator) * 0.01).half().float()
    m = (-8 * d).half().float()
    return Q4Matrix(codes, d, m)


@pytest.mark.parametrize("shape", [(960, 576), (576, 1536)], ids=lambda s: f"{s[0]}x{s[1]}")
def test_int4_rows_get_the_same_bits_at_every_row_count(shape):
    matrix = random_q4(*shape, seed=sum(shape))
    linear = Int4Linear(matrix)
    x = torch.randn((max(ROWS) + 8, shape[1]), generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    with torch.inference_mode():
        full = linear(x)
        for rows in ROWS:
            assert torch.equal(linear(x[:rows]), full[:rows]), rows
            assert torch.equal(linear(x[8 : 8 + rows]), full[8 : 8 + rows]), rows
        # the same weights as dequantized, up to the bfloat16 scales and the kernel's rounding
        dense = x.float() @ matrix.dequantize().T
    assert torch.allclose(full.float(), dense, rtol=0.02, atol=0.02 * dense.abs().max().item())
    assert ROW_TILE == 32


def test_a_checkpoint_directory_has_no_4bit_weights(tmp_path):
    with pytest.raises(ValueError, match="needs a GGUF model"):
        gguf_file(str(tmp_path))
    with pytest.raises(ValueError, match="weights must be one of"):
        EngineConfig(weights="q8")


@pytest.mark.real_model
def test_q4_blocks_dequantize_to_the_converted_checkpoint():
    from safetensors.torch import load_file

    from engine.model_store import ensure_converted_model

    layers = read_q4_layers(gguf_file(None))
    state = {}
    for path in ensure_converted_model().glob("*.safetensors"):
        state.update(load_file(str(path)))
    names = {"q": "self_attn.q_proj", "k": "self_attn.k_proj", "v": "self_attn.v_proj", "o": "self_attn.o_proj",
             "gate": "mlp.gate_proj", "up": "mlp.up_proj", "down": "mlp.down_proj"}
    assert len(layers) == 30
    for i, layer in enumerate(layers):
        for key, name in names.items():
            assert torch.equal(layer[key].dequantize(), state[f"model.layers.{i}.{name}.weight"]), (i, key)


@pytest.mark.real_model
def test_fused_projections_give_each_column_the_separate_products_bits():
    """The Llama forward multiplies by ``[q; k; v]`` and ``[gate; up]`` in one call each:
    on the bundled model's weights, dense bfloat16 (packed) and 4-bit, every column of the
    fused product has the bits of its own matrix's product, at decode row counts and in
    a prefill's tiles."""
    from safetensors.torch import load_file

    from engine.model.linear import PackedLinear
    from engine.model_store import ensure_converted_model

    layers = read_q4_layers(gguf_file(None))
    state = {}
    for path in ensure_converted_model().glob("*.safetensors"):
        state.update(load_file(str(path)))
    groups = {("q", "k", "v"): "self_attn.{}_proj", ("gate", "up"): "mlp.{}_proj"}
    x = torch.randn((3 * ROW_TILE, 576), generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    with torch.inference_mode():
        for i in (0, 29):
            for keys, name in groups.items():
                dense = [state[f"model.layers.{i}.{name.format(k)}.weight"].to(torch.bfloat16) for k in keys]
                pairs = [(PackedLinear(torch.cat(dense)), [PackedLinear(w) for w in dense]),
                         (Int4Linear(Q4Matrix.cat([layers[i][k] for k in keys])), [Int4Linear(layers[i][k]) for k in keys])]
                for fused, separate in pairs:
                    for rows in (1, 4, 8, 16, ROW_TILE, 3 * ROW_TILE):
                        assert torch.equal(fused(x[:rows]), torch.cat([p(x[:rows]) for p in separate], dim=-1)), (
                            i, keys, type(fused).__name__, rows)
