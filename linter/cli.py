"""``prefixgate lint``: the command-line entry point (parser and exit codes).

Exit codes: 0 when no finding reaches ``--fail-on`` (default ``warning``), 1 when
one does, 2 for usage and configuration errors (bad option, unknown rule code,
invalid pyproject table, missing input or tokenizer). This module imports only
the standard library at parser-building time; the linter itself (and never
torch) is imported inside :func:`run`.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

EXAMPLES = """\
examples:
  prefixgate lint examples/requests.jsonl
  prefixgate lint logs/ src/prompts/ --format sarif > prefixgate.sarif
  prefixgate lint requests.jsonl --tokenizer bundled --cache-blocks 4096 --statistics
  prefixgate lint src/ --select PS3 --ignore PS305 --fail-on error
  prefixgate lint logs/ --extend-select PS104,PS106      # add opt-in hygiene rules
  prefixgate lint logs/ --baseline .prefixgate-baseline.json --update-baseline
  prefixgate lint --explain PS101
  prefixgate lint --list-rules
"""


def add_parser(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "lint",
        help="find what breaks prefix caching in request logs and prompt-building code",
        description=(
            "Lint OpenAI chat-completion request logs (.json/.jsonl) and Python sources (.py) "
            "for what breaks prefix caching, and estimate the cache hit rate now and after each fix."
        ),
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("paths", nargs="*", help="request logs (.json, .jsonl, .ndjson), Python files or directories")
    parser.add_argument("--format", choices=("text", "json", "sarif", "github", "junit"), default="text", help="output format (default: text)")
    parser.add_argument("--output", "-o", metavar="FILE", help="write the report to FILE instead of stdout")
    parser.add_argument("--select", metavar="CODES", help="comma-separated codes or prefixes to enable instead of the default rules (e.g. PS1,PS301; ALL for every rule)")
    parser.add_argument("--extend-select", metavar="CODES", help="comma-separated codes or prefixes to enable in addition (e.g. the opt-in PS104,PS106)")
    parser.add_argument("--ignore", metavar="CODES", help="comma-separated codes or prefixes to disable")
    parser.add_argument("--fail-on", choices=("error", "warning", "info", "never"), help="lowest severity that makes the exit code 1 (default: warning)")
    parser.add_argument("--statistics", action="store_true", help="add a count of findings per rule")
    parser.add_argument("--tokenizer", metavar="PATH|bundled", help="exact tokens: a tokenizer.json, or 'bundled' (default: a fast approximation)")
    parser.add_argument("--block-size", type=int, metavar="N", help="tokens per KV-cache block in the replay (default: 16)")
    parser.add_argument("--cache-blocks", type=int, metavar="N", help="LRU capacity of the replayed cache in blocks (default: unbounded)")
    parser.add_argument("--no-estimate", action="store_true", help="skip the hit-rate replay")
    parser.add_argument("--config", metavar="PYPROJECT", help="read [tool.prefixgate.lint] from this file (default: nearest pyproject.toml)")
    parser.add_argument("--baseline", metavar="FILE", help="hide findings recorded in this baseline file")
    parser.add_argument("--update-baseline", action="store_true", help="write all current findings to --baseline and exit 0")
    parser.add_argument("--db", metavar="SQLITE", help="also report per-tenant hit rates from the gateway's SQLite log")
    parser.add_argument("--color", choices=("auto", "always", "never"), default="auto", help="colour the text format (default: on a terminal)")
    parser.add_argument("--explain", metavar="CODE", help="print a rule's documentation and exit")
    parser.add_argument("--list-rules", action="store_true", help="list every rule and exit")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from linter.command import execute

    try:
        return execute(args)
    except ValueError as exc:
        print(f"prefixgate lint: error: {exc}", file=sys.stderr)
        return 2
