"""`make install` asks pip for the CPU build of torch, on this machine's configured index and
on a plain one: resolved with `pip install --dry-run --report`, nothing from CUDA comes in
(no nvidia-*, no triton). The old unqualified pin on plain PyPI pulls them, which is what
these checks exist to catch."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from pathlib import Path
from urllib.parse import urlparse

import pytest

ROOT = Path(__file__).resolve().parents[1]
PYPI = "https://pypi.org/simple"
CUDA = ("nvidia-", "triton", "cuda-")


def makefile_torch() -> tuple[str, str]:
    """The torch requirement and fallback index that `make install` uses."""
    done = subprocess.run(["make", "-s", "--no-print-directory", "print-torch"], cwd=ROOT, capture_output=True,
                          text=True, timeout=60, check=True)
    requirement, index = done.stdout.split()
    return requirement, index


def resolve(*args: str, tmp_path: Path) -> dict[str, str]:
    """Name -> version of everything `pip install ARGS` would install into an empty environment."""
    report = tmp_path / "report.json"
    done = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--dry-run", "--ignore-installed", "--quiet",
         "--report", str(report), *args],
        cwd=ROOT, capture_output=True, text=True, timeout=900,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return {item["metadata"]["name"].lower(): item["metadata"]["version"]
            for item in json.loads(report.read_text())["install"]}


def reachable(url: str) -> bool:
    host = urlparse(url).hostname or ""
    try:
        socket.getaddrinfo(host, 443)
    except OSError:
        return False
    return True


def cuda_packages(resolved: dict[str, str]) -> list[str]:
    return sorted(name for name in resolved if name.startswith(CUDA))


def test_the_makefile_asks_for_the_cpu_build() -> None:
    requirement, index = makefile_torch()
    assert requirement.startswith("torch==") and requirement.endswith("+cpu")
    assert index.endswith("/cpu")


def test_install_resolves_no_cuda_package_with_the_configured_index(tmp_path) -> None:
    # What `make install` installs here: torch (its first attempt: pip's own configuration),
    # then the project with the engine and test extras, in one resolution.
    requirement, _ = makefile_torch()
    resolved = resolve(requirement, "-e", ".[engine,test]", tmp_path=tmp_path)
    assert resolved["torch"].endswith("+cpu") and "transformers" in resolved
    assert cuda_packages(resolved) == []


def test_install_resolves_no_cuda_package_on_a_plain_index(tmp_path) -> None:
    requirement, index = makefile_torch()
    if not reachable(PYPI):
        pytest.skip("pypi.org cannot be reached from here")
    # The old pin on plain PyPI: the CUDA build and its nvidia-* wheels (this check can fail).
    old = resolve("--isolated", "--index-url", PYPI, requirement.split("+")[0], tmp_path=tmp_path)
    assert cuda_packages(old), old
    if not reachable(index):
        pytest.skip(f"{index} cannot be reached from here (this machine's pip has its own mirror)")
    # `make install`'s fallback on a machine whose pip knows only PyPI.
    new = resolve("--isolated", "--index-url", PYPI, "--extra-index-url", index, requirement, tmp_path=tmp_path)
    assert new["torch"].endswith("+cpu") and cuda_packages(new) == []
