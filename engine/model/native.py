"""The engine's C library: kernels that give torch's bits with fewer bytes or calls.

Three sources, one shared library:

* ``gguf_decode.c``: few-row products from a GGUF's quantized blocks with oneDNN's
  bfloat16 bits (:mod:`engine.model.gguf_decode`);
* ``rms_norm.c``: torch's RMSNorm of a few bfloat16 rows, then the weight, with its
  bits (:func:`rms_norm`): one call where torch dispatches eight ops (~4.5 us against
  ~14 us for a 576-wide row, 61 of them a decode step);
* ``decode_attention.c``: a decode group's two attention products read straight from
  the paged pool with torch's bits (:func:`decode_scores`, :func:`decode_values`; used
  by :mod:`engine.model.attention` where its probe agrees).

Needs AVX-512 with bfloat16 (``avx512_bf16``, ``avx512bw``, ``avx512vl``, ``f16c``)
and a C compiler with OpenMP (``$CC``, ``cc`` or ``gcc``). Built on first use into
``prefixgate_home()/native/engine-<hash>.so`` (hash of the sources, compiler and
flags; ~1 s; a temporary file renamed into place, so concurrent builders each
publish a whole library) and loaded after torch: its ``libgomp.so.1`` then resolves
to torch's, one OpenMP runtime. Where any of this fails, :func:`native_library` is
None (one log line) and callers keep torch's ops: the outputs are the same either
way, only the speed differs. ``PREFIXGATE_NATIVE=0`` in the environment turns the
library off on purpose (to compare, or to rule it out).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch
import torch.nn.functional as F

from engine.model_store import prefixgate_home

logger = logging.getLogger(__name__)

SOURCES = tuple(Path(__file__).with_name(name) for name in ("gguf_decode.c", "rms_norm.c", "decode_attention.c"))
NORM_ROWS = 8
"""RMSNorm calls of at most this many rows use :func:`rms_norm`'s kernel."""
_FLAGS = ("-O3", "-shared", "-fPIC", "-fopenmp", "-ffp-contract=off", "-mavx512f", "-mavx512bw",
          "-mavx512vl", "-mavx512bf16", "-mf16c")
_CPU_FLAGS = ("avx512f", "avx512bw", "avx512vl", "avx512_bf16", "f16c")
_INT, _PTR = ctypes.c_int, ctypes.c_void_p
_SIGNATURES = {
    "gguf_decode_product": ([_INT, _PTR, _INT, _INT, _INT, _PTR, _INT, _PTR, _INT], None),
    "gguf_decode_mismatches": ([_INT, _PTR, _INT, _INT, _PTR], ctypes.c_long),
    "rms_norm_rows": ([_PTR, _INT, _INT, _PTR, ctypes.c_float, _PTR], ctypes.c_int),
    "decode_scores": ([_PTR, _INT, _INT, _INT, _INT, _PTR, _PTR, _INT, _INT, _PTR, _INT], None),
    "decode_values": ([_PTR, _INT, _INT, _INT, _INT, _PTR, _PTR, _INT, _INT, _INT, _PTR, _INT], None),
}
PARALLEL_WORK = 8192
"""A decode group's products run on torch's threads from this many positions (KV heads x
sequences x keys); below, on the calling thread alone."""


@functools.cache
def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags (``/proc/cpuinfo``'s first ``flags`` line; empty where
    there is none)."""
    try:
        text = Path("/proc/cpuinfo").read_text(encoding="ascii", errors="replace")
    except OSError:
        return frozenset()
    return frozenset(next((line.split(":", 1)[1].split() for line in text.splitlines()
                           if line.startswith("flags")), []))


def _cpu_supported() -> bool:
    return all(flag in cpu_flags() for flag in _CPU_FLAGS)


@functools.cache
def native_library() -> ctypes.CDLL | None:
    """The library, built once per sources, compiler and flags; None where this CPU or
    machine cannot build or load it (logged once)."""
    if os.environ.get("PREFIXGATE_NATIVE", "1") == "0":
        logger.info("native kernels off: PREFIXGATE_NATIVE=0")
        return None
    if not _cpu_supported():
        logger.info("native kernels off: the CPU lacks one of %s", ", ".join(_CPU_FLAGS))
        return None
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        logger.warning("native kernels off: no C compiler ($CC, cc or gcc)")
        return None
    digest = hashlib.sha256(" ".join((compiler, *_FLAGS)).encode())
    for source in SOURCES:
        digest.update(source.read_bytes())
    target = prefixgate_home() / "native" / f"engine-{digest.hexdigest()[:16]}.so"
    try:
        if not target.is_file():
            _build(compiler, target)
        lib = ctypes.CDLL(str(target))
    except (OSError, subprocess.SubprocessError) as exc:
        stderr = (getattr(exc, "stderr", None) or b"").decode(errors="replace")[-500:]
        logger.warning("native kernels off: building or loading %s failed: %s %s", target, exc, stderr)
        return None
    for name, (args, result) in _SIGNATURES.items():
        function = getattr(lib, name)
        function.argtypes, function.restype = args, result
    return lib


def _build(compiler: str, target: Path) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    try:
        subprocess.run([compiler, *_FLAGS, "-o", tmp, *map(str, SOURCES), "-lm"], check=True, capture_output=True,
                       timeout=120)
        os.chmod(tmp, 0o755)
        os.replace(tmp, target)
    finally:
        Path(tmp).unlink(missing_ok=True)


def torch_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' ``LlamaRMSNorm`` with torch's ops: ``rms_norm`` upcasts a bfloat16
    ``x``, normalises in float32 and rounds back; the weight multiplies after the
    rounding, as transformers does."""
    return weight * F.rms_norm(x, (x.shape[-1],), eps=eps)


