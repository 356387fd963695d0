"""``outbox db``: migrations."""

from __future__ import annotations

import typer

from cli.context import console, out, run, settings_of
from outbox import migrate

app = typer.Typer(help="Create and inspect the framework's tables.", no_args_is_help=True)


@app.command()
def upgrade(ctx: typer.Context, revision: str = typer.Argument("head")) -> None:
    """Create or update the outbox tables (idempotent)."""
    settings = settings_of(ctx)
    console.print(f"migrating {settings.safe_database_url} (schema {settings.db_schema})")
    run(lambda: migrate.upgrade(settings, revision))
    console.print(f"[green]at revision {run(lambda: migrate.current(settings))}[/]")


@app.command()
def current(ctx: typer.Context) -> None:
    """Print the revision the database is at; exit 1 when behind the package's head."""
    settings = settings_of(ctx)
    rev = run(lambda: migrate.current(settings))
    head = migrate.head()
    out.print(f"current: {rev or 'none'}  head: {head}", highlight=False)
    if rev != head:
        console.print("[yellow]database is behind: run `outbox db upgrade`[/]")
        raise typer.Exit(1)


@app.command()
def sql(ctx: typer.Context, revision: str = typer.Argument("head")) -> None:
    """Print the DDL (for teams that run their own migrations)."""
    settings = settings_of(ctx)
    out.print(migrate.sql(settings, revision), highlight=False, markup=False)
