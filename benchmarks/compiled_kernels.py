"""CompiledLayers: a Llama layer's ops outside attention and the products, compiled by inductor.

Between its four matrix products and attention a layer of
:class:`~engine.model.llama.LlamaForward` runs a dozen small ops: two RMSNorms, RoPE,
``silu(gate) * up``, two residual adds. Eagerly each is one or more ATen calls with
their dispatch cost; here they are four fused kernels per layer, compiled by
inductor's C++ backend:

* ``add_norm``: a residual add and the next RMSNorm (the post-attention norm after
  ``o_proj``; the next layer's input norm after ``down_proj``); ``norm`` alone for
  the first layer;
* ``rope``: RoPE on the queries and keys;
* ``silu_mul``: ``silu(gate) * up``.

The products (:mod:`engine.model.linear`) and attention stay eager
(:meth:`CompiledLayers.run` is the layer loop with the kernels in place).

Exactness: a kernel must give every element eager's bits, or batched ==
one-at-a-time and cached == uncached would hold only within one mode. Two things
differ with inductor's defaults and are put back:

* inductor keeps a fused chain of bfloat16 ops in float32; with
  ``emulate_precision_casts`` it rounds to the model dtype wherever eager does;
* inductor sums RMSNorm's squares in its own order. :func:`aten_row_sum` writes out
  ATen's order instead (its CPU inner-sum kernel: a cascade of ``4 x lanes``-wide
  partial sums, then the scalar tail and the lanes in order) as plain adds, which
  inductor keeps in order (it compiles without reassociation, ``-ffp-contract=off``).
  The lane count is that of ATen's float sum kernel here (8 on the AVX-512 Xeon
  measured: its reductions run the AVX2 kernel); :func:`sum_lanes` finds it on a
  probe, and :meth:`CompiledLayers.check` compares every kernel with eager.

Two backends: ``torch.compile`` (a graph for a lone row and one for any other
count, compiled on first use; each call pays dynamo's guards and wrappers) and
AOTInductor (each kernel exported with a dynamic row count, built into a shared
library once, ~5-9 s a kernel, and called through its loader: ~2 us a call against
~13 us).

An experiment of issue 27, kept with its benchmark rather than in the engine, which
does not use it: measured on the bundled model (``benchmarks/compiled_layers.py``,
docs/performance.md "Issue 27: compiled per-layer ops"), the AOTInductor kernels keep
every bit and save ~8% of a decode step, the ``torch.compile`` ones cost ~16% more;
too little for a 25 s build at start-up, a second layer loop (:meth:`CompiledLayers.run`)
and a reproduction of ATen's summation order that another CPU or torch may not share.
"""

from __future__ import annotations

import functools
import math
import os
import tempfile
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F

from engine.model.attention import AttentionBatch, paged_attention

_OPTIONS: dict[str, Any] = {"emulate_precision_casts": True}
Kernel = Callable[..., Sequence[torch.Tensor]]
_ILP = 4
_LEVELS = 4


def aten_row_sum(squares: torch.Tensor, lanes: int) -> torch.Tensor:
    """``squares.sum(-1)`` (float32 ``[rows, n]``) in the order of ATen's CPU inner-sum
    kernel with ``lanes``-wide vectors: vector ``i`` of a row goes to partial ``i % 4``
    (each a cascade of levels of 16 or more vectors), the partials are added in order,
    then the scalar tail and the lanes, one by one. Plain tensor ops: the same bits
    eagerly and compiled."""
    rows, n = squares.shape
    vectors = n // lanes
    vecs = squares[:, : vectors * lanes].view(rows, vectors, lanes)
    groups = vectors // _ILP
    power = max(4, (math.ceil(math.log2(groups)) if groups > 1 else 0) // _LEVELS)
    step, mask = 1 << power, (1 << power) - 1
    acc: list[torch.Tensor | None] = [None] * _LEVELS  # None: still zero

    def add(a: torch.Tensor | None, b: torch.Tensor | None) -> torch.Tensor | None:
        return b if a is None else a if b is None else a + b

    i = 0  # groups summed so far
    while i + step <= groups:
        for _ in range(step):
            acc[0] = add(acc[0], vecs[:, i * _ILP : (i + 1) * _ILP])
            i += 1
        for level in range(1, _LEVELS):
            acc[level], acc[level - 1] = add(acc[level], acc[level - 1]), None
            if i & (mask << (level * power)):
                break
    for g in range(i, groups):
        acc[0] = add(acc[0], vecs[:, g * _ILP : (g + 1) * _ILP])
    for level in range(1, _LEVELS):
        acc[0] = add(acc[0], acc[level])
    first = acc[0]
    parts: list[torch.Tensor | None] = [None if first is None else first[:, k] for k in range(_ILP)]
    for v in range(groups * _ILP, vectors):
        parts[0] = add(parts[0], vecs[:, v])
    vector: torch.Tensor | None = parts[0]
    for k in range(1, _ILP):
        vector = add(vector, parts[k])
    total: torch.Tensor | None = None
    for k in range(vectors * lanes, n):
        total = add(total, squares[:, k])
    if vector is not None:
        for lane in range(lanes):
            total = add(total, vector[:, lane])
    return squares.new_zeros(rows) if total is None else total


@functools.cache
def sum_lanes() -> int | None:
    """The vector width (in float32 lanes) of ATen's inner sum here: the one of 8, 16,
    4 whose :func:`aten_row_sum` gives ``sum``'s bits on a probe; None if none does."""
    gen = torch.Generator().manual_seed(0)
    probe = torch.randn((64, 4099), generator=gen).square() * torch.rand((64, 1), generator=gen)
    with torch.inference_mode():
        for lanes in (8, 16, 4):
            if all(torch.equal(aten_row_sum(p, lanes), p.sum(-1)) for p in (probe[:, :n].contiguous() for n in (64, 576, 4099))):
                return lanes
    return None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, lanes: int) -> torch.Tensor:
    """:func:`engine.model.llama._rms_norm` (torch's ``rms_norm``, then the weight)
    written out with the sum in ATen's order: the same bits, compilable."""
    upcast = x.float()
    variance = aten_row_sum(upcast * upcast, lanes) / x.shape[-1]
    return weight * (upcast * torch.rsqrt(variance + eps)[:, None]).to(x.dtype)


