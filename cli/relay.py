"""``outbox relay`` (the daemon) and ``outbox failed list|retry|purge`` (operator tools)."""

from __future__ import annotations

import enum

import typer
from rich.table import Table

import relay
from cli.context import confirm, error, not_found, out, run, settings_of
from outbox import aio


class Source(enum.StrEnum):
    table = "table"
    wal = "wal"


app = typer.Typer()  # merged into the root: `outbox relay` and `outbox failed ...`
failed_app = typer.Typer(help="Rows Kafka rejected permanently.", no_args_is_help=True)
app.add_typer(failed_app, name="failed")


@app.command("relay")
def relay_command(
    ctx: typer.Context,
    metrics_port: int | None = typer.Option(
        None, "--metrics-port", help="Serve Prometheus /metrics and /healthz on this port."
    ),
    source: Source | None = typer.Option(
        None,
        "--source",
        help="Read events from the outbox table or the WAL (default: OUTBOX_SOURCE).",
    ),
) -> None:
    """Publish outbox events to Kafka until SIGTERM/SIGINT (then exit 0)."""
    settings = settings_of(ctx)
    if source is not None:
        settings = settings.model_copy(update={"source": source.value})
    daemon = relay.Relay(settings, metrics_port=metrics_port)
    run(lambda: aio.run(daemon.serve()))


def _ids(ids: list[int], all_: bool, verb: str) -> list[int] | None:
    if all_ == bool(ids):
        error(f"give the ids to {verb}, or --all")
        raise typer.Exit(2)
    return None if all_ else ids


@failed_app.command("list")
def list_command(
    ctx: typer.Context,
    topic: str | None = typer.Option(None, "--topic", help="Only rows of this topic."),
    limit: int = typer.Option(100, "--limit", min=1),
) -> None:
    """Show failed rows (oldest first) and their last error."""
    settings = settings_of(ctx)
    rows, total = run(lambda: relay.list_failed(settings, topic=topic, limit=limit))
    table = Table("id", "event_id", "topic", "type", "attempts", "bytes", "failed_at", "last_error")
    for r in rows:
        table.add_row(
            str(r.id),
            r.event_id,
            r.topic,
            r.event_type,
            str(r.attempts),
            "tombstone" if r.payload_bytes is None else str(r.payload_bytes),
            r.failed_at.isoformat(timespec="seconds"),
            r.last_error or "",
        )
    out.print(table)
    out.print(f"{total} failed row(s)", highlight=False)


@failed_app.command("retry")
def retry_command(
    ctx: typer.Context,
    ids: list[int] = typer.Argument(None, help="Row ids (from `outbox failed list`)."),
    all_: bool = typer.Option(False, "--all", help="Retry every failed row."),
) -> None:
    """Move failed rows back into the outbox with attempts reset."""
    settings = settings_of(ctx)
    chosen = _ids(ids or [], all_, "retry")
    moved = run(lambda: relay.retry_failed(settings, chosen))
    if moved or chosen is None:
        out.print(f"requeued {len(moved)} row(s)", highlight=False)
    not_found("failed row", sorted(set(chosen or ()) - set(moved)))


@failed_app.command("purge")
def purge_command(
    ctx: typer.Context,
    ids: list[int] = typer.Argument(None, help="Row ids (from `outbox failed list`)."),
    all_: bool = typer.Option(False, "--all", help="Delete every failed row."),
    older_than_hours: float | None = typer.Option(
        None, "--older-than-hours", min=0, help="Only rows that failed longer ago than this."
    ),
    yes: bool = typer.Option(False, "--yes", "-y", help="Do not ask before purging many."),
) -> None:
    """Delete failed rows for good. Purging --all or by age asks first (or needs --yes
    without a terminal)."""
    settings = settings_of(ctx)
    chosen = (
        None
        if older_than_hours is not None and not ids and not all_
        else _ids(ids or [], all_, "purge")
    )
    if chosen is None:
        age = "" if older_than_hours is None else f" older than {older_than_hours:g} hours"
        confirm(f"delete every failed row{age}", yes=yes)
    deleted = run(lambda: relay.purge_failed(settings, chosen, older_than_hours))
    if deleted or chosen is None:
        out.print(f"purged {len(deleted)} row(s)", highlight=False)
    not_found("failed row", sorted(set(chosen or ()) - set(deleted)))
