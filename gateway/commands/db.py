"""``prefixgate db``: manage the stats database schema (Alembic)."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

EPILOG = """examples:
  prefixgate db upgrade                      # ./.prefixgate/prefixgate.db to the newest schema
  prefixgate db downgrade base --data-dir /var/lib/prefixgate
  prefixgate db current --db-url sqlite:///stats.db
"""


def add_parser(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "db", help="upgrade or inspect the stats database schema",
        description="Alembic migrations of the gateway's stats database.",
        epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("action", choices=["upgrade", "downgrade", "current"])
    parser.add_argument("revision", nargs="?", default=None, help="target revision (upgrade: head)")
    parser.add_argument("--data-dir", type=Path, default=None, help="directory of prefixgate.db")
    parser.add_argument("--db-url", default=None, help="SQLAlchemy URL (overrides --data-dir)")
    parser.set_defaults(func=run)


def resolve_db_url(args: argparse.Namespace) -> str:
    from gateway.database import default_db_url
    from gateway.launcher import default_data_dir

    return str(args.db_url or default_db_url(args.data_dir or default_data_dir()))


def run(args: argparse.Namespace) -> int:
    from gateway import database

    url = resolve_db_url(args)
    if args.action == "upgrade":
        database.upgrade(url, args.revision or "head")
    elif args.action == "downgrade":
        if args.revision is None:
            print("prefixgate db downgrade: give a revision (e.g. 'base' or '-1')")
            return 2
        database.downgrade(url, args.revision)
    print(f"{url}: revision {database.current_revision(url) or 'base (empty)'}")
    return 0
