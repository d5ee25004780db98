"""Q4Weights: a Llama GGUF's Q4_1 projections (and Q8_0 LM head), read as shipped.

The bundled GGUF stores every projection (q, k, v, o, gate, up, down; 210 matrices)
as Q4_1: blocks of 32 weights along the input dimension, each ``d * q + m`` with
``q`` in 0..15 and ``d``, ``m`` float16 (20 bytes: ``d``, ``m``, then 16 bytes of
nibbles, element ``j`` in the low nibble of byte ``j``, element ``j + 16`` in the high
one). This module reads those blocks straight from the file (no dequantized copy)
as codes ``[out, in]`` (uint8) and per-block ``d`` and ``m`` ``[out, in / 32]``
(float32), in transformers' row order: the GGUF converter permutes the rows of q
and k for its RoPE layout, and they are permuted back here exactly as transformers
does when it dequantizes the file. So ``d * q + m`` (float32) is the engine's
converted float32 checkpoint, bit for bit (tested).

:class:`~engine.model.linear.Int4Linear` multiplies with these blocks directly;
:class:`~engine.model.gguf_decode.GGUFDecodeLinear` reads them, and the LM head's Q8_0
blocks (``d * q``, ``q`` int8, ``d`` float16), with the dense product's bits.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

BLOCK = 32
_NAMES = {"q": "attn_q", "k": "attn_k", "v": "attn_v", "o": "attn_output",
          "gate": "ffn_gate", "up": "ffn_up", "down": "ffn_down"}


@dataclass(frozen=True)
class Q4Matrix:
    """One Q4_1 matrix: ``weight[r, c] = d[r, c // 32] * codes[r, c] + m[r, c // 32]``."""

    codes: torch.Tensor  # [out, in] uint8, 0..15
    d: torch.Tensor  # [out, in // 32] float32 (exact float16 values)
    m: torch.Tensor  # [out, in // 32] float32

    def dequantize(self) -> torch.Tensor:
        """The float32 weights (transformers' dequantization: ``d * q + m``)."""
        out, cols = self.codes.shape
        q = self.codes.view(out, cols // BLOCK, BLOCK).to(torch.float32)
        return (self.d[..., None] * q + self.m[..., None]).view(out, cols)

    @staticmethod
    def cat(parts: list[Q4Matrix]) -> Q4Matrix:
        """Rows of ``parts`` stacked (a fused projection)."""
        return Q4Matrix(*(torch.cat([getattr(p, f) for p in parts]) for f in ("codes", "d", "m")))


@dataclass(frozen=True)
class Q8Matrix:
    """One Q8_0 matrix: ``weight[r, c] = d[r, c // 32] * codes[r, c]``."""

    codes: torch.Tensor  # [out, in] int8
    d: torch.Tensor  # [out, in // 32] float32 (exact float16 values)

    def dequantize(self) -> torch.Tensor:
        """The float32 weights (transformers' dequantization: ``d * q``)."""
        out, cols = self.codes.shape
        return (self.d[..., None] * self.codes.view(out, cols // BLOCK, BLOCK).to(torch.float32)).view(out, cols)


def fuse_layer(q4: Mapping[str, Q4Matrix]) -> dict[str, Q4Matrix]:
    """A layer's seven projections fused as the Llama forward multiplies them: ``qkv``,
    ``o``, ``gate_up``, ``down``."""
    return {"qkv": Q4Matrix.cat([q4["q"], q4["k"], q4["v"]]), "o": q4["o"],
            "gate_up": Q4Matrix.cat([q4["gate"], q4["up"]]), "down": q4["down"]}


def gguf_file(model: str | None) -> Path:
    """The GGUF file of ``EngineConfig.model``: the bundled one for None, else a
    ``.gguf`` path; ValueError for a checkpoint directory (it has no Q4_1 blocks)."""
    if model is None:
        from engine.model_store import bundled_gguf_path

        return bundled_gguf_path()
    path = Path(model).expanduser()
    if path.suffix != ".gguf" or not path.is_file():
        raise ValueError(f"weights='q4_1' needs a GGUF model (the bundled one or a .gguf file), got {model!r}")
    return path


@functools.lru_cache(maxsize=2)
def read_q4_layers(path: Path) -> list[dict[str, Q4Matrix]]:
    """:func:`load_q4_layers`, kept per process (``--weights q4_1`` engines share them)."""
    return load_q4_layers(path)


def load_q4_layers(path: Path) -> list[dict[str, Q4Matrix]]:
    """Per layer, its seven projections (``q k v o gate up down``) as :class:`Q4Matrix`.
    Raises ValueError if the file is not a Llama GGUF whose projections are all Q4_1."""
    import gguf

    reader = gguf.GGUFReader(str(path))
    tensors = {t.name: t for t in reader.tensors}
    heads = int(reader.fields["llama.attention.head_count"].parts[-1][0])
    kv_heads = int(reader.fields["llama.attention.head_count_kv"].parts[-1][0])
    layers: list[dict[str, Q4Matrix]] = []
    while f"blk.{len(layers)}.attn_q.weight" in tensors:
        i = len(layers)
        layer = {}
        for key, name in _NAMES.items():
            tensor = tensors[f"blk.{i}.{name}.weight"]
            if tensor.tensor_type != gguf.GGMLQuantizationType.Q4_1:
                raise ValueError(f"blk.{i}.{name}.weight is {tensor.tensor_type.name}, not Q4_1")
            matrix = _blocks(np.asarray(tensor.data), int(tensor.shape[0]))
            if key in ("q", "k"):
                matrix = _unpermute(matrix, heads if key == "q" else kv_heads)
            layer[key] = matrix
        layers.append(layer)
    if not layers:
        raise ValueError(f"{path} has no Llama layers (blk.0.attn_q.weight)")
    return layers


def read_q8_output(path: Path) -> Q8Matrix | None:
    """The LM head's blocks (``output.weight``, else the tied ``token_embd.weight``) when
    they are Q8_0, else None."""
    import gguf

    reader = gguf.GGUFReader(str(path))
    tensors = {t.name: t for t in reader.tensors}
    tensor = tensors.get("output.weight") or tensors.get("token_embd.weight")
    if tensor is None or tensor.tensor_type != gguf.GGMLQuantizationType.Q8_0:
        return None
    cols = int(tensor.shape[0])
    raw = np.ascontiguousarray(np.asarray(tensor.data)).reshape(-1, cols // BLOCK, 34)
    d = raw[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
    codes = raw[..., 2:].copy().view(np.int8).reshape(raw.shape[0], cols)
    return Q8Matrix(torch.from_numpy(codes), torch.from_numpy(d))


def _blocks(raw: np.ndarray, cols: int) -> Q4Matrix:
    rows = raw.shape[0]
    blocks = np.ascontiguousarray(raw).reshape(rows, cols // BLOCK, 20)
    d = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
    m = blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
    nibbles = blocks[..., 4:]
    codes = np.concatenate([nibbles & 0x0F, nibbles >> 4], axis=-1).reshape(rows, cols)
    return Q4Matrix(torch.from_numpy(codes.copy()), torch.from_numpy(d), torch.from_numpy(m))


def _unpermute(matrix: Q4Matrix, heads: int) -> Q4Matrix:
    """Undo the converter's q/k row order: rows ``[heads, half, 2]`` -> ``[heads, 2, half]``."""

    def rows(t: torch.Tensor) -> torch.Tensor:
        out = t.shape[0]
        return t.reshape(heads, out // heads // 2, 2, *t.shape[1:]).transpose(1, 2).reshape(t.shape)

    return Q4Matrix(rows(matrix.codes), rows(matrix.d), rows(matrix.m))
