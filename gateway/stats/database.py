"""The stats database: SQLAlchemy engine setup and Alembic migrations.

SQLite databases run in WAL mode (readers never block the writer) with
``synchronous=NORMAL`` and a 10 s busy timeout, so several gateway worker processes
can each write their own short batches to one file (SQLite serializes them). A new
database file is created 0600, and SQLite gives its ``-wal`` and ``-shm`` files the
same mode. The schema is owned by Alembic (top-level ``migrations/``, package data that
the wheel carries; ``PREFIXGATE_MIGRATIONS`` overrides the location).
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import Any

from sqlalchemy import Engine, create_engine, event
from sqlalchemy.engine import make_url

MIGRATIONS_ENV = "PREFIXGATE_MIGRATIONS"


def default_db_url(data_dir: Path) -> str:
    return f"sqlite:///{(data_dir / 'prefixgate.db').resolve()}"


def _enable_wal(dbapi_connection: Any, _record: Any) -> None:
    cursor = dbapi_connection.cursor()
    cursor.execute("PRAGMA busy_timeout=10000")  # first: the next pragma may wait for another process
    cursor.execute("PRAGMA journal_mode=WAL")
    cursor.execute("PRAGMA synchronous=NORMAL")
    cursor.close()


def _create_private(path: Path) -> None:
    """Create the SQLite file 0600 (and its directory 0700) if missing, before SQLite
    does: SQLite gives ``-wal`` and ``-shm`` the database file's mode, so all three
    stay owner-only. An existing file keeps its mode."""
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    with contextlib.suppress(FileExistsError):
        os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))


def create_db_engine(url: str) -> Engine:
    """An engine for ``url``; SQLite files get WAL mode and are created owner-only."""
    parsed = make_url(url)
    if parsed.get_backend_name() == "sqlite":
        if parsed.database and parsed.database != ":memory:":
            _create_private(Path(parsed.database))
        engine = create_engine(url, connect_args={"check_same_thread": False})
        event.listen(engine, "connect", _enable_wal)
        return engine
    return create_engine(url, pool_pre_ping=True)


def migrations_dir() -> Path:
    """``$PREFIXGATE_MIGRATIONS``; else ``gateway/migrations/`` of an installed wheel; else the
    source tree's top-level ``migrations/`` (which the wheel maps to that place)."""
    override = os.environ.get(MIGRATIONS_ENV)
    gateway_dir = Path(__file__).resolve().parents[1]
    if override:
        path = Path(override)
    else:
        installed, source = gateway_dir / "migrations", gateway_dir.parent / "migrations"
        path = installed if (installed / "env.py").is_file() else source
    if not (path / "env.py").is_file():
        raise RuntimeError(
            f"Alembic migrations not found at {path}: reinstall prefixgate "
            f"(the wheel carries them) or set {MIGRATIONS_ENV}"
        )
    return path


def alembic_config(url: str) -> Any:
    from alembic.config import Config

    config = Config()
    config.set_main_option("script_location", str(migrations_dir()))
    config.set_main_option("sqlalchemy.url", url.replace("%", "%%"))
    return config


def upgrade(url: str, revision: str = "head") -> None:
    from alembic import command

    command.upgrade(alembic_config(url), revision)


def downgrade(url: str, revision: str) -> None:
    from alembic import command

    command.downgrade(alembic_config(url), revision)


def current_revision(url: str) -> str | None:
    from alembic.runtime.migration import MigrationContext

    engine = create_db_engine(url)
    try:
        with engine.connect() as connection:
            return MigrationContext.configure(connection).get_current_revision()
    finally:
        engine.dispose()
