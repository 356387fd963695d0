"""``outbox wal``: the WAL source's publication and replication slot."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from logging import WARNING

import typer

from cli.context import error, notice, out, reported_errors, settings_of
from cli.params import DURATION, duration, shown
from outbox.errors import WalSetupError
from outbox.ops import wal_drain, wal_failover, wal_slot
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
    producer_roles: list[str] = typer.Option(
        [],
        "--producer-role",
        help="Leave writing WAL events to this role (repeatable: each producer's login or "
        "group role; the relay's role, the job roles of `outbox db sql --roles` and the "
        "role running this get it too) and revoke it from PUBLIC, which PostgreSQL grants "
        "it to: any role that can connect could forge events. Needs a superuser.",
    ),
    recreate_lost: bool = typer.Option(
        False,
        "--recreate-lost",
        help="Drop a lost (invalidated) slot and create a new one. Without it a lost slot "
        "is refused (exit 2): events committed since its last confirmed LSN may be gone, "
        "and the new slot starts now.",
    ),
    wait_synced: bool = typer.Option(
        False,
        "--wait-synced",
        help="Then wait until the standbys (OUTBOX_WAL__STANDBY_URLS; those named in "
        "synchronized_standby_slots) have the failover slot synced: a promotion keeps it "
        "from then on (PostgreSQL 17+; a relay must be reading the slot).",
    ),
    timeout: float = typer.Option(
        600.0, "--timeout", min=0, help="With --wait-synced: give up (exit 1) after this long."
    ),
) -> None:
    """Create the publication and the logical replication slot the relay reads
    (idempotent). A role that may not (REPLICATION or superuser for the slot, CREATE on
    the database for the publication) gets the SQL to hand to an administrator on stdout,
    and exit code 2."""
    settings = settings_of(ctx)
    if print_sql:
        database = settings.sqlalchemy_url.database
        script = wal_slot.setup_sql(settings, database, role, producer_roles)
        out.print(script, highlight=False, markup=False, soft_wrap=True)
        return
    set_up(settings, producer_roles, recreate_lost)
    if wait_synced:
        _wait_synced(settings, timeout)


def _progress_due() -> Callable[[float], bool]:
    """Whether a progress line is due after ``waited`` seconds: the first at once, then one
    every ``PROGRESS_SECONDS``."""
    shown = [-PROGRESS_SECONDS]

    def due(waited: float) -> bool:
        if waited - shown[0] < PROGRESS_SECONDS:
            return False
        shown[0] = waited
        return True

    return due


def _wait_synced(settings: OutboxSettings, timeout: float) -> None:
    slot = settings.wal.slot
    due = _progress_due()

    def progress(state: wal_failover.SyncWait) -> None:
        if state.synced or not due(state.waited_seconds):
            return
        for view in state.standbys:
            where = view.error or ("synced" if view.synced else _not_synced(view))
            notice(f"standby {view.url}: slot {slot} {where} ({state.waited_seconds:.0f} s)")

    with reported_errors():
        primary = wal_failover.primary_view(settings)
        state = wal_failover.wait_synced(settings, primary, timeout, progress)
    if not state.synced:
        error(
            f"slot {slot} not synced on every standby after {timeout:.0f} s: is a relay "
            "reading it (a new slot syncs once the relay has confirmed a position)? "
            "`outbox doctor` checks each standby's settings"
        )
        raise typer.Exit(1)
    names = ", ".join(v.url for v in state.standbys)
    notice(f"slot {slot} synced on {names}: a promotion keeps it", style="green")


def _not_synced(view: wal_failover.StandbyView) -> str:
    if view.slot is None:
        return "not there yet"
    if view.slot.get("temporary"):
        return "being synced (waits for the relay to confirm past the standby's position)"
    return "not synced"


def set_up(
    settings: OutboxSettings, producers: Sequence[str] = (), recreate_lost: bool = False
) -> None:
    """Run the set-up, report what it did (shared with ``outbox db upgrade``)."""
    wal = settings.wal
    notice(
        f"WAL source in {settings.safe_database_url}: publication {wal.publication}, "
        f"slot {wal.slot}"
    )
    with reported_errors():  # one line on stderr, exit 2
        try:
            result = wal_slot.ensure(settings, notice, producers, recreate_lost)
        except WalSetupError as exc:
            if exc.sql:  # stdout: `outbox wal setup > setup.sql` gives the admin a file
                out.print(exc.sql, highlight=False, markup=False, soft_wrap=True)
            raise
    if not result.publication_created and not result.slot_created:
        notice("publication and slot exist", style="green")
    if result.lost_since is not None:
        notice(
            f"replaced the lost slot {wal.slot}: events committed between LSN "
            f"{result.lost_since} and LSN {result.slot_lsn} that the relay had not published "
            "are not in Kafka; publish them again from your source of truth with their "
            "original event ids (docs/operations/wal-slot.md)",
            style="yellow",
            level=WARNING,
        )
    _failover_notice(settings, result)
    if result.emit_public:
        notice(
            "any role that can connect may write WAL events (PUBLIC may execute "
            "pg_logical_emit_message): as a superuser, run `outbox wal setup --producer-role "
            "<each producer's role>` (docs/howto/roles.md)",
            style="yellow",
            level=WARNING,
        )
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
        "10m",
        "--timeout",
        parser=duration(),
        metavar=DURATION,
        help="Give up (exit 1) after this long.",
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
    due = _progress_due()

    def progress(state: wal_drain.DrainState) -> None:
        if state.drained or not due(state.waited_seconds):
            return
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
            f"NotDrained: slot {slot} not drained after {shown(timeout)} "
            f"({state.behind_bytes:,} bytes before {state.target} not confirmed): is a WAL "
            "relay reading it? `outbox lag` and `outbox doctor` show the slot"
        )
        raise typer.Exit(1)
    notice(
        f"slot {slot} drained: every event written to the WAL before {state.target} is "
        f"published (confirmed {state.confirmed}); the table relays may start",
        style="green",
    )


def _failover_notice(settings: OutboxSettings, result: wal_slot.SetupResult) -> None:
    """What a failover would do to the slot (docs/operations/postgresql-failover.md)."""
    slot = settings.wal.slot
    if result.failover in ("on", "turned on"):
        notice(
            f"slot {slot} is a failover slot: standbys with sync_replication_slots keep it "
            "(`outbox doctor` checks them; `--wait-synced` waits for them)"
        )
    elif result.failover == "in use":
        notice(
            f"slot {slot} is not a failover slot and could not be made one: "
            f"{result.failover_blocker}; stop the relay reading it, run `outbox wal setup` "
            "again, then start the relay (a promotion loses the slot until then)",
            style="yellow",
            level=WARNING,
        )
    else:
        notice(
            f"PostgreSQL {result.server.major} has no failover slots: a promoted standby has no "
            f"slot {slot}, the relay stops (exit 2), and the events committed since its "
            f"confirmed LSN are lost to it; {wal_failover.INSTEAD}",
            style="yellow",
            level=WARNING,
        )
