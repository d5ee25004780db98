"""PackedLinear: a weight matrix laid out once for oneDNN, multiplied in fixed row tiles
(and Int4Linear: the same tiles over a GGUF's 4-bit blocks, opt-in).

Two jobs, one class:

* **Speed.** A bfloat16 ``F.linear`` on CPU hands the weight to oneDNN, which
  re-lays it out into its blocked format on every call. For the small row counts of
  decoding this reorder costs as much as the product itself: measured on the bundled
  model (2 threads, all 210 projections, bfloat16), 24-26 ms per forward at 8 rows
  with ``F.linear`` against 16-19 ms with the weights packed once; 12-16 ms against
  8 ms for the LM head at 4-8 rows. float32 is packed the same way.

* **Batch invariance.** A row's result must not depend on how many rows share the
  call (:mod:`engine.model.runner` relies on it: batched equals one at a time, a
  prefill chunk's K/V equal a decode's). CPU GEMMs choose their blocking by the row
  count, and some choices sum a row's products in another order. Measured on a Xeon
  with AMX (oneDNN's ``brg_matmul:avx10_1_512_amx``, the same kernel name at every
  count): bfloat16 rows of a call of 1-32 rows all get the same bits, but a call of
  33 or more rows rounds some of them differently; float32 through MKL
  (``F.linear``) changes between 4, 8-12 and 16+ rows, while oneDNN's float32 kernel
  gives the same bits at 2-640 rows. So the product runs on tiles of at most
  :data:`ROW_TILE` rows (one kernel call per tile), and a row's bits depend only on
  the row and the weight. Callers pass a multiple of
  :data:`~engine.model.attention.ROW_MULTIPLE` rows (the runner pads), so every tile
  has 4-32 rows (oneDNN's float32 kernel rounds a lone row differently).
  :func:`row_invariant` checks this at construction on a probe; where the packed
  product fails it, ``F.linear`` is tried; where both fail a warning is logged.

The price of tiling: a prefill calls the kernel once per 32 rows, reading the weight
each time, and AMX's wide-row blocking is not used (see ARCHITECTURE.md, "Exactness",
for the measured cost). In bfloat16 a tile's bits are ``F.linear``'s on the same rows.

The generic forward (architectures other than Llama) gets the same products through
:class:`TiledLinears`, which routes its ``nn.Linear`` modules through this class
during the runner's forward.

Memory: a packed weight is a second copy of the matrix (the transformers modules
keep theirs for the generic forward): about 210 MB more for the bundled 135M model
in bfloat16.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.nn.functional as F

logger = logging.getLogger(__name__)

ROW_TILE = 32
"""Most rows per kernel call: at 1-32 rows the measured kernels give a row the same
bits whatever the count (a multiple of 4)."""
FREE_ROWS = 16
"""The rows past ``exact_rows`` (:func:`in_tiles`) go in one call of a multiple of this
many rows and one of the rest: at most 47 row counts up to 512 rows, not 512."""
_PROBE_ROWS = (4, 8, 12, 20, 28)
_LONE_ROWS = (1, 2, 3, 5, 7)
"""Row counts that are not a multiple of 4, probed for :attr:`PackedLinear.any_rows`."""


def _packing_available(dtype: torch.dtype) -> bool:
    if dtype not in (torch.bfloat16, torch.float32) or not torch.backends.mkldnn.is_available():
        return False
    return dtype == torch.float32 or bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


class PackedLinear:
    """``x @ weight.T (+ bias)`` for ``x`` ``[rows, in]``, computed in tiles of at most
    :data:`ROW_TILE` rows: oneDNN-packed where that is row-invariant, else ``F.linear``.
    Never changes ``weight``.

    ``any_rows``: the product also gives a row the same bits in calls of 1-3 rows (and
    counts that are not a multiple of 4), probed at construction: callers may then
    skip the padding to a multiple of 4 rows (bfloat16 on AMX does; oneDNN's float32
    kernel rounds a lone row differently and does not)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        self.weight = weight
        self.bias = bias
        self.packed: torch.Tensor | None = None
        if _packing_available(weight.dtype):
            self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), None)
            if not row_invariant(self._product, weight.shape[1], weight.dtype):
                self.packed = None
        if self.packed is None and not row_invariant(self._product, weight.shape[1], weight.dtype):
            logger.warning(
                "a %s x %s %s product's row bits depend on the row count on this CPU: "
                "batched outputs may differ from one-at-a-time ones",
                *weight.shape, weight.dtype,
            )
        self.any_rows = row_invariant(self._product, weight.shape[1], weight.dtype, _LONE_ROWS)

    def _product(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is None:
            return F.linear(x, self.weight, self.bias)
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")

    def __call__(self, x: torch.Tensor, exact_rows: int | None = None) -> torch.Tensor:
        """``exact_rows``: only the rows before it need row-invariant bits; the rest
        (compressed requests' prefill chunks, approximate by design) are multiplied
        untiled after the exact rows' tiles (see :func:`in_tiles`)."""
        return in_tiles(self._product, x, exact_rows)

    @property
    def is_packed(self) -> bool:
        return self.packed is not None


class Int4Linear:
    """``x @ W.T`` for a Q4_1 matrix ``W`` (:class:`~engine.model.q4_weights.Q4Matrix`)
    and bfloat16 ``x`` ``[rows, in]``, with torch's weight-only 4-bit kernel
    (``_weight_int4pack_mm_for_cpu``, groups of 32 along ``in``: scale ``d`` and zero
    ``m + 8d``, so ``(q - 8) * d + m + 8d = d * q + m``), in tiles of :data:`ROW_TILE`
    rows like :class:`PackedLinear` (the kernel is row-invariant at 1-600 rows on the
    AMX Xeon, and its time grows faster than linearly with rows above 32).

    A quarter of bfloat16's bytes: on the AMX Xeon the 120 projections of the bundled
    model took 11.7 ms at 4 rows against 24.5 ms packed bfloat16, but 71.5 against
    35.4 ms at 32 rows. The scales are rounded to bfloat16 (the kernel's dtype), so the
    weights differ from the dense checkpoint's by up to a bfloat16 rounding of ``d``
    and ``m + 8d`` per block: opt-in (``EngineConfig.weights``).

    ``any_rows`` as in :class:`PackedLinear`. It matters more here: the kernel's time
    grows with the rows even at decode sizes (all 120 projections of the bundled
    model, 1 thread: ~13 ms at 1 row, ~28 ms at 4, ~54 ms at 8), so a lone decode row
    left unpadded costs about half of a padded one."""

    def __init__(self, matrix: Any, dtype: torch.dtype = torch.bfloat16) -> None:
        out, cols = matrix.codes.shape
        self.shape = (out, cols)
        self.packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(matrix.codes.to(torch.int32), 1)
        self.scales_and_zeros = (
            torch.stack([matrix.d, matrix.m + 8 * matrix.d], dim=-1).transpose(0, 1).contiguous().to(dtype)
        )
        if not row_invariant(self._product, cols, dtype):
            logger.warning("the 4-bit %s x %s product's row bits depend on the row count on this CPU", out, cols)
        self.any_rows = row_invariant(self._product, cols, dtype, _LONE_ROWS)

    def _product(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.aten._weight_int4pack_mm_for_cpu(x, self.packed, 32, self.scales_and_zeros)

    def __call__(self, x: torch.Tensor, exact_rows: int | None = None) -> torch.Tensor:
        """Always in tiles, ``exact_rows`` or not: past 32 rows the 4-bit kernel's time
        grows faster than the rows."""
        return in_tiles(self._product, x)


def in_tiles(product: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor,
             exact_rows: int | None = None) -> torch.Tensor:
    """``product`` of ``x`` ``[rows, in]``, one call per :data:`ROW_TILE` rows.

    With ``exact_rows``, the tiles that hold a row before it are the same as without
    (so those rows keep their bits), and the rows after the last of them go in one
    call of a multiple of :data:`FREE_ROWS` rows and one of the rest: a row there gets
    whatever bits the kernel's blocking for that count gives, about 2.4x faster at 512
    rows on the AMX Xeon (bfloat16, 2 threads; oneDNN's wide AMX blocking, the weight
    read once)."""
    rows = x.shape[0]
    if rows <= ROW_TILE:
        return product(x)
    tiled = rows if exact_rows is None else min(rows, -(-exact_rows // ROW_TILE) * ROW_TILE)
    parts = [product(x[k : k + ROW_TILE]) for k in range(0, tiled, ROW_TILE)]
    # a multiple of FREE_ROWS, then the rest: oneDNN compiles a kernel per row count,
    # and these counts vary step by step (a layer-wise chunk's survivors)
    whole = tiled + (rows - tiled) // FREE_ROWS * FREE_ROWS
    parts += [product(x[a:b]) for a, b in ((tiled, whole), (whole, rows)) if b > a]
    return parts[0] if len(parts) == 1 else torch.cat(parts)


class TiledLinears:
    """A :class:`PackedLinear` for every ``nn.Linear`` of a model, for the generic
    forward's batch invariance. :meth:`installed` routes the modules' forward through
    them (leading dimensions flattened into rows) for the duration of a call and then
    puts the modules back as they were: the model itself is never changed, so a copy
    or a stock forward of it sees plain ``nn.Linear`` modules. Memory: a second copy of
    each weight."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.modules: list[tuple[torch.nn.Module, Callable[[torch.Tensor], torch.Tensor]]] = []
        for module in model.modules():
            if isinstance(module, torch.nn.Linear):
                bias = None if module.bias is None else module.bias.detach()
                self.modules.append((module, _rows_of(PackedLinear(module.weight.detach(), bias))))

    @contextlib.contextmanager
    def installed(self) -> Iterator[None]:
        saved = [module.__dict__.get("forward") for module, _ in self.modules]
        for module, forward in self.modules:
            module.__dict__["forward"] = forward
        try:
            yield
        finally:
            for (module, _), before in zip(self.modules, saved, strict=True):
                if before is None:
                    del module.__dict__["forward"]
                else:
                    module.__dict__["forward"] = before


def _rows_of(packed: PackedLinear) -> Callable[[torch.Tensor], torch.Tensor]:
    def forward(x: torch.Tensor) -> torch.Tensor:
        out = packed(x.reshape(-1, x.shape[-1]))
        return out.view(*x.shape[:-1], out.shape[-1])

    return forward


def row_invariant(
    product: Callable[[torch.Tensor], torch.Tensor], in_features: int, dtype: torch.dtype,
    counts: tuple[int, ...] = _PROBE_ROWS,
) -> bool:
    """True when ``product`` gives every row of a probe ``[rows, in_features]`` the same
    bits in a call of :data:`ROW_TILE` rows as in calls of fewer rows (``counts``: by
    default multiples of 4), at the first and the last offset."""
    generator = torch.Generator().manual_seed(0)
    with torch.inference_mode():
        x = torch.randn((ROW_TILE, in_features), generator=generator).to(dtype)
        full = product(x)
        for rows in counts:
            offset = ROW_TILE - rows
            if not torch.equal(product(x[:rows]), full[:rows]):
                return False
            if not torch.equal(product(x[offset:]), full[offset:]):
                return False
    return True
