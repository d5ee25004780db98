"""Running ``prefixgate lint`` in-process for tests, isolated from any pyproject configuration."""

from __future__ import annotations

import argparse
from pathlib import Path

from linter import cli

ROOT = Path(__file__).resolve().parents[2]


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="prefixgate")
    cli.add_parser(parser.add_subparsers(dest="command"))
    return parser.parse_args(["lint", *argv])


def run_lint(argv: list[str], config: Path | None) -> int:
    """Exit code of ``prefixgate lint ARGV``; ``config`` isolates the run from the repo's pyproject."""
    extra = ["--config", str(config)] if config is not None else []
    args = parse([*argv, *extra])
    return int(args.func(args))
