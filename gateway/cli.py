"""The ``prefixgate`` command: one subcommand per module, imported lazily.

Each subcommand module exposes ``add_parser(subparsers) -> None``, which registers
its parser and sets ``func`` (``Callable[[argparse.Namespace], int]``) as a default.
Modules are imported only to build their parser, so ``prefixgate lint`` never
imports torch: a module must keep heavy imports inside its ``func``.

Manners (every command): a usage mistake is one line on stderr and exit 2, never
a traceback; a reader that closes the pipe early (``prefixgate stats | head``)
ends the command quietly; Ctrl-C exits 130 without a traceback.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from collections.abc import Sequence
from typing import NoReturn

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


class OneLineParser(argparse.ArgumentParser):
    """An argparse parser whose usage errors are one line (subparsers inherit the class)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see '{self.prog} --help')\n")


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(
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
    try:
        code = int(func(args))
        sys.stdout.flush()  # a closed pipe shows up here, inside the handler below
        return code
    except BrokenPipeError:
        # The reader left (``| head``): point stdout at /dev/null so the interpreter's
        # final flush does not fail again, and exit quietly.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
