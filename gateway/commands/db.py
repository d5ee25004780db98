"""``prefixgate db``: manage the stats database schema (Alembic)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from sqlalchemy import Engine

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
    from gateway.server.launcher import default_data_dir
    from gateway.stats.database import default_db_url

    return str(args.db_url or default_db_url(args.data_dir or default_data_dir()))


def existing_sqlite_file(url: str) -> None:
    """``ValueError`` (one line) when ``url`` names a SQLite file that does not exist."""
    from sqlalchemy.engine import make_url

    parsed = make_url(url)
    if parsed.get_backend_name() == "sqlite" and parsed.database not in (None, "", ":memory:"):
        path = Path(str(parsed.database))
        if not path.is_file():
            raise ValueError(f"no stats database at {path} (check --data-dir / --db-url; the gateway creates it)")


def open_existing(url: str) -> Engine:
    """A read-only SQLAlchemy engine on an existing stats database (never creates one).

    ``ValueError`` (one line) when the SQLite file does not exist or holds no
    ``request_log`` table; other backends are opened as they are.
    """
    from sqlalchemy import create_engine, inspect
    from sqlalchemy.engine import make_url
    from sqlalchemy.exc import SQLAlchemyError

    existing_sqlite_file(url)
    parsed = make_url(url)
    if parsed.get_backend_name() == "sqlite" and parsed.database not in (None, "", ":memory:"):
        url = f"sqlite:///file:{Path(str(parsed.database)).resolve()}?mode=ro&uri=true"
    engine = create_engine(url)
    try:
        found = inspect(engine).has_table("request_log")
    except SQLAlchemyError as exc:
        engine.dispose()
        detail = str(getattr(exc, "orig", None) or exc).splitlines()[0]
        raise ValueError(f"cannot read the stats database {parsed!r}: {detail}") from None
    if not found:
        engine.dispose()
        raise ValueError(f"{parsed!r} is not a prefixgate stats database (no request_log table; "
                         f"'prefixgate db upgrade' creates one)")
    return engine


def run(args: argparse.Namespace) -> int:
    from alembic.util.exc import CommandError

    from gateway.stats import database

    url = resolve_db_url(args)
    try:
        if args.action == "downgrade" and args.revision is None:
            raise ValueError("give a revision to downgrade to (e.g. 'base' or '-1')")
        if args.action != "upgrade":  # only an upgrade may create the database
            existing_sqlite_file(url)
        if args.action == "upgrade":
            database.upgrade(url, args.revision or "head")
        elif args.action == "downgrade":
            database.downgrade(url, args.revision)
    except (ValueError, CommandError) as exc:  # CommandError: an unknown revision
        print(f"prefixgate db {args.action}: error: {str(exc).splitlines()[0]}", file=sys.stderr)
        return 2
    print(f"{url}: revision {database.current_revision(url) or 'base (empty)'}")
    return 0
