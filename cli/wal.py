"""``outbox wal``: the WAL source's publication and replication slot."""

from __future__ import annotations

from logging import WARNING

import typer

from cli.context import notice, out, reported_errors, settings_of
from outbox.errors import WalSetupError
from outbox.ops import wal_slot
from outbox.settings import OutboxSettings

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
