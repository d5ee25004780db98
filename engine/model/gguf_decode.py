"""GGUFDecodeLinear: a dense product whose few-row calls read the GGUF's quantized
blocks, with the dense product's bits.

A decode step multiplies a handful of rows by every weight of the model, so it costs
what reading the weights costs: 269 MB of bfloat16 for the bundled model (212 MB of
projections, 57 MB of LM head), ~9 ms on 2 cores of the AMD EPYC these figures come
from. The bundled GGUF holds the same weights as blocks of 32: the projections Q4_1
(0.625 bytes a weight with their scales), the LM head Q8_0 (1.06 bytes): 96 MB.
:class:`~engine.model.linear.Int4Linear` (``--weights q4_1``) multiplies with the
4-bit blocks but gives other numbers than the dense model. This class gives the
*same* numbers:

* the dense checkpoint is the blocks' float32 dequantization (Q4_1 ``d * q + m``,
  Q8_0 ``d * q``) rounded to bfloat16, and the kernel (``gguf_decode.c``) dequantizes
  each weight exactly so (checked against the dense weights, every element, at
  construction);
* oneDNN's packed bfloat16 product (:class:`~engine.model.linear.PackedLinear`) sums
  bfloat16 pairs with VDPBF16PS into one float32 accumulator per output, in input
  order, restarting every ``chunk`` inputs (on the CPUs measured 512, and 1024 for
  1,536 inputs at 2-32 rows) and rounding the total once; the kernel does the same,
  ``chunk`` being the first candidate whose results equal the packed product's on a
  probe of 128 rows (four 32-row tiles: the prefill's calls). No candidate matching:
  the product stays dense, and nothing changes.

So a decode row, a draft row and a prefill row of the same token get the same bits,
and ``batched == one at a time`` and ``cached == uncached`` hold as before. Calls of
up to :data:`MAX_ROWS` rows go through the kernel (the bundled model's 120
projections: 3.2 ms at 1 row, 3.6 at 5, 4.6 at 8, against 7.3-8.0 ms packed); more
rows go to the packed product, faster there (the kernel dequantizes per 8 rows).

A side effect: oneDNN sums a *lone* row of 1,536 inputs in chunks of 512, not 1024,
so its bits for one row differ from the same row's in a tile (1 output in ~6,000):
that is why the dense forward pads a lone row to 4 (``any_rows`` False). The kernel
sums every row count like the tiles, so a lone decode row goes unpadded.

The kernel is part of the engine's C library (:mod:`engine.model.native`: AVX-512
with bfloat16 and a C compiler, built on first use); where it is missing the dense
products stay.
"""

from __future__ import annotations

import ctypes
import functools
import logging
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from engine.model.attention import ROW_MULTIPLE
from engine.model.linear import ROW_TILE, PackedLinear, in_tiles
from engine.model.native import native_library
from engine.model.q4_weights import (
    BLOCK,
    Q4Matrix,
    Q8Matrix,
    fuse_layer,
    load_q4_layers,
    read_q8_output,
)

logger = logging.getLogger(__name__)

MAX_ROWS = 8
"""Calls of at most this many rows use the kernel; more go to the packed product."""
CHUNKS = (512, 1024)
"""The accumulation chunks tried, in order, before the whole input (see the module doc)."""
FORMATS = {Q4Matrix: 0, Q8Matrix: 1}
"""The kernel's format codes (``gguf_decode.c``)."""
_PROBE_TILES = 4


@dataclass(frozen=True)
class PackedBlocks:
    """A GGUF matrix in the kernel's layout (see ``gguf_decode.c``): ``data`` uint8 ``[out /
    16, in / 32, bytes]``, ``format`` a :data:`FORMATS` code, ``shape`` ``(out, in)``."""

    format: int
    shape: tuple[int, int]
    data: torch.Tensor


@dataclass(frozen=True)
class GGUFBlocks:
    """What :class:`GGUFDecodeLinear` reads: per layer the projections fused as the Llama
    forward multiplies them (``qkv o gate_up down``), and the LM head where it is Q8_0,
    packed."""

    layers: list[dict[str, PackedBlocks]]
    output: PackedBlocks | None


@functools.lru_cache(maxsize=2)
def read_gguf_blocks(path: Path) -> GGUFBlocks:
    """:class:`GGUFBlocks` of a Llama GGUF, read and packed once per process; only the
    packed copies are kept (96 MB for the bundled model). ValueError as
    :func:`~engine.model.q4_weights.load_q4_layers`."""
    layers = [{name: pack(m) for name, m in fuse_layer(layer).items()} for layer in load_q4_layers(path)]
    output = read_q8_output(path)
    return GGUFBlocks(layers, None if output is None else pack(output))


