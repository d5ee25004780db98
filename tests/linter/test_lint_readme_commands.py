"""The README's ``prefixgate lint`` commands work as written in a checkout: each one,
run from the repository root, ends with 0 (clean) or 1 (findings), never 2 (a usage
or input error, such as a folder the repository does not have)."""

from __future__ import annotations

import os
import re
import shlex
from pathlib import Path

import pytest

from gateway.cli import main

ROOT = Path(__file__).resolve().parents[2]


def readme_commands(prefix: str) -> list[str]:
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    blocks = re.findall(r"```(?:sh|bash)\n(.*?)```", text, re.S)
    return [line.split("  #", 1)[0].strip() for block in blocks for line in block.splitlines()
            if line.startswith(prefix)]


def test_the_readme_has_lint_commands():
    assert len(readme_commands("prefixgate lint")) >= 3


@pytest.mark.parametrize("command", readme_commands("prefixgate lint"))
def test_a_readme_lint_command_runs_from_the_repository_root(command, tmp_path, monkeypatch, capsys):
    argv = shlex.split(command)[1:]
    if "-o" in argv:  # write the report into tmp_path, not into the checkout
        argv[argv.index("-o") + 1] = str(tmp_path / argv[argv.index("-o") + 1])
    monkeypatch.chdir(ROOT)
    assert main(argv) in (0, 1), capsys.readouterr().err
    if "-o" in argv:
        assert os.path.getsize(argv[argv.index("-o") + 1]) > 0
