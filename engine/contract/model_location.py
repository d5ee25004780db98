"""Where a converted model lives on disk: one answer for the engine that writes it, the
gateway that reads its tokenizer for block keys, and the linter that counts tokens with it.

Only paths, no conversion (that is :mod:`engine.model_store`'s, which imports this): a
directory :func:`converted_model_dir` returns that exists is complete.
"""

from __future__ import annotations

import os
from pathlib import Path

BUNDLED_MODEL_NAME = "SmolLM2-135M-Instruct"
REQUIRED_FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")


def prefixgate_home() -> Path:
    """``$PREFIXGATE_HOME``, or ``~/.cache/prefixgate``."""
    env = os.environ.get("PREFIXGATE_HOME")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "prefixgate"


def converted_model_dir(name: str = BUNDLED_MODEL_NAME) -> Path:
    """Where the safetensors copy of model ``name`` lives (it may not exist yet)."""
    return prefixgate_home() / "models" / name


def is_complete(model_dir: Path) -> bool:
    """True when ``model_dir`` holds every file a converted model needs."""
    return all((model_dir / f).is_file() for f in REQUIRED_FILES)
