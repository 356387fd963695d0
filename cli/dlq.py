"""``outbox dlq``: list, inspect, replay and purge dead letters.

``-c/--consumer`` narrows every command to one consumer; ``show`` needs it only when the
event is a dead letter of several. An EVENT_ID may be given by a unique prefix (``0a4f``).
"""

from __future__ import annotations

import asyncio
import datetime as dt
from collections.abc import Awaitable, Callable
from typing import TypeVar

import typer
from rich.markup import escape

from cli.context import confirm, notice, out, print_results, run, settings_of, table, usage
from cli.params import DURATION, duration, renamed
from inbox import DeadLetter, DeadLetterFilter, DeadLetters, ReplayReport
from outbox.ops.deadletters import DEAD_LETTER_STATES
from outbox.scrub import scrub
from outbox.settings import OutboxSettings
from outbox.text import printable
from outbox.wording import counted

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
    older_than: float | None,
) -> DeadLetterFilter:
    before = None
    if older_than is not None:
        before = dt.datetime.now(dt.UTC) - dt.timedelta(seconds=older_than)
    return DeadLetterFilter(consumer, event_id, topic, event_type, error_class, before)


def _older(older_than: float | None, older_than_hours: float | None) -> float | None:
    return renamed(
        older_than, older_than_hours, old="--older-than-hours", new="--older-than", unit=3600
    )


_CONSUMER = typer.Option(None, "--consumer", "-c", help="Only this consumer's dead letters.")
_EVENT_ID = "The event id, or a prefix of it only one dead letter's id starts with (e.g. 0a4f)."
_TOPIC = typer.Option(None, "--topic", help="Original topic.")
_TYPE = typer.Option(None, "--type", help="CloudEvents type.")
_ERROR = typer.Option(None, "--error-class", help="Error class, e.g. ValidationError.")
_OLDER = typer.Option(
    None,
    "--older-than",
    parser=duration(),
    metavar=DURATION,
    help="Dead-lettered longer ago than this (90s, 30m, 12h, 30d).",
)
_OLDER_HOURS = typer.Option(None, "--older-than-hours", min=0, hidden=True)  # deprecated
_SELECT = "give an EVENT_ID, a filter, or --all"


@app.command("list")
def list_(
    ctx: typer.Context,
    consumer: str | None = _CONSUMER,
    topic: str | None = _TOPIC,
    event_type: str | None = _TYPE,
    error_class: str | None = _ERROR,
    older_than: float | None = _OLDER,
    older_than_hours: float | None = _OLDER_HOURS,
    limit: int = typer.Option(100, "--limit", min=1, help="At most this many."),
) -> None:
    """List dead letters (oldest first) with their state: dead, replaying, processed or
    forgotten."""
    older = _older(older_than, older_than_hours)
    where = _filter(consumer, None, topic, event_type, error_class, older)
    letters = _with(settings_of(ctx), lambda d: d.list(where, limit))
    rows = table(
        "consumer", "event_id", "type", "origin", "error", "attempts", "state", "dlq", "at"
    )
    for x in letters:
        rows.add_row(
            x.consumer,
            x.event_id,
            x.event_type or "-",
            f"{x.topic}[{x.partition}]@{x.offset}",
            x.error_class,
            str(x.attempts),
            x.state,
            _on_topic(x),
            x.dead_lettered_at.isoformat(timespec="seconds"),
        )
    print_results(rows)
    notice(counted(len(letters), "dead letter"), count=len(letters))


@app.command()
def show(
    ctx: typer.Context,
    event_id: str = typer.Argument(..., help=_EVENT_ID),
    consumer: str | None = typer.Option(
        None, "--consumer", "-c", help="The consumer, when the event is dead for several."
    ),
) -> None:
    """Show one dead letter: error, origin, headers, its failed attempts and the latest
    stack trace (the payload only as its size)."""

    async def one(d: DeadLetters) -> DeadLetter:
        return await d.get(consumer, await d.resolve(event_id, consumer))

    x = _with(settings_of(ctx), one)
    for label, value in (
        ("consumer", x.consumer),
        ("event_id", x.event_id),
        ("type", x.event_type),
        ("origin", f"{x.topic} partition {x.partition} offset {x.offset}"),
        ("dead-letter topic", _dlq_place(x)),
        ("error", f"{x.error_class}: {scrub(x.error_message)}"),
        ("attempts", x.attempts),
        ("dead-lettered at", x.dead_lettered_at.isoformat()),
        ("state", f"{x.state}: {DEAD_LETTER_STATES[x.state]}"),
        ("replays", f"{x.replays} (last {x.replayed_at.isoformat() if x.replayed_at else '-'})"),
        ("key", repr(x.key)),
        ("value", "null (a tombstone)" if x.value is None else f"{len(x.value)} bytes"),
    ):
        # Stored text comes from records: escaped (control characters) and inert (markup).
        out.print(f"[bold]{label}:[/] {escape(printable(str(value)))}", highlight=False)
    for name, raw in x.headers:
        out.print(f"  header {printable(name)} = {printable(raw)}", highlight=False, markup=False)
    _history(x)