def pack(matrix: Q4Matrix | Q8Matrix) -> PackedBlocks:
    """``matrix`` in the kernel's layout. ValueError unless ``out`` is a multiple of 16 and
    ``in`` of 32."""
    out, cols = matrix.codes.shape
    if out % 16 or cols % BLOCK:
        raise ValueError(f"a {out} x {cols} matrix: the kernel needs out % 16 == 0 and in % {BLOCK} == 0")
    blocks, groups = out // 16, cols // BLOCK
    pairs = matrix.codes.numpy().view(np.uint8).reshape(blocks, 16, cols // 2, 2)
    first = pairs[:, :8].transpose(0, 2, 1, 3).reshape(blocks, cols // 2, 16)
    last = pairs[:, 8:].transpose(0, 2, 1, 3).reshape(blocks, cols // 2, 16)
    if isinstance(matrix, Q4Matrix):
        codes = (first | (last << 4)).reshape(blocks, groups, 256)
    else:
        codes = np.concatenate([first, last], axis=-1).reshape(blocks, groups, 512)

    def halves(t: torch.Tensor) -> np.ndarray:
        h = t.numpy().astype(np.float16).reshape(blocks, 16, groups).transpose(0, 2, 1)
        return np.ascontiguousarray(h).view(np.uint8).reshape(blocks, groups, 32)

    scales = [halves(matrix.d)] + ([halves(matrix.m)] if isinstance(matrix, Q4Matrix) else [])
    data = torch.from_numpy(np.ascontiguousarray(np.concatenate([*scales, codes], axis=2)))
    return PackedBlocks(FORMATS[type(matrix)], (out, cols), data)


class GGUFDecodeLinear:
    """A :class:`PackedLinear` whose calls of at most :data:`MAX_ROWS` rows run the kernel
    over the GGUF's blocks, with the packed product's bits. Build with :meth:`wrap`.
    Never changes the weights.

    ``any_rows`` is True: the kernel gives every count of 1-8 rows the tiles' bits
    (checked in :meth:`wrap`), and a call of more rows goes to the packed product in
    tiles, a tile whose row count is not a multiple of 4 padded to one where the packed
    product is not row-invariant at any count (``PackedLinear.any_rows``)."""

    any_rows = True

    def __init__(self, dense: PackedLinear, packed: torch.Tensor, format_: int, chunk: int,
                 lib: ctypes.CDLL) -> None:
        self.dense = dense
        self.packed = packed
        self.format = format_
        self.chunk = chunk
        self.out, self.cols = dense.weight.shape
        self._lib = lib

    @staticmethod
    def wrap(dense: PackedLinear, blocks: PackedBlocks) -> PackedLinear | GGUFDecodeLinear:
        """``dense`` with the kernel for few rows, or ``dense`` itself where the kernel is
        unavailable or does not give its bits (weights or sums; logged)."""
        lib = native_library()
        weight = dense.weight
        if (lib is None or dense.bias is not None or weight.dtype != torch.bfloat16 or not dense.is_packed
                or blocks.shape != tuple(weight.shape)):
            return dense
        format_, packed = blocks.format, blocks.data
        out, cols = weight.shape
        if lib.gguf_decode_mismatches(format_, packed.data_ptr(), out, cols, weight.contiguous().data_ptr()):
            logger.warning("GGUF decode products off for a %d x %d matrix: its blocks are not the dense weights",
                           out, cols)
            return dense
        generator = torch.Generator().manual_seed(out * 7919 + cols)
        probe = (3 * torch.randn((_PROBE_TILES * ROW_TILE, cols), generator=generator)).to(weight.dtype)
        with torch.inference_mode():
            expected = torch.cat([dense(probe[k : k + ROW_TILE]) for k in range(0, len(probe), ROW_TILE)])
            for chunk in (*(c for c in CHUNKS if c < cols), cols):
                if chunk % BLOCK or not torch.equal(_kernel(lib, format_, packed, out, cols, chunk, probe), expected):
                    continue
                # the passes of 8 rows matched; every shorter pass is its own compiled loop
                if all(torch.equal(_kernel(lib, format_, packed, out, cols, chunk, probe[5 : 5 + rows]),
                                   expected[5 : 5 + rows]) for rows in range(1, MAX_ROWS)):
                    return GGUFDecodeLinear(dense, packed, format_, chunk, lib)
        logger.warning("GGUF decode products off for a %d x %d matrix: no chunk gives oneDNN's bits", out, cols)
        return dense

    def _product(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.shape[0]
        if rows <= MAX_ROWS:
            return _kernel(self._lib, self.format, self.packed, self.out, self.cols, self.chunk, x)
        if self.dense.any_rows or rows % ROW_MULTIPLE == 0:
            return self.dense._product(x)
        extra = ROW_MULTIPLE - rows % ROW_MULTIPLE
        return self.dense._product(torch.cat([x, x.new_zeros((extra, x.shape[1]))]))[:rows]

    def __call__(self, x: torch.Tensor, exact_rows: int | None = None) -> torch.Tensor:
        """As :meth:`PackedLinear.__call__`: tiles of at most 32 rows (``exact_rows`` alike)."""
        return in_tiles(self._product, x, exact_rows)

    @property
    def weight(self) -> torch.Tensor:
        return self.dense.weight


def _kernel(lib: ctypes.CDLL, format_: int, packed: torch.Tensor, out: int, cols: int, chunk: int,
            x: torch.Tensor) -> torch.Tensor:
    """``x @ W.T`` for any number of rows (in passes of 8), on torch's thread count."""
    x = x.contiguous()
    rows = x.shape[0]
    y = torch.empty((rows, out), dtype=torch.bfloat16)
    if rows:
        lib.gguf_decode_product(format_, packed.data_ptr(), out, cols, chunk, x.data_ptr(), rows, y.data_ptr(),
                                torch.get_num_threads())
    return y