class CompiledLayers:
    """The compiled kernels of one model's layers (shared by all of them: the weights are
    inputs). ``backend``: ``"compile"`` (``torch.compile``, compiled on first use of
    each row-count class) or ``"aoti"`` (AOTInductor: each kernel exported with a
    dynamic row count and compiled to a shared library at construction, then called
    through its loader with no guards or wrappers). Every kernel returns a tuple."""

    def __init__(self, eps: float, num_heads: int, kv_heads: int, head_dim: int, hidden_size: int,
                 intermediate_size: int, dtype: torch.dtype, *, exact: bool = True, backend: str = "compile",
                 package_dir: str | None = None) -> None:
        """``exact=False``: inductor's defaults and torch's ``rms_norm`` (for measuring
        what the two fixes change; not the same bits)."""
        lanes = sum_lanes()
        if lanes is None:
            raise ValueError("ATen's sum order on this CPU is not one CompiledLayers can write out")
        self.eps, self.lanes, self.exact = eps, lanes, exact
        self.num_heads, self.qk_heads, self.head_dim = num_heads, num_heads + kv_heads, head_dim
        self.hidden_size, self.intermediate_size, self.dtype = hidden_size, intermediate_size, dtype
        options: dict[str, Any] = _OPTIONS if exact else {}
        rows = 8
        hidden = torch.zeros((rows, hidden_size), dtype=dtype)
        weight = torch.ones(hidden_size, dtype=dtype)
        qkv = torch.zeros((rows, (num_heads + 2 * kv_heads) * head_dim), dtype=dtype)
        angles = torch.zeros((rows, 1, head_dim), dtype=dtype)
        gate_up = torch.zeros((rows, 2 * intermediate_size), dtype=dtype)
        kernels: dict[str, tuple[Callable[..., tuple[torch.Tensor, ...]], tuple[torch.Tensor, ...]]] = {
            "norm": (self._norm, (hidden, weight)),
            "add_norm": (self._add_norm, (hidden, hidden.clone(), weight)),
            "rope": (self._rope, (qkv, angles, angles.clone())),
            "silu_mul": (self._silu_mul, (gate_up,)),
        }
        if backend not in ("compile", "aoti"):
            raise ValueError(f"backend must be compile or aoti, got {backend!r}")
        self.compile_seconds: dict[str, float] = {}
        """Per kernel, the seconds its construction took (AOTInductor: export and build)."""
        built: dict[str, Kernel] = {}
        for name, (fn, examples) in kernels.items():
            start = time.perf_counter()
            built[name] = (torch.compile(fn, options=options) if backend == "compile"
                           else _aoti(fn, examples, options, package_dir, name))
            self.compile_seconds[name] = time.perf_counter() - start
        self.norm: Kernel = built["norm"]
        """``(weight * rms_norm(hidden),)`` of ``(hidden, weight)``."""
        self.add_norm: Kernel = built["add_norm"]
        """``(hidden + delta, weight * rms_norm(hidden + delta))`` of ``(hidden, delta, weight)``."""
        self.rope: Kernel = built["rope"]
        """``(RoPE'd queries and keys,)`` ``[rows, heads + kv_heads, head_dim]`` of ``(qkv, cos, signed_sin)``."""
        self.silu_mul: Kernel = built["silu_mul"]
        """``(silu(gate) * up,)`` of ``(gate_up,)``."""

    def _norm(self, hidden: torch.Tensor, weight: torch.Tensor) -> tuple[torch.Tensor]:
        if not self.exact:
            return (weight * F.rms_norm(hidden, (hidden.shape[-1],), eps=self.eps),)
        return (rms_norm(hidden, weight, self.eps, self.lanes),)

    def _add_norm(self, hidden: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor,
                  ) -> tuple[torch.Tensor, torch.Tensor]:
        hidden = hidden + delta
        return hidden, self._norm(hidden, weight)[0]

    def _rope(self, qkv: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> tuple[torch.Tensor]:
        t, d = qkv.shape[0], self.head_dim
        qk = qkv.view(t, -1, d)[:, : self.qk_heads]
        swapped = qk.view(t, self.qk_heads, 2, d // 2).flip(2).view(t, self.qk_heads, d)
        return (qk * cos + swapped * signed_sin,)

    @staticmethod
    def _silu_mul(gate_up: torch.Tensor) -> tuple[torch.Tensor]:
        half = gate_up.shape[1] // 2
        return (F.silu(gate_up[:, :half]) * gate_up[:, half:],)

    def check(self, rows: Sequence[int] = (1, 3, 8, 40)) -> list[str]:
        """The kernels (and row counts) whose outputs differ from the eager ops' bits on
        random probes of ``rows`` rows; empty when every one matches."""
        from engine.model import llama

        dtype, hidden_size, intermediate_size = self.dtype, self.hidden_size, self.intermediate_size
        gen = torch.Generator().manual_seed(0)
        heads = self.qk_heads + self.qk_heads - self.num_heads
        differ = []

        def rand(*shape: int) -> torch.Tensor:
            return (torch.randn(shape, generator=gen) * 3).to(dtype)

        weight, post = rand(hidden_size), rand(hidden_size)
        with torch.inference_mode():
            for n in rows:
                hidden, delta = rand(n, hidden_size), rand(n, hidden_size)
                qkv, gate_up = rand(n, heads * self.head_dim), rand(n, 2 * intermediate_size)
                cos, signed_sin = rand(n, 1, self.head_dim), rand(n, 1, self.head_dim)
                added = hidden + delta
                expected = {
                    "norm": (llama._rms_norm(hidden, weight, self.eps),),
                    "add_norm": (added, llama._rms_norm(added, post, self.eps)),
                    "rope": (llama._rope(qkv.view(n, heads, self.head_dim)[:, : self.qk_heads], cos, signed_sin),),
                    "silu_mul": (F.silu(gate_up[:, :intermediate_size]) * gate_up[:, intermediate_size:],),
                }
                got = {"norm": self.norm(hidden, weight), "add_norm": self.add_norm(hidden, delta, post),
                       "rope": self.rope(qkv, cos, signed_sin), "silu_mul": self.silu_mul(gate_up)}
                differ += [f"{name} at {n} rows" for name, want in expected.items()
                           if not all(torch.equal(a, b) for a, b in zip(got[name], want, strict=True))]
        return differ

    def run(self, layers: Sequence[Any], hidden: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor,
            batch: AttentionBatch, scale: float) -> torch.Tensor:
        """The hidden states after ``layers`` (a Llama forward's ``_Layer`` list) of
        ``hidden``; writes each layer's K/V into the batch's slots."""
        t, d = hidden.shape[0], self.head_dim
        x = self.norm(hidden, layers[0].input_norm)[0]
        for i, layer in enumerate(layers):
            qkv = layer.qkv(x)
            qk = self.rope(qkv, cos, signed_sin)[0]
            v = qkv.view(t, -1, d)[:, self.qk_heads :]
            h = self.num_heads
            hidden, x = self.add_norm(hidden, layer.o(paged_attention(i, qk[:, :h], qk[:, h:], v, batch, scale)),
                                      layer.post_norm)
            down = layer.down(self.silu_mul(layer.gate_up(x))[0])
            if i + 1 < len(layers):
                hidden, x = self.add_norm(hidden, down, layers[i + 1].input_norm)
            else:
                hidden = hidden + down
        return hidden


class _Kernel(torch.nn.Module):
    def __init__(self, fn: Callable[..., tuple[torch.Tensor, ...]]) -> None:
        super().__init__()
        self.fn = fn

    def forward(self, *args: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return self.fn(*args)


def _aoti(fn: Callable[..., tuple[torch.Tensor, ...]], examples: tuple[torch.Tensor, ...], options: dict[str, Any],
          package_dir: str | None, name: str) -> Kernel:
    """``fn`` exported with a dynamic first dimension on every input of more than one
    dimension, compiled by AOTInductor; the loader's ``run`` (a list in, a list out)."""
    rows = torch.export.Dim("rows", min=1)
    shapes = tuple({0: rows} if x.dim() > 1 else None for x in examples)
    program = torch.export.export(_Kernel(fn), examples, dynamic_shapes={"args": shapes})
    directory = package_dir or tempfile.mkdtemp(prefix="prefixgate-aoti-")
    path = torch._inductor.aoti_compile_and_package(program, package_path=os.path.join(directory, f"{name}.pt2"),
                                                    inductor_configs=dict(options))
    run = torch._inductor.aoti_load_package(path).loader.run

    def call(*args: torch.Tensor) -> Sequence[torch.Tensor]:
        return run(list(args))

    return call
