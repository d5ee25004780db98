"""PackedLinear: a weight matrix laid out once for oneDNN, multiplied with the same bits.

A bfloat16 ``F.linear`` on CPU hands the weight to oneDNN, which re-lays it out
into its blocked format on every call. For the small row counts of decoding this
reorder costs as much as the product itself: measured on the bundled model (2
threads, all 210 projections, bfloat16), 24-26 ms per forward at 8 rows with
``F.linear`` against 16-19 ms with the weights packed once; 12-16 ms against 8 ms
for the LM head at 4-8 rows.

oneDNN's packed product computes the same bits as ``F.linear``'s (checked at
construction on a probe, and by the tests over every shape of the model), so
nothing downstream changes: outputs still equal transformers' forward, and a
row's result still does not depend on how many rows the call has (the batch
invariance that :mod:`engine.model.runner` relies on). Where the check fails, or
for another dtype (float32 ``F.linear`` runs MKL, whose bits differ from
oneDNN's), or where oneDNN has no bfloat16 kernels, the weight is used as is.

Memory: a packed weight is a second copy of the matrix (the transformers modules
keep theirs for the generic forward), so bfloat16 serving holds the projections
twice: about 210 MB more for the bundled 135M model.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

_PROBE_ROWS = (1, 4, 12)


def _packing_available(dtype: torch.dtype) -> bool:
    return (
        dtype == torch.bfloat16
        and torch.backends.mkldnn.is_available()
        and bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    )


class PackedLinear:
    """``x @ weight.T`` (no bias) for ``x`` ``[rows, in]``: oneDNN-packed where that
    gives ``F.linear``'s bits, else ``F.linear``. Never changes ``weight``."""

    def __init__(self, weight: torch.Tensor) -> None:
        self.weight = weight
        self.packed: torch.Tensor | None = None
        if _packing_available(weight.dtype):
            packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), None)
            if _same_bits(weight, packed):
                self.packed = packed

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is None:
            return F.linear(x, self.weight)
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, None, "none", [], "")

    @property
    def is_packed(self) -> bool:
        return self.packed is not None


def _same_bits(weight: torch.Tensor, packed: torch.Tensor) -> bool:
    generator = torch.Generator().manual_seed(0)
    with torch.inference_mode():
        for rows in _PROBE_ROWS:
            x = torch.randn((rows, weight.shape[1]), generator=generator).to(weight.dtype)
            ours = torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")
            if not torch.equal(ours, F.linear(x, weight)):
                return False
    return True
