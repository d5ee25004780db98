"""The engine's C library (engine/model/native.py): built once, or cleanly absent; its
RMSNorm gives torch's bits (widths with and without a vector tail, rows 1-8, three
scales), so do its decode attention products (block tables in a pool, 1-8 sequences,
lengths up to NATIVE_KEYS), and a kernel whose bits would differ is refused (fault
injection)."""

from __future__ import annotations

import logging

import pytest
import torch

from engine.model import attention, native

needs_library = pytest.mark.skipif(native.native_library() is None,
                                   reason="the native kernels need AVX-512 with bf16 and a C compiler")


@needs_library
@pytest.mark.parametrize("width", [576, 64, 100, 960, 4099])
def test_rms_norm_gives_torchs_bits(width):
    generator = torch.Generator().manual_seed(width)
    weight = torch.randn(width, generator=generator).to(torch.bfloat16)
    if not native.norm_agrees(width, 1e-5):
        pytest.skip("ATen sums in another order on this CPU: the kernel stays off here (logged)")
    with torch.inference_mode():
        for scale in (0.003, 1.0, 50.0):
            x = (scale * torch.randn((8, width), generator=generator)).to(torch.bfloat16)
            for rows in range(1, native.NORM_ROWS + 1):
                assert torch.equal(native.rms_norm(x[:rows], weight, 1e-5),
                                   native.torch_rms_norm(x[:rows], weight, 1e-5)), (scale, rows)
            wide = x.repeat(3, 1)  # more rows than the kernel takes: torch's ops
            assert torch.equal(native.rms_norm(wide, weight, 1e-5), native.torch_rms_norm(wide, weight, 1e-5))


@needs_library
def test_a_kernel_with_other_bits_is_refused(monkeypatch, caplog):
    """Fault injection: torch's norm made to differ (eps doubled) stands for a CPU whose
    sums run in another order; the kernel is then not used for that width."""
    real = native.torch_rms_norm
    monkeypatch.setattr(native, "torch_rms_norm", lambda x, w, eps: real(x, w, 2 * eps + 1e-3))
    with caplog.at_level(logging.WARNING, logger="engine.model.native"):
        assert native.norm_agrees.__wrapped__(576, 1e-5) is False
    assert "bits differ" in caplog.text


def test_without_the_library_torch_computes_the_norm(monkeypatch):
    monkeypatch.setattr(native, "native_library", lambda: None)
    x = torch.randn((2, 576)).to(torch.bfloat16)
    weight = torch.randn(576).to(torch.bfloat16)
    assert torch.equal(native.rms_norm(x, weight, 1e-5), native.torch_rms_norm(x, weight, 1e-5))


def test_without_a_compiler_nothing_is_built(monkeypatch, tmp_path, caplog):
    monkeypatch.setenv("PREFIXGATE_HOME", str(tmp_path))
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    monkeypatch.setattr(native, "_cpu_supported", lambda: True)
    with caplog.at_level(logging.WARNING, logger="engine.model.native"):
        assert native.native_library.__wrapped__() is None
    assert "building or loading" in caplog.text
    assert not list((tmp_path / "native").glob("*"))  # no half-written library left behind


def test_an_unwritable_cache_leaves_the_kernels_off(monkeypatch, tmp_path, caplog):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    monkeypatch.setenv("PREFIXGATE_HOME", str(blocker))
    monkeypatch.setattr(native, "_cpu_supported", lambda: True)
    with caplog.at_level(logging.WARNING, logger="engine.model.native"):
        assert native.native_library.__wrapped__() is None
    assert "building or loading" in caplog.text


def test_the_environment_can_turn_the_library_off(monkeypatch, tmp_path):
    monkeypatch.setenv("PREFIXGATE_HOME", str(tmp_path))
    monkeypatch.setenv("PREFIXGATE_NATIVE", "0")
    assert native.native_library.__wrapped__() is None
    assert not (tmp_path / "native").exists()


def test_a_cpu_without_avx512_bf16_is_not_built_for(monkeypatch, tmp_path):
    monkeypatch.setenv("PREFIXGATE_HOME", str(tmp_path))
    monkeypatch.setattr(native, "_cpu_supported", lambda: False)
    assert native.native_library.__wrapped__() is None
    assert not (tmp_path / "native").exists()


@needs_library
def test_a_fresh_build_is_published_whole_and_shares_torchs_openmp(monkeypatch, tmp_path):
    monkeypatch.setenv("PREFIXGATE_HOME", str(tmp_path))
    lib = native.native_library.__wrapped__()
    assert lib is not None
    built = list((tmp_path / "native").iterdir())
    assert len(built) == 1 and built[0].name.startswith("engine-") and built[0].suffix == ".so"
    with open("/proc/self/maps") as maps:
        mapped = {line.split()[-1] for line in maps if "libgomp" in line}
    assert len(mapped) == 1, mapped  # one OpenMP runtime in the process: torch's


@needs_library
@pytest.mark.parametrize("sequences", [1, 3, 8])
def test_decode_attention_products_give_torchs_bits(sequences):
    """Random pools and block tables; the C products against attention's own torch
    products (gathered K/V, ``_scores``, softmax, ``_weighted_values``)."""
    kv, hd, bs, rows = 3, 64, 16, 4
    if not attention.native_decodes_agree(kv, hd, bs, rows):
        pytest.skip("torch's products sum in another order on this CPU: the kernel stays off here (logged)")
    gen = torch.Generator().manual_seed(sequences)
    for length in (64, 192, 512, 576, 960, attention.NATIVE_KEYS):
        bps = length // bs
        blocks = sequences * bps + 3
        keys, values = ((3 * torch.randn((kv, blocks + 1, bs, hd), generator=gen)).to(torch.bfloat16)
                        for _ in range(2))
        table = torch.randperm(blocks, generator=gen)[: sequences * bps]
        kv_rows = (torch.arange(kv)[:, None] * (blocks + 1) + table[None, :]).reshape(-1)
        q = (3 * torch.randn((kv, sequences, rows, hd), generator=gen)).to(torch.bfloat16)
        k, v = (torch.index_select(t.view(-1, bs, hd), 0, kv_rows).view(kv, sequences, length, hd)
                for t in (keys, values))
        scores = native.decode_scores(q, keys, kv_rows, bps)
        assert torch.equal(scores, attention._scores(q, k)), length
        probs = torch.softmax(scores, dim=-1)
        assert torch.equal(native.decode_values(probs, values, kv_rows, bps, attention.NATIVE_CHUNK),
                           attention._weighted_values(probs, v)), length


@needs_library
def test_decode_attention_with_other_bits_is_refused(monkeypatch, caplog):
    """Fault injection: a values product one ulp off in one output is caught by the probe."""
    real = native.decode_values

    def off_by_one(*args, **kwargs):
        out = real(*args, **kwargs)
        out.view(torch.int16).view(-1)[7] += 1
        return out

    monkeypatch.setattr(native, "decode_values", off_by_one)
    with caplog.at_level(logging.WARNING, logger="engine.model.attention"):
        assert attention.native_decodes_agree.__wrapped__(3, 64, 16, 4) is False
    assert "differ from torch's" in caplog.text
    assert attention.native_decodes_agree.__wrapped__(3, 48, 16, 4) is False  # head_dim 64 only
