"""Names shared by the migration scripts: they take schema and prefix from the settings
the migration runs with, so one set of scripts serves every configured deployment."""

from __future__ import annotations

from typing import Any

from alembic.config import Config

from outbox.settings import OutboxSettings


def settings_of(config: Config) -> OutboxSettings:
    settings = config.attributes.get("settings")
    if not isinstance(settings, OutboxSettings):
        raise RuntimeError("outbox migrations run through outbox.migrate, which passes settings")
    return settings


def version_table(settings: OutboxSettings) -> str:
    # Our own version table, so our history never collides with the user's Alembic.
    return f"{settings.table_prefix}alembic_version"


def current(op: Any) -> tuple[str, str]:
    """(schema, table prefix) of the running migration; ``op`` is ``alembic.op``."""
    settings = settings_of(op.get_context().config)
    return settings.db_schema, settings.table_prefix


def qualified(op: Any, schema: str, table: str) -> str:
    """``"schema"."table"`` quoted by the dialect, for the few DDL statements Alembic lacks."""
    prep = op.get_context().dialect.identifier_preparer
    return f"{prep.quote_schema(schema)}.{prep.quote(table)}"
