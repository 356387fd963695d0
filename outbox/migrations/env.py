"""Alembic environment: schema and table prefix come from the OutboxSettings passed in
``config.attributes["settings"]`` by :mod:`outbox.migrate`; nothing reads the environment."""

from __future__ import annotations

from alembic import context
from sqlalchemy.schema import CreateSchema

from outbox.db import sync_engine
from outbox.migrations.naming import settings_of, version_table
from outbox.settings import OutboxSettings


def _configure(settings: OutboxSettings, **kwargs: object) -> None:
    context.configure(
        version_table=version_table(settings),
        version_table_schema=settings.db_schema,
        transactional_ddl=True,
        **kwargs,  # type: ignore[arg-type]
    )


def run_offline(settings: OutboxSettings) -> None:
    _configure(settings, url=settings.sqlalchemy_url, literal_binds=True, dialect_name="postgresql")
    with context.begin_transaction():
        context.execute(CreateSchema(settings.db_schema, if_not_exists=True))
        context.run_migrations()


def run_online(settings: OutboxSettings) -> None:
    engine = sync_engine(settings, pool_pre_ping=False)
    try:
        with engine.connect() as connection:
            with connection.begin():
                connection.execute(CreateSchema(settings.db_schema, if_not_exists=True))
            _configure(settings, connection=connection)
            with context.begin_transaction():
                context.run_migrations()
    finally:
        engine.dispose()


_settings = settings_of(context.config)
if context.is_offline_mode():
    run_offline(_settings)
else:
    run_online(_settings)
