"""``outbox dlq``: list, inspect, replay and purge dead letters."""

from __future__ import annotations

import asyncio
import datetime as dt
from collections.abc import Awaitable, Callable
from typing import TypeVar

import typer
from rich.console import Console
from rich.table import Table

from cli.context import confirm, error, not_found, notice, out, run, settings_of
from inbox import DeadLetterFilter, DeadLetters
from outbox.settings import OutboxSettings

app = typer.Typer(help="Inspect and replay dead-lettered events.", no_args_is_help=True)
T = TypeVar("T")


def _with(settings: OutboxSettings, action: Callable[[DeadLetters], Awaitable[T]]) -> T:
    async def go() -> T:
        letters = DeadLetters(settings)
        try:
            return await action(letters)
        finally:
            await letters.close()

    return run(lambda: asyncio.run(go()))


def _filter(
    consumer: str | None,
    event_id: str | None,
    topic: str | None,
    event_type: str | None,
    error_class: str | None,
    older_than_hours: float | None,
) -> DeadLetterFilter:
    before = None
    if older_than_hours is not None:
        before = dt.datetime.now(dt.UTC) - dt.timedelta(hours=older_than_hours)
    return DeadLetterFilter(consumer, event_id, topic, event_type, error_class, before)


_CONSUMER = typer.Option(None, "--consumer", "-c", help="Consumer name.")
_TOPIC = typer.Option(None, "--topic", help="Original topic.")
_TYPE = typer.Option(None, "--type", help="CloudEvents type.")
_ERROR = typer.Option(None, "--error-class", help="Error class, e.g. ValidationError.")
_OLDER = typer.Option(
    None, "--older-than-hours", min=0, help="Dead-lettered before this many hours ago."
)
_SELECT = "give an EVENT_ID, a filter, or --all"


@app.command("list")
def list_(
    ctx: typer.Context,
    consumer: str | None = _CONSUMER,
    topic: str | None = _TOPIC,
    event_type: str | None = _TYPE,
    error_class: str | None = _ERROR,
    older_than_hours: float | None = _OLDER,
    limit: int = typer.Option(100, "--limit", min=1, help="At most this many."),
) -> None:
    """List dead letters (oldest first) with their state: dead, replaying or processed."""
    where = _filter(consumer, None, topic, event_type, error_class, older_than_hours)
    letters = _with(settings_of(ctx), lambda d: d.list(where, limit))
    table = Table("consumer", "event_id", "type", "origin", "error", "attempts", "state", "at")
    for x in letters:
        table.add_row(
            x.consumer,
            x.event_id,
            x.event_type or "-",
            f"{x.topic}[{x.partition}]@{x.offset}",
            x.error_class,
            str(x.attempts),
            x.inbox_status or "forgotten",
            x.dead_lettered_at.isoformat(timespec="seconds"),
        )
    # Piped output (grep, scripts) must not be cut to 80 columns with ellipses.
    (out if out.is_terminal else Console(width=1_000)).print(table)
    notice(f"{len(letters)} dead letters", count=len(letters))


@app.command()
def show(
    ctx: typer.Context,
    event_id: str = typer.Argument(...),
    consumer: str = typer.Option(..., "--consumer", "-c", help="Consumer name."),
) -> None:
    """Show one dead letter: error, origin, headers (the payload only as its size)."""
    x = _with(settings_of(ctx), lambda d: d.get(consumer, event_id))
    for label, value in (
        ("consumer", x.consumer),
        ("event_id", x.event_id),
        ("type", x.event_type),
        ("origin", f"{x.topic} partition {x.partition} offset {x.offset}"),
        ("dead-letter topic", f"{x.dlq_topic} partition {x.dlq_partition} offset {x.dlq_offset}"),
        ("error", f"{x.error_class}: {x.error_message}"),
        ("attempts", x.attempts),
        ("dead-lettered at", x.dead_lettered_at.isoformat()),
        ("state", x.inbox_status or "forgotten (inbox row expired)"),
        ("replays", f"{x.replays} (last {x.replayed_at.isoformat() if x.replayed_at else '-'})"),
        ("key", repr(x.key)),
        ("value", "null (a tombstone)" if x.value is None else f"{len(x.value)} bytes"),
    ):
        out.print(f"[bold]{label}:[/] {value}", highlight=False)
    for name, raw in x.headers:
        out.print(f"  header {name} = {raw.decode('utf-8', 'replace')}", highlight=False)


@app.command()
def replay(
    ctx: typer.Context,
    event_id: str | None = typer.Argument(None, help="One event; omit to use filters."),
    consumer: str | None = _CONSUMER,
    topic: str | None = _TOPIC,
    event_type: str | None = _TYPE,
    error_class: str | None = _ERROR,
    all_: bool = typer.Option(False, "--all", help="Replay every dead letter (matching filters)."),
) -> None:
    """Re-deliver dead letters to their source topic; the handler runs once more."""
    if event_id is None and not all_ and not any((consumer, topic, event_type, error_class)):
        error(_SELECT)
        raise typer.Exit(2)
    where = _filter(consumer, event_id, topic, event_type, error_class, None)
    report = _with(settings_of(ctx), lambda d: d.replay(where))
    for x in report.refused:
        notice(
            f"refused {x.consumer} {x.event_id}: already processed",
            style="yellow",
            consumer=x.consumer,
            event_id=x.event_id,
        )
    if event_id is not None and not report.replayed and not report.refused:
        not_found("dead letter", [event_id])
    notice(
        f"replayed {len(report.replayed)}, refused {len(report.refused)}",
        replayed=len(report.replayed),
        refused=len(report.refused),
    )
    if event_id is not None and not report.replayed:
        raise typer.Exit(1)


@app.command()
def purge(
    ctx: typer.Context,
    event_id: str | None = typer.Argument(None),
    consumer: str | None = _CONSUMER,
    topic: str | None = _TOPIC,
    error_class: str | None = _ERROR,
    older_than_hours: float | None = _OLDER,
    all_: bool = typer.Option(False, "--all", help="Purge every dead letter (matching filters)."),
    yes: bool = typer.Option(False, "--yes", "-y", help="Do not ask before purging many."),
) -> None:
    """Delete dead-letter records (the inbox still remembers the event as dead-lettered).

    Purging by filter or --all asks first (or needs --yes without a terminal)."""
    filtered = any((consumer, topic, error_class, older_than_hours is not None))
    if event_id is None and not all_ and not filtered:
        error(_SELECT)
        raise typer.Exit(2)
    settings = settings_of(ctx)
    if event_id is None:
        scope = " matching the filters" if filtered else ""
        confirm(f"purge every dead letter{scope}", yes=yes)
    where = _filter(consumer, event_id, topic, None, error_class, older_than_hours)
    n = _with(settings, lambda d: d.purge(where))
    if event_id is not None and not n:
        not_found("dead letter", [event_id])
    notice(f"purged {n} dead letters", purged=n)
