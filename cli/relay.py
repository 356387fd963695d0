"""``outbox relay`` (the daemon) and ``outbox failed list|retry|purge`` (operator tools)."""

from __future__ import annotations

import contextlib
import enum

import typer

import relay
from cli.context import confirm, not_found, out, print_results, run, settings_of, table, usage
from cli.params import DURATION, duration, renamed, shown
from outbox import aio, migrate
from outbox.errors import DatabaseUnavailable
from outbox.settings import OutboxSettings
from outbox.sources import SOURCES
from outbox.wording import counted

# The values of --source: the sources of the registry (outbox/sources.py).
Source = enum.StrEnum("Source", {name: name for name in SOURCES})  # type: ignore[misc]


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
    run(lambda: _schema_ready(settings.for_relay()))
    daemon = relay.Relay(settings, metrics_port=metrics_port)
    run(lambda: aio.run_daemon(daemon.serve()))


def _schema_ready(settings: OutboxSettings) -> None:
    """Tables missing or behind this version: exit 2 before taking lanes. A database that
    does not answer yet is the relay's to wait for (its loops retry, and meet a missing
    table as the same error)."""
    with contextlib.suppress(DatabaseUnavailable):
        migrate.check_schema(settings)


def _ids(ids: list[int], all_: bool, verb: str) -> list[int] | None:
    if all_ == bool(ids):
        usage(f"give the ids to {verb}, or --all")
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
    listed = table(
        "id", "event_id", "topic", "type", "attempts", "bytes", "failed_at", "last_error"
    )
    for r in rows:
        listed.add_row(
            str(r.id),
            r.event_id,
            r.topic,
            r.event_type,
            str(r.attempts),
            "tombstone" if r.payload_bytes is None else str(r.payload_bytes),
            r.failed_at.isoformat(timespec="seconds"),
            r.last_error or "",
        )
    print_results(listed)
    out.print(counted(total, "failed row"), highlight=False)


@failed_app.command("retry")
def retry_command(
    ctx: typer.Context,
    ids: list[int] = typer.Argument(None, help="Row ids (from `outbox failed list`)."),
    all_: bool = typer.Option(False, "--all", help="Retry every failed row."),
) -> None:
    """Move failed rows back into the outbox, attempts reset: the same event id (consumers
    still deduplicate it) in a new outbox row, after newer events of its key."""
    settings = settings_of(ctx)
    chosen = _ids(ids or [], all_, "retry")
    moved = run(lambda: relay.retry_failed(settings, chosen))
    if moved or chosen is None:
        out.print(f"requeued {counted(len(moved), 'row')}", highlight=False)
    not_found("failed row", sorted(set(chosen or ()) - set(moved)))


@failed_app.command("purge")
def purge_command(
    ctx: typer.Context,
    ids: list[int] = typer.Argument(None, help="Row ids (from `outbox failed list`)."),
    all_: bool = typer.Option(False, "--all", help="Delete every failed row."),
    older_than: float | None = typer.Option(
        None,
        "--older-than",
        parser=duration(),
        metavar=DURATION,
        help="Only rows that failed longer ago than this (90s, 30m, 12h, 30d).",
    ),
    older_than_hours: float | None = typer.Option(None, "--older-than-hours", min=0, hidden=True),
    yes: bool = typer.Option(False, "--yes", "-y", help="Do not ask before purging many."),
) -> None:
    """Delete failed rows for good. Purging --all or by age asks first (or needs --yes
    without a terminal)."""
    settings = settings_of(ctx)
    older = renamed(
        older_than, older_than_hours, old="--older-than-hours", new="--older-than", unit=3600
    )
    chosen = None if older is not None and not ids and not all_ else _ids(ids or [], all_, "purge")
    if chosen is None:
        age = "" if older is None else f" older than {shown(older)}"
        confirm(f"delete every failed row{age}", yes=yes)
    hours = None if older is None else older / 3600
    deleted = run(lambda: relay.purge_failed(settings, chosen, hours))
    if deleted or chosen is None:
        out.print(f"purged {counted(len(deleted), 'row')}", highlight=False)
    not_found("failed row", sorted(set(chosen or ()) - set(deleted)))
