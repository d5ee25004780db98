"""GGUFDecodeLinear: few-row products from the GGUF's blocks with the dense bits.

Random Q4_1 and Q8_0 matrices of the bundled model's shapes: every row count 1-8 (the
kernel) gets the bits of oneDNN's packed product over 32-row tiles (the prefill's
calls), and so do larger calls; blocks that are not the dense weights and sums that
are not oneDNN's keep the dense product (the library's build and its failures:
test_engine_native.py). The bundled model: an engine with the kernel and one without
give the same tokens and log-probabilities, alone and batched.
"""

from __future__ import annotations

import logging

import pytest
import torch
from support.engine_runs import tokens_and_logprobs

from engine.config import EngineConfig
from engine.core.llm_engine import LLMEngine
from engine.model import attention, gguf_decode, native
from engine.model.gguf_decode import MAX_ROWS, GGUFDecodeLinear, pack
from engine.model.linear import ROW_TILE, PackedLinear
from engine.model.native import native_library
from engine.model.q4_weights import Q4Matrix, Q8Matrix

needs_library = pytest.mark.skipif(native_library() is None,
                                   reason="the engine's C library needs AVX-512 with bf16 and a C compiler")


def kernel_matches() -> bool:
    """Whether the kernel gives oneDNN's bits on this CPU (else it stays off, logged)."""
    if native_library() is None:
        return False
    matrix = random_q4(576, 1536, seed=99)
    return isinstance(GGUFDecodeLinear.wrap(dense_of(matrix), pack(matrix)), GGUFDecodeLinear)


SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]


