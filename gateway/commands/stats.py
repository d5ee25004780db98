"""``prefixgate stats``: prefix-cache hit rates per tenant, model and hour."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

EPILOG = """examples:
  prefixgate stats
  prefixgate stats --data-dir /var/lib/prefixgate --since 2026-11-22T00:00 --format json
  prefixgate stats --by replica     # hits per replica, predicted vs reported cached tokens
"""


def add_parser(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "stats", help="print prefix-cache hit rates per tenant, model and hour",
        description="Hit rate = cached / prompt tokens, over requests whose upstream reported cached tokens. "
        "Reads the database read-only and never creates one.",
        epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--data-dir", type=Path, default=None, help="directory of prefixgate.db")
    parser.add_argument("--db-url", default=None, help="SQLAlchemy URL (overrides --data-dir)")
    parser.add_argument("--since", default=None, help="only rows at or after this UTC time (ISO 8601)")
    parser.add_argument("--format", choices=["text", "json"], default="text")
    parser.add_argument("--by", choices=["tenant", "replica"], default="tenant",
                        help="group per tenant, model and hour (default), or per replica")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from datetime import datetime

    import orjson

    from gateway.commands.db import open_existing, resolve_db_url
    from gateway.stats.report import format_table, per_tenant_model_hour

    since = None
    if args.since is not None:
        try:
            since = datetime.fromisoformat(args.since).replace(tzinfo=None)
        except ValueError:
            return _fail(f"--since: not an ISO 8601 time: {args.since!r}")
    try:
        engine = open_existing(resolve_db_url(args))
    except ValueError as exc:
        return _fail(str(exc))
    try:
        if args.by == "replica":
            return _print_replicas(engine, since, args.format)
        groups = per_tenant_model_hour(engine, since)
    finally:
        engine.dispose()
    if args.format == "json":
        rows = [
            {"tenant": tenant, "model": model, "hour": hour, **stats.to_dict()}
            for (tenant, model, hour), stats in groups.items()
        ]
        print(orjson.dumps(rows, option=orjson.OPT_INDENT_2).decode())
    elif not groups:
        print("no requests recorded yet")
    else:
        print(format_table(groups))
    return 0


def _fail(message: str) -> int:
    print(f"prefixgate stats: error: {message}", file=sys.stderr)
    return 2


def _print_replicas(engine: Any, since: Any, output: str) -> int:
    import orjson

    from gateway.stats.report import format_replica_table, per_replica

    groups = per_replica(engine, since)
    if output == "json":
        print(orjson.dumps([{"replica": name, **stats.to_dict()} for name, stats in groups.items()],
                           option=orjson.OPT_INDENT_2).decode())
    elif not groups:
        print("no requests recorded yet")
    else:
        print(format_replica_table(groups))
    return 0
