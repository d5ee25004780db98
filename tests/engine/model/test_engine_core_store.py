"""Model store (conversion once, atomic), dtype resolution, and the block-laid-out KV storage."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine import model_store
from engine.config import EngineConfig
from engine.model.kv_storage import KVLayout, KVStorage
from engine.model.loader import resolve_dtype, resolve_model_path


def fake_convert(calls):
    def convert(gguf: Path, out_dir: Path) -> None:
        calls.append(out_dir)
        for name in model_store.REQUIRED_FILES:
            (out_dir / name).write_text(name)

    return convert


def test_home_and_converted_dir_follow_the_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("PREFIXGATE_HOME", str(tmp_path))
    assert model_store.prefixgate_home() == tmp_path
    assert model_store.converted_model_dir() == tmp_path / "models" / "SmolLM2-135M-Instruct"
    monkeypatch.delenv("PREFIXGATE_HOME")
    assert model_store.prefixgate_home() == Path.home() / ".cache" / "prefixgate"


def test_bundled_gguf_is_found():
    path = model_store.bundled_gguf_path()
    assert path.name == model_store.BUNDLED_GGUF_FILE and path.stat().st_size > 50_000_000


def test_conversion_happens_once_and_atomically(tmp_path, monkeypatch):
    monkeypatch.setenv("PREFIXGATE_HOME", str(tmp_path))
    calls = []
    monkeypatch.setattr(model_store, "_convert", fake_convert(calls))
    gguf = tmp_path / "Tiny.gguf"
    gguf.write_bytes(b"GGUF")
    first = model_store.ensure_converted_model(gguf)
    second = model_store.ensure_converted_model(gguf)
    assert first == second == tmp_path / "models" / "Tiny"
    assert len(calls) == 1 and calls[0] != first  # written elsewhere, then renamed
    assert model_store.is_complete(first)
    assert [p.name for p in first.parent.iterdir()] == ["Tiny"]  # no temporary dir left


def test_an_incomplete_directory_is_replaced(tmp_path, monkeypatch):
    monkeypatch.setenv("PREFIXGATE_HOME", str(tmp_path))
    calls = []
    monkeypatch.setattr(model_store, "_convert", fake_convert(calls))
    target = tmp_path / "models" / "Tiny"
    target.mkdir(parents=True)
    (target / "config.json").write_text("{}")
    gguf = tmp_path / "Tiny.gguf"
    gguf.write_bytes(b"GGUF")
    assert model_store.ensure_converted_model(gguf) == target
    assert model_store.is_complete(target) and len(calls) == 1


def test_a_failed_conversion_leaves_nothing_behind(tmp_path, monkeypatch):
    monkeypatch.setenv("PREFIXGATE_HOME", str(tmp_path))

    def broken(gguf, out_dir):
        (out_dir / "config.json").write_text("{}")
        raise RuntimeError("disk full")

    monkeypatch.setattr(model_store, "_convert", broken)
    gguf = tmp_path / "Tiny.gguf"
    gguf.write_bytes(b"GGUF")
    with pytest.raises(RuntimeError, match="disk full"):
        model_store.ensure_converted_model(gguf)
    assert list((tmp_path / "models").iterdir()) == []


def test_dtype_resolution(monkeypatch):
    assert resolve_dtype("float32") == torch.float32
    assert resolve_dtype("bfloat16") == torch.bfloat16
    monkeypatch.setattr("engine.model.loader.cpu_has_native_bf16", lambda: True)
    assert resolve_dtype("auto") == torch.bfloat16
    monkeypatch.setattr("engine.model.loader.cpu_has_native_bf16", lambda: False)
    assert resolve_dtype("auto") == torch.float32
    with pytest.raises(ValueError, match="dtype"):
        EngineConfig(dtype="float16")


def test_model_paths_are_local_only(tmp_path):
    with pytest.raises(ValueError, match="local checkpoint"):
        resolve_model_path("HuggingFaceTB/SmolLM2-135M-Instruct")
    with pytest.raises(ValueError, match=r"config\.json"):
        resolve_model_path(str(tmp_path))
    (tmp_path / "config.json").write_text("{}")
    assert resolve_model_path(str(tmp_path)) == (tmp_path, tmp_path.name)


def test_kv_storage_is_sized_from_memory_and_laid_out_by_block():
    layout = KVLayout(num_layers=2, kv_heads=3, head_dim=4, block_size=16, dtype=torch.float32)
    assert layout.bytes_per_token == 2 * 2 * 3 * 4 * 4
    storage = KVStorage.from_memory(layout, 0.001)
    assert storage.num_blocks == int(0.001 * 1024**3) // (layout.bytes_per_token * 16)
    assert storage.keys[0].shape == (3, storage.num_blocks + 1, 16, 4)  # + the pad block
    assert storage.values[0].shape == (3, storage.num_blocks + 1, 16, 4)
    with pytest.raises(ValueError, match="kv_cache_memory_gib"):
        KVStorage.from_memory(layout, 1e-9)


def test_kv_storage_writes_slots_and_gathers_block_tables():
    layout = KVLayout(num_layers=1, kv_heads=2, head_dim=3, block_size=4, dtype=torch.float32)
    storage = KVStorage(layout, num_blocks=8)
    table = [5, 2, 7]  # positions 0-3 in block 5, 4-7 in block 2, 8-11 in block 7
    keys = torch.arange(10 * 2 * 3, dtype=torch.float32).view(10, 2, 3)  # [tokens, heads, dim]
    slots = storage.slot_ids(table, 0, 10)
    assert slots[:6] == [20, 21, 22, 23, 8, 9]
    storage.write(0, torch.tensor(slots), keys, -keys)
    assert torch.equal(storage.keys[0][:, 2, 1], keys[5])
    gathered, values = storage.gather(0, storage.rows([*table[:2], storage.pad_block]))
    assert gathered.shape == values.shape == (2, 12, 3)
    assert gathered.is_contiguous() and values.is_contiguous()
    assert torch.equal(gathered[:, :8], keys[:8].transpose(0, 1))
    assert torch.equal(gathered[:, 8:], torch.zeros(2, 4, 3))
    assert torch.equal(values[:, :8], -keys[:8].transpose(0, 1))
    assert torch.equal(values[:, 8:], torch.zeros(2, 4, 3))  # the pad block
    with pytest.raises(ValueError, match="exceed"):
        storage.slot_ids(table, 0, 13)


@pytest.mark.parametrize("field", ["max_num_seqs", "max_num_batched_tokens"])
@pytest.mark.parametrize("bad", [0, -3, True, 2.5])
def test_batching_limits_are_validated(field, bad):
    with pytest.raises(ValueError, match=field):
        EngineConfig(**{field: bad})
