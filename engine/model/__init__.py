"""Torch execution of forwards: loading a model, its forward, attention, KV storage, the runner.

Nothing here decides which requests run: :mod:`engine.core` does, and hands the
runner plain token ids, positions and block tables.

The one process-wide setting this package makes, on import and unless the
environment already sets it: oneDNN's primitive cache holds
:data:`PRIMITIVE_CACHE_CAPACITY` kernels (its default, 1,024, is too few here).
oneDNN compiles a kernel per operand shape, and a compressed request's steps use
thousands of shapes (its layers' kept lengths, the rows a layer-wise chunk keeps):
with the default, kernels were evicted and compiled again every step. Measured
(bundled model, 16 streams of 2k-token prompts, ``kv_compression=pyramid``
layer-wise, four batches one after another in one engine): 61, 53, 51, 51 output
tokens/s with the default, 70, 74, 71, 73 with 65,536; prefill steps 448-550 ms
against 300-366 ms. oneDNN reads the variable once, at its first kernel: a process
that ran oneDNN work before importing this package keeps the default.
"""

import os

PRIMITIVE_CACHE_CAPACITY = 65536
os.environ.setdefault("ONEDNN_PRIMITIVE_CACHE_CAPACITY", str(PRIMITIVE_CACHE_CAPACITY))
