"""The shipped migrations produce exactly the tables the code declares."""

from __future__ import annotations

import uuid

import pytest
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext
from sqlalchemy import text

from outbox import build_tables, migrate
from outbox.db import sync_engine
from outbox.errors import SchemaMissing, SchemaOutdated
from outbox.settings import OutboxSettings
from outbox.tables import HOT_TABLE_STORAGE

pytestmark = pytest.mark.integration

RELOPTIONS = """
    SELECT reloptions FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
    WHERE n.nspname = :s AND c.relname = 't_events'
"""


def _other(settings: OutboxSettings, **changes: object) -> OutboxSettings:
    return settings.model_copy(update=changes)


def test_migrations_match_declared_tables(settings: OutboxSettings) -> None:
    schema = f"drift_{uuid.uuid4().hex[:8]}"
    s = _other(settings, db_schema=schema, table_prefix="t_")
    migrate.upgrade(s)
    engine = sync_engine(s)
    try:
        with engine.connect() as conn:
            ctx = MigrationContext.configure(
                conn,
                opts={
                    "include_schemas": True,
                    "include_name": lambda name, type_, parent: type_ != "schema" or name == schema,
                    "include_object": lambda obj, name, type_, reflected, compare_to: (
                        name != "t_alembic_version"
                    ),
                    "compare_server_default": True,
                },
            )
            diff = compare_metadata(ctx, build_tables(s).metadata)
            assert diff == [], f"migrations drifted from outbox.tables: {diff}"
            reloptions = conn.execute(
                text(RELOPTIONS),
                {"s": schema},
            ).scalar_one()
            assert sorted(reloptions) == sorted(f"{k}={v}" for k, v in HOT_TABLE_STORAGE.items())
    finally:
        engine.dispose()


def test_upgrade_is_idempotent_and_current_reports_head(settings: OutboxSettings) -> None:
    migrate.upgrade(settings)
    assert migrate.current(settings) == migrate.head()


def test_downgrade_to_base_and_back(settings: OutboxSettings) -> None:
    s = _other(settings, db_schema=f"down_{uuid.uuid4().hex[:8]}")
    migrate.upgrade(s)
    migrate.downgrade(s, "base")
    assert migrate.current(s) is None
    migrate.upgrade(s)
    assert migrate.current(s) == migrate.head()


def test_check_schema_accepts_head_own_history_and_a_newer_revision_only(
    settings: OutboxSettings, caplog: pytest.LogCaptureFixture
) -> None:
    s = _other(settings, db_schema=f"check_{uuid.uuid4().hex[:8]}")
    with pytest.raises(SchemaMissing, match=r"no outbox tables in schema 'check_\w+'"):
        migrate.check_schema(s)
    migrate.upgrade(s, "0006")
    with pytest.raises(SchemaOutdated, match=r"at revision 0006, this version .* needs"):
        migrate.check_schema(s)
    migrate.upgrade(s)
    assert migrate.check_schema(s) == migrate.head()
    # Written by a newer version mid-rollout: accepted, with a WARNING.
    engine = sync_engine(s)
    version = f'"{s.db_schema}"."{s.table_prefix}alembic_version"'
    with engine.begin() as conn:
        conn.execute(text(f"UPDATE {version} SET version_num = '9999'"))
    caplog.set_level("WARNING", logger="outbox.migrate")
    assert migrate.check_schema(s) == "9999"
    assert [r.getMessage() for r in caplog.records] == [
        "database schema is newer than this version of outbox-inbox: running on"
    ]
    # Without the version table (the tables in a team's own Alembic history): the tables.
    with engine.begin() as conn:
        conn.execute(text(f"DROP TABLE {version}"))
    assert migrate.check_schema(s) is None
    with engine.begin() as conn:
        conn.execute(text(f'DROP TABLE "{s.db_schema}"."{s.table_prefix}effects"'))
    engine.dispose()
    missing = f"tables missing in schema .*: {s.table_prefix}effects;"
    with pytest.raises(SchemaMissing, match=missing):
        migrate.check_schema(s)


def test_offline_sql_names_configured_schema_and_prefix(settings: OutboxSettings) -> None:
    ddl = migrate.sql(_other(settings, db_schema="billing", table_prefix="bx_"))
    assert "CREATE SCHEMA IF NOT EXISTS billing" in ddl
    assert "CREATE TABLE billing.bx_events" in ddl
    assert "bx_events_claim_idx" in ddl
