"""Alembic environment: schema and table prefix come from the OutboxSettings passed in
``config.attributes["settings"]`` by :mod:`outbox.migrate`; nothing reads the environment."""

from __future__ import annotations

from typing import Any

from alembic import context
from alembic.runtime.migration import MigrationContext, MigrationInfo
from sqlalchemy.schema import CreateSchema

from outbox.db import sync_engine
from outbox.migrations.naming import settings_of, version_table
from outbox.settings import OutboxSettings


def _report(ctx: MigrationContext, step: MigrationInfo, heads: Any, run_args: Any) -> None:
    """Tell the caller's ``progress`` (see :func:`outbox.migrate.upgrade`) what was applied."""
    progress = context.config.attributes.get("progress")
    revision = step.up_revision
    if progress is not None and step.is_upgrade and revision is not None:
        title = str(getattr(revision, "doc", "") or "").strip().splitlines()  # a Script
        progress(f"applied {revision.revision}: {title[0] if title else ''}")


def _configure(settings: OutboxSettings, **kwargs: object) -> None:
    context.configure(
        version_table=version_table(settings),
        version_table_schema=settings.db_schema,
        transactional_ddl=True,
        on_version_apply=_report,
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
