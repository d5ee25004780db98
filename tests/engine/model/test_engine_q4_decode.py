"""Q4DecodeLinear: few-row products from the GGUF's 4-bit blocks with the dense bits.

Random Q4_1 matrices of the bundled model's shapes: every row count 1-8 (the kernel)
gets the bits of oneDNN's packed product over a 32-row tile (the prefill's call); a
matrix whose blocks are not its dense weights, a missing compiler and a CPU without
AVX-512 bf16 keep the dense product. The real model: an engine with the kernel and
one without give the same tokens and log-probabilities, alone and batched.
"""

from __future__ import annotations

import asyncio
import itertools
import logging

import pytest
import torch

from engine.config import EngineConfig
from engine.core.llm_engine import GenerationRequest, LLMEngine, SamplingParams
from engine.model import q4_decode
from engine.model.linear import ROW_TILE, PackedLinear
from engine.model.q4_decode import MAX_ROWS, Q4DecodeLinear, native_library, pack
from engine.model.q4_weights import Q4Matrix

needs_kernel = pytest.mark.skipif(native_library() is None,
                                  reason="the 4-bit decode kernel needs AVX-512 with bf16 and a C compiler")
SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]


def random_q4(out: int, cols: int, seed: int) -> Q4Matrix:
    """Scales like the bundled model's (d ~ 0.002-0.02, m ~ -8d): float16 values."""
    generator = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 16, (out, cols), generator=generator, dtype=torch.uint8)
    d = (0.002 + torch.rand((out, cols // 32), generator=generator) * 0.02).half().float()
    m = (-8 * d * (0.8 + 0.4 * torch.rand((out, cols // 32), generator=generator))).half().float()
    return Q4Matrix(codes, d, m)


def dense_of(matrix: Q4Matrix) -> PackedLinear:
    return PackedLinear(matrix.dequantize().to(torch.bfloat16))


@needs_kernel
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_every_row_count_gets_the_dense_tiles_bits(shape):
    matrix = random_q4(*shape, seed=sum(shape))
    dense = dense_of(matrix)
    product = Q4DecodeLinear.wrap(dense, matrix)
    assert isinstance(product, Q4DecodeLinear)
    assert product.any_rows
    assert product.chunk in (*q4_decode.CHUNKS, shape[1])
    x = (3 * torch.randn((4 * ROW_TILE, shape[1]), generator=torch.Generator().manual_seed(1))).to(torch.bfloat16)
    with torch.inference_mode():
        tiles = torch.cat([dense(x[k : k + ROW_TILE]) for k in range(0, len(x), ROW_TILE)])
        for rows in range(1, MAX_ROWS + 1):
            for start in (0, 37, len(x) - rows):
                assert torch.equal(product(x[start : start + rows]), tiles[start : start + rows]), (rows, start)
        # more rows than the kernel takes: the packed product, the same bits
        assert torch.equal(product(x[:20]), tiles[:20])
        assert torch.equal(product(x), tiles)


@needs_kernel
def test_the_kernel_dequantizes_like_the_checkpoint():
    matrix = random_q4(576, 1536, seed=3)
    packed = pack(matrix)
    out = torch.empty((576, 1536), dtype=torch.bfloat16)
    native_library().q4_decode_weights(packed.data_ptr(), 576, 1536, out.data_ptr())
    assert torch.equal(out, matrix.dequantize().to(torch.bfloat16))


@needs_kernel
def test_blocks_that_are_not_the_dense_weights_keep_the_dense_product(caplog):
    matrix = random_q4(576, 576, seed=4)
    weight = matrix.dequantize().to(torch.bfloat16)
    weight[100, 200] = weight[100, 200] + 1  # one weight off: the blocks are another matrix
    dense = PackedLinear(weight)
    with caplog.at_level(logging.WARNING, logger="engine.model.q4_decode"):
        assert Q4DecodeLinear.wrap(dense, matrix) is dense
    assert "not the dense weights" in caplog.text


@needs_kernel
def test_no_chunk_matching_keeps_the_dense_product(monkeypatch, caplog):
    """Fault injection: a kernel whose sums would differ from oneDNN's (only a chunk of
    32 tried, never the one oneDNN uses) is refused, not used."""
    monkeypatch.setattr(q4_decode, "CHUNKS", (32,))
    matrix = random_q4(576, 1536, seed=5)
    dense = dense_of(matrix)
    wrapped = Q4DecodeLinear.wrap(dense, matrix)
    if isinstance(wrapped, Q4DecodeLinear):  # the whole input as one chunk was oneDNN's: still exact
        assert wrapped.chunk == 1536
    else:
        assert wrapped is dense
        assert "no chunk gives oneDNN's bits" in caplog.text


def test_pack_refuses_shapes_the_kernel_cannot_tile():
    with pytest.raises(ValueError, match="out % 16 == 0"):
        pack(random_q4(24, 64, seed=0))


def test_without_a_compiler_the_products_stay_dense(monkeypatch, tmp_path, caplog):
    monkeypatch.setenv("PREFIXGATE_HOME", str(tmp_path))
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    monkeypatch.setattr(q4_decode, "_cpu_supported", lambda: True)
    build = q4_decode.native_library.__wrapped__
    with caplog.at_level(logging.WARNING, logger="engine.model.q4_decode"):
        assert build() is None
    assert "building q4_decode.c failed" in caplog.text
    assert not list((tmp_path / "native").glob("*"))  # no half-written library left behind


def test_a_cpu_without_avx512_bf16_is_not_built_for(monkeypatch, tmp_path):
    monkeypatch.setenv("PREFIXGATE_HOME", str(tmp_path))
    monkeypatch.setattr(q4_decode, "_cpu_supported", lambda: False)
    assert q4_decode.native_library.__wrapped__() is None
    assert not (tmp_path / "native").exists()


def test_config_and_cli():
    from gateway.cli import build_parser

    with pytest.raises(ValueError, match="q4_decode must be a bool"):
        EngineConfig(q4_decode="yes")
    parser = build_parser()
    assert parser.parse_args(["engine"]).no_q4_decode is False
    assert parser.parse_args(["engine", "--no-q4-decode"]).no_q4_decode is True


# --- the bundled model ---

_ids = itertools.count()


def run(engine, prompts, **params):
    async def go():
        streams = [engine.submit(GenerationRequest(f"q4d-{next(_ids)}", p, SamplingParams(**params)))
                   for p in prompts]
        return await asyncio.gather(*(s.collect() for s in streams))

    return [([t for o in outs for t in o.new_token_ids],
             [(x.token_id, x.logprob, x.top) for o in outs for x in o.logprobs or []])
            for outs in asyncio.run(go())]


@needs_kernel
@pytest.mark.real_model
def test_real_model_outputs_equal_the_dense_products(real_engine):
    """The session's real engine decodes with the kernel (the default); a twin on the
    same weights without it gives the same tokens and log-probabilities, each prompt
    alone and all batched, with and without drafts."""
    llama = real_engine.runner._llama
    assert all(isinstance(p, Q4DecodeLinear) for layer in llama.layers
               for p in (layer.qkv, layer.o, layer.gate_up, layer.down))
    assert llama.row_multiple == 1
    tok = real_engine.tokenizer
    chats = ["Which tyres do you recommend for winter?", "Explain what a prime number is.",
             "Write two sentences about the sea.", "What is 12 times 7? Show your steps."]
    prompts = [list(tok.apply_chat_template([{"role": "user", "content": c}], add_generation_prompt=True,
                                            tokenize=True, return_dict=False)) for c in chats]
    plain = LLMEngine(real_engine.model, real_engine.tokenizer,
                      EngineConfig(kv_cache_memory_gib=0.1, served_model_name="dense", q4_decode=False, seed=0))
    assert not any(isinstance(p, Q4DecodeLinear) for p in (plain.runner._llama.layers[0].qkv,))
    plain.start()
    try:
        params = dict(max_tokens=24, temperature=0.0, logprobs=3)
        expected = run(plain, prompts, **params)
        assert [run(plain, [p], **params)[0] for p in prompts] == expected
        assert run(real_engine, prompts, **params) == expected
        assert [run(real_engine, [p], **params)[0] for p in prompts] == expected
    finally:
        plain.shutdown()