@functools.cache
def norm_agrees(width: int, eps: float) -> bool:
    """Whether the kernel gives :func:`torch_rms_norm`'s bits for bfloat16 rows of
    ``width`` here: checked once per width and eps on 64 random rows at three scales."""
    lib = native_library()
    if lib is None or width > 16384:
        return False
    generator = torch.Generator().manual_seed(width)
    weight = torch.randn(width, generator=generator).to(torch.bfloat16)
    with torch.inference_mode():
        for scale in (0.01, 1.0, 30.0):
            x = (scale * torch.randn((64, width), generator=generator)).to(torch.bfloat16)
            if not torch.equal(_kernel_norm(lib, x, weight, eps), torch_rms_norm(x, weight, eps)):
                logger.warning("native RMSNorm off for width %d: its bits differ from torch's here", width)
                return False
    return True


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """:func:`torch_rms_norm` of ``x`` (``[rows, width]``), through the kernel for at most
    :data:`NORM_ROWS` contiguous bfloat16 rows where :func:`norm_agrees`: the same bits."""
    lib = native_library()
    if (lib is None or x.shape[0] > NORM_ROWS or x.dtype != torch.bfloat16 or weight.dtype != torch.bfloat16
            or x.dim() != 2 or not norm_agrees(x.shape[1], eps)):
        return torch_rms_norm(x, weight, eps)
    return _kernel_norm(lib, x, weight, eps)


def _kernel_norm(lib: ctypes.CDLL, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    x, weight = x.contiguous(), weight.contiguous()
    y = torch.empty_like(x)
    lib.rms_norm_rows(x.data_ptr(), x.shape[0], x.shape[1], weight.data_ptr(), eps, y.data_ptr())
    return y


def decode_scores(q: torch.Tensor, keys: torch.Tensor, rows: torch.Tensor, blocks_per_seq: int) -> torch.Tensor:
    """``q @ K^T`` for a decode group: ``q`` ``[kv_heads, n, R, head_dim]`` (bfloat16,
    contiguous), the keys of each sequence's block table (``rows``: ``KVStorage.rows``
    of the tables, ``blocks_per_seq`` blocks each) read from ``keys`` (a layer of the
    pool, ``[kv_heads, blocks + 1, block_size, head_dim]``). ``[kv_heads, n, R, L]``.
    The library must be loaded (:func:`native_library`)."""
    kv, n, r, hd = q.shape
    bs = keys.shape[2]
    length = blocks_per_seq * bs
    out = torch.empty((kv, n, r, length), dtype=q.dtype)
    lib = native_library()
    assert lib is not None
    lib.decode_scores(q.data_ptr(), kv, n, r, hd, keys.data_ptr(), rows.data_ptr(), blocks_per_seq, bs,
                      out.data_ptr(), _threads(kv * n * length))
    return out


def decode_values(probs: torch.Tensor, values: torch.Tensor, rows: torch.Tensor, blocks_per_seq: int,
                  chunk: int) -> torch.Tensor:
    """``probs @ V`` for a decode group (as :func:`decode_scores`; ``probs`` ``[kv_heads,
    n, R, L]`` bfloat16, head_dim 64), summed in chunks of ``chunk`` positions."""
    kv, n, r, length = probs.shape
    bs, hd = values.shape[2], values.shape[3]
    out = torch.empty((kv, n, r, hd), dtype=probs.dtype)
    lib = native_library()
    assert lib is not None
    lib.decode_values(probs.data_ptr(), kv, n, r, hd, values.data_ptr(), rows.data_ptr(), blocks_per_seq, bs,
                      chunk, out.data_ptr(), _threads(kv * n * length))
    return out


def _threads(work: int) -> int:
    return torch.get_num_threads() if work >= PARALLEL_WORK else 1
