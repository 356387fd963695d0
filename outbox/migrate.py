"""Programmatic access to the shipped migrations (what ``outbox db`` runs)."""

from __future__ import annotations

import contextlib
import io
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TextIO

from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from alembic.util import CommandError

from outbox.db import sync_engine, translated_errors
from outbox.errors import ConfigurationError
from outbox.migrations.naming import version_table
from outbox.settings import OutboxSettings

_SCRIPTS = Path(__file__).parent / "migrations"


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
    return str(ScriptDirectory.from_config(alembic_config()).get_current_head())


def current(settings: OutboxSettings) -> str | None:
    """The revision the database is at, or None when the tables were never created."""
    engine = sync_engine(settings, pool_pre_ping=False)
    try:
        with translated_errors(), engine.connect() as conn:
            ctx = MigrationContext.configure(
                conn,
                opts={
                    "version_table": version_table(settings),
                    "version_table_schema": settings.db_schema,
                },
            )
            return ctx.get_current_revision()
    finally:
        engine.dispose()
