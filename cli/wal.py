"""``outbox wal``: the WAL source's publication and replication slot."""

from __future__ import annotations

from logging import WARNING

import typer

from cli.context import error, notice, out, reported_errors, settings_of
from outbox.errors import WalSetupError
from outbox.ops import wal_drain, wal_slot
from outbox.settings import OutboxSettings

# wait-drained: how often it says how far the slot still is.
PROGRESS_SECONDS = 5.0

app = typer.Typer(
    help="The WAL source (OUTBOX_SOURCE=wal): its publication and replication slot.",
    no_args_is_help=True,
)


@app.command()
def setup(
    ctx: typer.Context,
    print_sql: bool = typer.Option(
        False,
        "--print-sql",
        help="Print the SQL for an administrator (psql -f) instead of running it.",
    ),
    role: str | None = typer.Option(
        None,
        "--role",
        help="With --print-sql: also grant REPLICATION to this login role (the relay's: it "
        "reads and advances the slot).",
    ),
) -> None:
    """Create the publication and the logical replication slot the relay reads
    (idempotent). A role that may not (REPLICATION or superuser for the slot, CREATE on
    the database for the publication) gets the SQL to hand to an administrator on stdout,
    and exit code 2."""
    settings = settings_of(ctx)
    if print_sql:
        script = wal_slot.setup_sql(settings, settings.sqlalchemy_url.database, role)
        out.print(script, highlight=False, markup=False, soft_wrap=True)
        return
    set_up(settings)


def set_up(settings: OutboxSettings) -> None:
    """Run the set-up, report what it did (shared with ``outbox db upgrade``)."""
    wal = settings.wal
    notice(
        f"WAL source in {settings.safe_database_url}: publication {wal.publication}, "
        f"slot {wal.slot}"
    )
    with reported_errors():  # one line on stderr, exit 2
        try:
            result = wal_slot.ensure(settings, progress=notice)
        except WalSetupError as exc:
            if exc.sql:  # stdout: `outbox wal setup > setup.sql` gives the admin a file
                out.print(exc.sql, highlight=False, markup=False, soft_wrap=True)
            raise
    if not result.publication_created and not result.slot_created:
        notice("publication and slot exist", style="green")
    if result.server.max_slot_wal_keep_size < 0:
        notice(
            "max_slot_wal_keep_size is -1 (unbounded): a slot nobody reads keeps WAL on the "
            "primary until its disk is full; see docs/operations/wal-slot.md",
            style="yellow",
            level=WARNING,
        )


@app.command("wait-drained")
def wait_drained(
    ctx: typer.Context,
    timeout: float = typer.Option(
        600.0, "--timeout", min=0, help="Give up (exit 1) after this many seconds."
    ),
) -> None:
    """Wait until every event written to the WAL before now is in Kafka: the slot's
    confirmed position has passed the WAL position when the command started.

    Switching back to the table: run it once every producer writes to the table
    (OUTBOX_SOURCE=table) while a WAL relay still reads the slot; when it exits 0, start
    the table relays and stop the WAL relays. Progress goes to stderr every few seconds.
    """
    settings = settings_of(ctx)
    slot = settings.wal.slot
    shown = [-PROGRESS_SECONDS]

    def progress(state: wal_drain.DrainState) -> None:
        if state.drained or state.waited_seconds - shown[0] < PROGRESS_SECONDS:
            return
        shown[0] = state.waited_seconds
        notice(
            f"slot {slot}: {state.behind_bytes:,} bytes of WAL before {state.target} not "
            f"confirmed yet (confirmed {state.confirmed or 'nothing'}; "
            f"{state.waited_seconds:.0f} s)",
            behind_bytes=state.behind_bytes,
        )

    with reported_errors():
        state = wal_drain.wait_drained(settings, timeout, progress)
    if not state.drained:
        error(
            f"slot {slot} not drained after {timeout:.0f} s ({state.behind_bytes:,} bytes "
            f"before {state.target} not confirmed): is a WAL relay reading it? `outbox lag` "
            "and `outbox doctor` show the slot"
        )
        raise typer.Exit(1)
    notice(
        f"slot {slot} drained: every event written to the WAL before {state.target} is "
        f"published (confirmed {state.confirmed}); the table relays may start",
        style="green",
    )
