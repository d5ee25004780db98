"""The ``prefixgate`` command: one subcommand per module, imported lazily.

Each subcommand module exposes ``add_parser(subparsers) -> None``, which registers
its parser and sets ``func`` (``Callable[[argparse.Namespace], int]``) as a default.
Modules are imported only to build their parser, so ``prefixgate lint`` never
imports torch: a module must keep heavy imports inside its ``func``.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

# Subcommand modules, in the order --help lists them.
SUBCOMMAND_MODULES: tuple[str, ...] = (
    "engine.cli",
    "linter.cli",
    "gateway.commands.gateway",
    "gateway.commands.serve",
    "gateway.commands.keys",
    "gateway.commands.db",
    "gateway.commands.stats",
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="prefixgate",
        description="Prompt-caching gateway, local engine and prefix-cache linter.",
        epilog="Run 'prefixgate COMMAND --help' for a command's options and an example.",
    )
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in SUBCOMMAND_MODULES:
        importlib.import_module(name).add_parser(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run one subcommand; returns its exit code (2 for a usage error)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    func = getattr(args, "func", None)
    if func is None:
        parser.print_help(sys.stderr)
        return 2
    return int(func(args))


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
