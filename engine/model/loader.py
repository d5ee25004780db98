"""Load a causal LM and its tokenizer from the bundled model, a checkpoint dir or a GGUF file.

A checkpoint directory whose ``config.json`` names a supported vision-language
architecture (:mod:`engine.multimodal.vlm`) is loaded with its processor instead;
the tokenizer is then the processor's.

Never touches a model hub: every path is local, and loading runs with
``local_files_only``. GGUF files are converted once to safetensors by
:mod:`engine.model_store` and the converted copy is loaded.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from engine.config import EngineConfig
from engine.model.native import cpu_flags
from engine.model_store import BUNDLED_MODEL_NAME, ensure_converted_model

logger = logging.getLogger(__name__)


@dataclass
class LoadedModel:
    model: Any
    tokenizer: Any
    model_id: str
    path: Path
    processor: Any = None
    """The checkpoint's processor for a vision-language model, else None."""


def cpu_has_native_bf16() -> bool:
    """True when the CPU has bfloat16 arithmetic (AVX-512 BF16 or AMX)."""
    return not cpu_flags().isdisjoint({"avx512_bf16", "amx_bf16"})


def resolve_dtype(name: str) -> torch.dtype:
    """``"auto"`` is bfloat16 where the CPU has native bf16, float32 otherwise."""
    if name == "auto":
        return torch.bfloat16 if cpu_has_native_bf16() else torch.float32
    if name == "float32":
        return torch.float32
    if name == "bfloat16":
        return torch.bfloat16
    raise ValueError(f"dtype must be auto, float32 or bfloat16, got {name!r}")


def resolve_model_path(model: str | None) -> tuple[Path, str]:
    """The checkpoint directory to load and the default served name."""
    if model is None:
        return ensure_converted_model(), BUNDLED_MODEL_NAME
    path = Path(model).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return ensure_converted_model(path), path.stem
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ValueError(f"model directory {str(path)!r} has no config.json")
        return path, path.name
    raise ValueError(f"model must be a local checkpoint directory or .gguf file, got {model!r}")


def load_model(config: EngineConfig) -> LoadedModel:
    """Load the model in the configured dtype, in eval mode, with SDPA attention."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path, default_name = resolve_model_path(config.model)
    dtype = resolve_dtype(config.dtype)
    logger.info("loading %s (%s)", path, str(dtype).removeprefix("torch."))
    from engine.multimodal.vlm import load_vlm, vlm_architecture

    arch = vlm_architecture(path)
    if arch is not None:
        model, processor = load_vlm(path, arch, dtype)
        name = config.served_model_name or default_name
        return LoadedModel(model, processor.tokenizer, name, path, processor)
    tokenizer = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(
        str(path), dtype=dtype, local_files_only=True, attn_implementation="sdpa"
    )
    model.eval()
    return LoadedModel(model, tokenizer, config.served_model_name or default_name, path)
