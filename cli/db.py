"""``outbox db``: migrations."""

from __future__ import annotations

from logging import WARNING

import typer

from cli import wal
from cli.context import notice, out, run, settings_of
from outbox import migrate
from outbox.roles import roles_sql
from outbox.sources import source_of

app = typer.Typer(help="Create and inspect the framework's tables.", no_args_is_help=True)


@app.command()
def upgrade(ctx: typer.Context, revision: str = typer.Argument("head")) -> None:
    """Create or update the outbox tables (idempotent); with OUTBOX_SOURCE=wal also the
    WAL source's publication and replication slot (as `outbox wal setup`)."""
    settings = settings_of(ctx)
    notice(f"migrating {settings.safe_database_url} (schema {settings.db_schema})")
    run(lambda: migrate.upgrade(settings, revision, progress=notice))
    at = run(lambda: migrate.current(settings))
    notice(f"at revision {at}", style="green", revision=at)
    if source_of(settings).reads_slot:
        wal.set_up(settings)


@app.command()
def current(ctx: typer.Context) -> None:
    """Print the revision the database is at; exit 1 when behind the package's head."""
    settings = settings_of(ctx)
    rev = run(lambda: migrate.current(settings))
    head = migrate.head()
    out.print(f"current: {rev or 'none'}  head: {head}", highlight=False)
    if rev != head:
        notice("database is behind: run `outbox db upgrade`", style="yellow", level=WARNING)
        raise typer.Exit(1)


@app.command()
def sql(
    ctx: typer.Context,
    revision: str = typer.Argument("head"),
    roles: bool = typer.Option(
        False,
        "--roles",
        help="Print the least-privilege job roles (producer, relay, consumer, operator) "
        "and their grants instead of the DDL.",
    ),
    role_prefix: str | None = typer.Option(
        None, help="Prefix of the role names (default: the table prefix, e.g. outbox_relay)."
    ),
) -> None:
    """Print the DDL (for teams that run their own migrations), or with --roles the job
    roles' script (run it as the tables' owner)."""
    settings = settings_of(ctx)
    if roles:
        script = run(lambda: roles_sql(settings, role_prefix))
    else:
        script = run(lambda: migrate.sql(settings, revision))
    out.print(script, highlight=False, markup=False, soft_wrap=True)