def _history(x: DeadLetter) -> None:
    """The failed attempts (oldest first) and the latest stack trace, as kept."""
    if not x.history:
        out.print("[bold]history:[/] not kept (dead-lettered before outbox-inbox kept it)")
        return
    out.print(f"[bold]history:[/] {counted(len(x.history), 'failed attempt')}", highlight=False)
    for a in x.history:
        took = f", {a.took}" if a.took else ""
        where = f" at {a.frame}" if a.frame else ""
        delivery = f"replay {a.replay}" if a.replay else "delivery"
        out.print(
            f"  {a.at.isoformat(timespec='milliseconds')} {delivery} attempt {a.attempt}: "
            f"{a.error_class}: {printable(scrub(a.message))} ({a.member}{took}){where}",
            markup=False,
            highlight=False,
            soft_wrap=True,
        )
    if x.trace:
        out.print("[bold]stack trace[/] (latest failure):")
        for line in scrub(x.trace).rstrip().splitlines():  # each line escaped, the lines kept
            out.print(printable(line), markup=False, highlight=False, soft_wrap=True)


def _on_topic(x: DeadLetter) -> str:
    """What the dead-letter topic holds of it: the record, a marker, or nothing."""
    if x.dlq_refused is None:
        return "record"
    return "marker" if x.dlq_offset is not None else "none"


def _dlq_place(x: DeadLetter) -> str:
    at = f"partition {x.dlq_partition} offset {x.dlq_offset}"
    if x.dlq_refused is None:
        return f"{x.dlq_topic} {at}"
    kept = "the full record is kept here only (replay works from here)"
    if x.dlq_offset is None:
        return f"{x.dlq_topic} refused the record and its marker ({x.dlq_refused}); {kept}"
    return f"{x.dlq_topic} refused the record ({x.dlq_refused}): a marker at {at}; {kept}"


@app.command()
def replay(
    ctx: typer.Context,
    event_id: str | None = typer.Argument(None, help=f"{_EVENT_ID} Omit to use filters."),
    consumer: str | None = _CONSUMER,
    topic: str | None = _TOPIC,
    event_type: str | None = _TYPE,
    error_class: str | None = _ERROR,
    all_: bool = typer.Option(False, "--all", help="Replay every dead letter (matching filters)."),
) -> None:
    """Re-deliver dead letters to their source topic; the handler runs once more. An
    EVENT_ID without -c is replayed for every consumer that dead-lettered it."""
    if event_id is None and not all_ and not any((consumer, topic, event_type, error_class)):
        usage(_SELECT)

    async def go(d: DeadLetters) -> ReplayReport:
        chosen = None if event_id is None else await d.resolve(event_id, consumer)
        return await d.replay(_filter(consumer, chosen, topic, event_type, error_class, None))

    report = _with(settings_of(ctx), go)
    for x in report.refused:
        notice(
            f"refused {x.consumer} {x.event_id}: already processed",
            style="yellow",
            consumer=x.consumer,
            event_id=x.event_id,
        )
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
    event_id: str | None = typer.Argument(None, help=_EVENT_ID),
    consumer: str | None = _CONSUMER,
    topic: str | None = _TOPIC,
    error_class: str | None = _ERROR,
    older_than: float | None = _OLDER,
    older_than_hours: float | None = _OLDER_HOURS,
    all_: bool = typer.Option(False, "--all", help="Purge every dead letter (matching filters)."),
    yes: bool = typer.Option(False, "--yes", "-y", help="Do not ask before purging many."),
) -> None:
    """Delete dead-letter records (the inbox still remembers the event as dead-lettered).

    Purging by filter or --all asks first (or needs --yes without a terminal)."""
    older = _older(older_than, older_than_hours)
    filtered = any((consumer, topic, error_class, older is not None))
    if event_id is None and not all_ and not filtered:
        usage(_SELECT)
    settings = settings_of(ctx)
    if event_id is None:
        scope = " matching the filters" if filtered else ""
        confirm(f"purge every dead letter{scope}", yes=yes)

    async def go(d: DeadLetters) -> int:
        chosen = None if event_id is None else await d.resolve(event_id, consumer)
        return await d.purge(_filter(consumer, chosen, topic, None, error_class, older))

    n = _with(settings, go)
    notice(f"purged {counted(n, 'dead letter')}", purged=n)
