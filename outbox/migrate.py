"""Programmatic access to the shipped migrations (what ``outbox db`` runs)."""

from __future__ import annotations

import contextlib
import io
import logging
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TextIO

import psycopg
from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from alembic.util import CommandError
from sqlalchemy import Connection, inspect
from sqlalchemy.exc import DBAPIError

from outbox.db import sync_engine, translated_errors
from outbox.errors import ConfigurationError, PrivilegeMissing, SchemaMissing, SchemaOutdated
from outbox.migrations.naming import version_table
from outbox.settings import OutboxSettings
from outbox.tables import build_tables

_SCRIPTS = Path(__file__).parent / "migrations"
log = logging.getLogger("outbox.migrate")


def alembic_config(settings: OutboxSettings | None = None, stdout: TextIO | None = None) -> Config:
    # Offline (--sql) output goes to output_buffer; command messages to stdout.
    config = Config(output_buffer=stdout, stdout=stdout) if stdout is not None else Config()
    config.set_main_option("script_location", str(_SCRIPTS))
    if settings is not None:
        config.attributes["settings"] = settings
    return config


@contextlib.contextmanager
def _revision_errors(revision: str) -> Iterator[None]:
    """Alembic's own errors (an unknown revision, an impossible range) are the caller's
    input, not a crash."""
    try:
        yield
    except CommandError as exc:
        raise ConfigurationError(f"migration to {revision!r}: {exc}") from exc


def upgrade(
    settings: OutboxSettings,
    revision: str = "head",
    progress: Callable[[str], None] | None = None,
) -> None:
    """Create or update the framework's tables (idempotent). ``progress`` is told about
    each revision applied (``applied 0007: Tombstones: ...``)."""
    config = alembic_config(settings)
    if progress is not None:
        config.attributes["progress"] = progress
    with translated_errors(), _revision_errors(revision):
        command.upgrade(config, revision)


def downgrade(settings: OutboxSettings, revision: str) -> None:
    with translated_errors(), _revision_errors(revision):
        command.downgrade(alembic_config(settings), revision)


def sql(settings: OutboxSettings, revision: str = "head") -> str:
    """The DDL of the migrations up to ``revision``, for users who run their own."""
    out = io.StringIO()
    with _revision_errors(revision):
        command.upgrade(alembic_config(settings, stdout=out), revision, sql=True)
    return out.getvalue()


def head() -> str:
    """The newest revision shipped with this version of the package."""
    return str(_scripts().get_current_head())


def _scripts() -> ScriptDirectory:
    return ScriptDirectory.from_config(alembic_config())


def _revision(conn: Connection, settings: OutboxSettings) -> str | None:
    ctx = MigrationContext.configure(
        conn,
        opts={"version_table": version_table(settings), "version_table_schema": settings.db_schema},
    )
    return ctx.get_current_revision()


def current(settings: OutboxSettings) -> str | None:
    """The revision the database is at, or None when the tables were never created."""
    engine = sync_engine(settings, pool_pre_ping=False)
    try:
        with translated_errors(), engine.connect() as conn:
            return _revision(conn, settings)
    finally:
        engine.dispose()


@contextlib.contextmanager
def _privilege_errors() -> Iterator[None]:
    """A role refused the version table is refused the rest too: a configuration error that
    names the grants to run, not an unexpected driver error."""
    try:
        yield
    except DBAPIError as exc:
        if not isinstance(exc.orig, psycopg.errors.InsufficientPrivilege):
            raise
        raise PrivilegeMissing(
            f"{exc.orig.diag.message_primary}: this role needs its job's grants "
            "(`outbox db sql --roles` prints them; make the login user a member of its job's role)",
            exc.orig.sqlstate,
        ) from exc


def check_schema(settings: OutboxSettings) -> str | None:
    """What a daemon runs before it joins anything (a consumer group, the relays' lanes):
    raise :class:`SchemaMissing` unless the database holds the tables this version needs.

    With the framework's version table, its revision must be this package's head; an older
    one is :class:`SchemaOutdated`; one this package does not know was written by a newer
    version during a rollout and is accepted with a WARNING (every migration so far only
    adds tables and indexes). Without it (a team that keeps the tables in its own Alembic
    history, or never migrated) every table :func:`outbox.build_tables` declares must exist.
    Returns the revision (None without the version table). An unreachable database is
    :class:`outbox.errors.DatabaseUnavailable`, for the caller to retry."""
    engine = sync_engine(settings, pool_pre_ping=False, pool_size=1, max_overflow=0)
    try:
        with _privilege_errors(), translated_errors(), engine.connect() as conn:
            revision = _revision(conn, settings)
            present = set() if revision else set(inspect(conn).get_table_names(settings.db_schema))
    finally:
        engine.dispose()
    where = f"schema {settings.db_schema!r}"
    if revision is None:
        tables = sorted(build_tables(settings).metadata.tables.values(), key=lambda t: t.name)
        missing = [t.name for t in tables if t.name not in present]
        if len(missing) == len(tables):
            raise SchemaMissing(f"no outbox tables in {where} (prefix {settings.table_prefix!r})")
        if missing:
            raise SchemaMissing(f"tables missing in {where}: {', '.join(missing)}")
        return None
    newest = head()
    if revision == newest:
        return revision
    try:
        _scripts().get_revision(revision)
    except CommandError:  # not in this package's history: a newer version wrote it
        log.warning(
            "database schema is newer than this version of outbox-inbox: running on",
            extra={"revision": revision, "head": newest},
        )
        return revision
    raise SchemaOutdated(
        f"database {where} at revision {revision}, this version of outbox-inbox needs {newest}"
    )
