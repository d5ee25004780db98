"""Alembic environment for the gateway's stats database (``request_log``)."""

from __future__ import annotations

from alembic import context

import gateway.responses.store  # noqa: F401  (registers stored_response in the metadata)
from gateway.stats.database import create_db_engine
from gateway.stats.table import metadata

config = context.config
if config.config_file_name is not None and config.attributes.get("configure_logger", True):
    from logging.config import fileConfig

    fileConfig(config.config_file_name, disable_existing_loggers=False)


def _url() -> str:
    override = context.get_x_argument(as_dictionary=True).get("db_url")
    return str(override or config.get_main_option("sqlalchemy.url"))


def run_offline() -> None:
    context.configure(url=_url(), target_metadata=metadata, render_as_batch=True, literal_binds=True)
    with context.begin_transaction():
        context.run_migrations()


def run_online() -> None:
    engine = create_db_engine(_url())
    try:
        with engine.connect() as connection:
            context.configure(connection=connection, target_metadata=metadata, render_as_batch=True)
            with context.begin_transaction():
                context.run_migrations()
    finally:
        engine.dispose()


if context.is_offline_mode():
    run_offline()
else:
    run_online()
