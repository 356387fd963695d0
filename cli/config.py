"""``outbox config``: the effective settings and the reference table."""

from __future__ import annotations

import json

import typer

from cli.context import out, settings_of
from outbox.settings_doc import markdown_table

app = typer.Typer(help="Show configuration.", no_args_is_help=True)


@app.command()
def show(ctx: typer.Context) -> None:
    """Print the effective settings as JSON (the database password is masked)."""
    settings = settings_of(ctx)
    data = settings.model_dump(mode="json")
    data["database_url"] = settings.safe_database_url
    out.print_json(json.dumps(data))


@app.command()
def reference() -> None:
    """Print every setting with its environment variable and default (Markdown)."""
    out.print(markdown_table(), markup=False, highlight=False, soft_wrap=True)