def random_q4(out: int, cols: int, seed: int) -> Q4Matrix:
    """Scales like the bundled model's (d ~ 0.002-0.02, m ~ -8d): float16 values."""
    generator = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 16, (out, cols), generator=generator, dtype=torch.uint8)
    d = (0.002 + torch.rand((out, cols // 32), generator=generator) * 0.02).half().float()
    m = (-8 * d * (0.8 + 0.4 * torch.rand((out, cols // 32), generator=generator))).half().float()
    return Q4Matrix(codes, d, m)


def random_q8(out: int, cols: int, seed: int) -> Q8Matrix:
    """Like the bundled model's token embedding: int8 codes, d ~ 0.0005-0.005."""
    generator = torch.Generator().manual_seed(seed)
    codes = torch.randint(-127, 128, (out, cols), generator=generator, dtype=torch.int8)
    d = (0.0005 + torch.rand((out, cols // 32), generator=generator) * 0.0045).half().float()
    return Q8Matrix(codes, d)


def dense_of(matrix: Q4Matrix | Q8Matrix) -> PackedLinear:
    return PackedLinear(matrix.dequantize().to(torch.bfloat16))


CASES = [("q4_1", *shape) for shape in SHAPES] + [("q8_0", 4096, 576)]


@needs_library
@pytest.mark.parametrize(("kind", "out", "cols"), CASES, ids=lambda v: str(v))
def test_every_row_count_gets_the_dense_tiles_bits(kind, out, cols):
    if not kernel_matches():
        pytest.skip("oneDNN sums in another order on this CPU: the kernel stays off here (logged)")
    shape = (out, cols)
    matrix = (random_q4 if kind == "q4_1" else random_q8)(*shape, seed=sum(shape))
    dense = dense_of(matrix)
    product = GGUFDecodeLinear.wrap(dense, pack(matrix))
    assert isinstance(product, GGUFDecodeLinear)
    assert product.any_rows
    assert product.chunk in (*gguf_decode.CHUNKS, shape[1])
    x = (3 * torch.randn((4 * ROW_TILE, shape[1]), generator=torch.Generator().manual_seed(1))).to(torch.bfloat16)
    with torch.inference_mode():
        tiles = torch.cat([dense(x[k : k + ROW_TILE]) for k in range(0, len(x), ROW_TILE)])
        for rows in range(1, MAX_ROWS + 1):
            for start in (0, 37, len(x) - rows):
                assert torch.equal(product(x[start : start + rows]), tiles[start : start + rows]), (rows, start)
        # more rows than the kernel takes: the packed product in tiles, odd counts padded
        # where the packed product is not row-invariant at any count
        for any_rows in (True, False):
            dense.any_rows = any_rows
            for rows in (9, 13, 20, 27, 45, len(x)):
                assert torch.equal(product(x[:rows]), tiles[:rows]), (any_rows, rows)


@needs_library
@pytest.mark.parametrize("kind", ["q4_1", "q8_0"])
def test_the_kernel_dequantizes_like_the_checkpoint(kind):
    matrix = random_q4(576, 1536, seed=3) if kind == "q4_1" else random_q8(576, 1536, seed=3)
    packed = pack(matrix)
    assert packed.format == gguf_decode.FORMATS[type(matrix)] and packed.shape == (576, 1536)
    dense = matrix.dequantize().to(torch.bfloat16)
    count = native_library().gguf_decode_mismatches
    assert count(packed.format, packed.data.data_ptr(), 576, 1536, dense.data_ptr()) == 0
    dense.view(torch.int16)[[3, 300, 575], [0, 777, 1535]] += 1  # three weights one ulp off
    assert count(packed.format, packed.data.data_ptr(), 576, 1536, dense.data_ptr()) == 3


@needs_library
@pytest.mark.parametrize("kind", ["q4_1", "q8_0"])
def test_blocks_that_are_not_the_dense_weights_keep_the_dense_product(kind, caplog):
    matrix = random_q4(576, 576, seed=4) if kind == "q4_1" else random_q8(576, 576, seed=4)
    weight = matrix.dequantize().to(torch.bfloat16)
    weight[100, 200] = weight[100, 200] + 1  # one weight off: the blocks are another matrix
    dense = PackedLinear(weight)
    with caplog.at_level(logging.WARNING, logger="engine.model.gguf_decode"):
        assert GGUFDecodeLinear.wrap(dense, pack(matrix)) is dense
    assert "not the dense weights" in caplog.text


@needs_library
def test_no_chunk_matching_keeps_the_dense_product(monkeypatch, caplog):
    """Fault injection: a kernel whose sums would differ from oneDNN's (only a chunk of
    32 tried, never the one oneDNN uses) is refused, not used."""
    monkeypatch.setattr(gguf_decode, "CHUNKS", (32,))
    matrix = random_q4(576, 1536, seed=5)
    dense = dense_of(matrix)
    wrapped = GGUFDecodeLinear.wrap(dense, pack(matrix))
    if isinstance(wrapped, GGUFDecodeLinear):  # the whole input as one chunk was oneDNN's: still exact
        assert wrapped.chunk == 1536
    else:
        assert wrapped is dense
        assert "no chunk gives oneDNN's bits" in caplog.text


def test_pack_refuses_shapes_the_kernel_cannot_tile():
    with pytest.raises(ValueError, match="out % 16 == 0"):
        pack(random_q4(24, 64, seed=0))


def test_config_and_cli():
    from gateway.cli import build_parser

    with pytest.raises(ValueError, match="gguf_decode must be a bool"):
        EngineConfig(gguf_decode="yes")
    parser = build_parser()
    assert parser.parse_args(["engine"]).no_gguf_decode is False
    assert parser.parse_args(["engine", "--no-gguf-decode"]).no_gguf_decode is True


# --- the bundled model ---



@needs_library
@pytest.mark.real_model
def test_real_model_outputs_equal_the_dense_products(real_engine, monkeypatch):
    """The session's real engine decodes with the kernels (the default: these products,
    the native RMSNorm and decode attention); a twin on the same weights with torch's
    ops only gives the same tokens and log-probabilities, each prompt alone and all
    batched."""
    llama = real_engine.runner._llama
    if kernel_matches():  # else the products stay dense here (and the outputs below still must agree)
        assert all(isinstance(p, GGUFDecodeLinear) for layer in llama.layers
                   for p in (layer.qkv, layer.o, layer.gate_up, layer.down))
        assert isinstance(llama.lm_head, GGUFDecodeLinear) and llama.lm_head.format == gguf_decode.FORMATS[Q8Matrix]
        assert llama.row_multiple == 1
    tok = real_engine.tokenizer
    chats = ["Which tyres do you recommend for winter?", "Explain what a prime number is.",
             "Write two sentences about the sea.", "What is 12 times 7? Show your steps."]
    prompts = [list(tok.apply_chat_template([{"role": "user", "content": c}], add_generation_prompt=True,
                                            tokenize=True, return_dict=False)) for c in chats]
    plain = LLMEngine(real_engine.model, real_engine.tokenizer,
                      EngineConfig(kv_cache_memory_gib=0.1, served_model_name="dense", gguf_decode=False, seed=0))
    assert not isinstance(plain.runner._llama.layers[0].qkv, GGUFDecodeLinear)
    plain.start()
    try:
        params = dict(max_tokens=24, temperature=0.0, logprobs=3)
        with monkeypatch.context() as torch_only:  # the twin's norms and attention too (the real engine waits)
            torch_only.setattr(native, "rms_norm", native.torch_rms_norm)
            torch_only.setattr(attention, "native_decodes_agree", lambda *layout: False)
            expected = tokens_and_logprobs(plain, prompts, **params)
            assert [tokens_and_logprobs(plain, [p], **params)[0] for p in prompts] == expected
        assert tokens_and_logprobs(real_engine, prompts, **params) == expected
        assert [tokens_and_logprobs(real_engine, [p], **params)[0] for p in prompts] == expected
    finally:
        plain.shutdown()
