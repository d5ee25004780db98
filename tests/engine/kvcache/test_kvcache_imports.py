"""engine.kvcache and engine are pure Python: importing them imports no torch.

Checked in a fresh interpreter, since this test session has imported torch already.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

HEAVY = ("torch", "transformers", "numpy", "starlette")


@pytest.mark.parametrize("module", ["engine", "engine.kvcache", "engine.model_store", "engine.config"])
def test_import_pulls_in_no_torch(module: str) -> None:
    code = f"import sys, {module}; print(sorted(m for m in {HEAVY!r} if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr


def test_kvcache_modules_import_nothing_outside_kvcache() -> None:
    code = (
        "import sys, engine.kvcache;"
        "print(sorted(m for m in sys.modules if m.startswith('engine.') and not m.startswith('engine.kvcache')))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr
