"""The WAL source's publication and logical replication slot: set-up and state.

``source = "wal"`` carries events in logical-decoding messages that the relay reads from
a ``pgoutput`` slot (``settings.wal.slot``) naming a publication (``settings.wal.publication``,
which needs no tables: the messages are not table changes). Both must exist before the
first event is published — a message committed before the slot exists is never decoded —
so ``outbox wal setup`` (and ``outbox db upgrade`` in WAL mode) creates them::

    from outbox.ops.wal_slot import ensure, setup_sql

    result = ensure(settings)            # idempotent; WalPrivilegeMissing carries the SQL
    print(setup_sql(settings))           # the same, for an administrator to run

The publication is created before the slot: pgoutput looks publications up in the
catalog as of the WAL it decodes, and one created after the slot's start is missing for
everything decoded before its creation.

``read_state`` is the slot's state for ``doctor``, ``lag`` and the relay's metrics
(how old the oldest transaction the relay has not confirmed is: outbox/ops/wal_lag.py).
"""

from __future__ import annotations

import select
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import psycopg
import psycopg.errors
from psycopg import pq
from sqlalchemy import Connection, CursorResult, TextClause, text
from sqlalchemy.dialects import postgresql
from sqlalchemy.exc import DBAPIError

from outbox.db import describe, sync_engine, translated_errors
from outbox.errors import (
    WalLevelNotLogical,
    WalPrivilegeMissing,
    WalSetupError,
    WalSlotMismatch,
    WalSlotUnavailable,
)
from outbox.ops.store import (
    ALTER_FAILOVER_ON,
    WAL_CREATE_FAILOVER_SLOT,
    WAL_CREATE_SLOT,
    WAL_DROP_SLOT,
    WAL_EMIT_PUBLIC,
    WAL_PUBLICATION,
    WAL_READERS,
    WAL_SETTINGS,
    WAL_SLOT_QUERY,
)
from outbox.ops.wal_grants import restrict_comment, restrict_sql
from outbox.roles import role_names
from outbox.settings import OutboxSettings

_PREPARER = postgresql.dialect().identifier_preparer  # type: ignore[no-untyped-call]
PLUGIN = "pgoutput"
# application_name of the WAL relay's reading connection (relay/sources/wal/source.py): how doctor
# and lag find the relays of a slot.
READER_APPLICATION = "outbox-relay-wal"


@dataclass(frozen=True)
class WalReader:
    """A WAL relay's reading connection, as pg_stat_activity shows it."""

    backend_pid: int  # PostgreSQL's process serving the session
    reading: bool  # it holds the reader lock (the others stand by)
    application: str = READER_APPLICATION

    @property
    def relay(self) -> tuple[int, str] | None:
        """The relay's own process id and host (None: a relay from before they were named)."""
        who = self.application[len(READER_APPLICATION) + 1 :]
        pid, _, host = who.partition("@")
        return (int(pid), host) if pid.isdigit() and host else None

    def describe(self) -> str:
        relay = self.relay
        session = f"backend pid {self.backend_pid}"
        return f"relay pid {relay[0]} on {relay[1]} ({session})" if relay else session

    def as_dict(self) -> dict[str, object]:
        relay = self.relay
        return {
            "relay_pid": relay[0] if relay else None,
            "host": relay[1] if relay else None,
            "backend_pid": self.backend_pid,
            "reading": self.reading,
        }


def _literal(value: str) -> str:
    return "'" + value.replace("'", "''") + "'"


def _ident(value: str) -> str:
    return str(_PREPARER.quote_identifier(value))


@dataclass(frozen=True)
class ServerWal:
    """The server settings and this role's privileges that the WAL source depends on."""

    wal_level: str
    max_slot_wal_keep_size: int  # bytes; -1 = unbounded (PostgreSQL's default)
    database: str
    user: str
    may_replicate: bool  # superuser or REPLICATION: may create, read and advance slots
    may_publish: bool  # CREATE on the database: may create the publication
    version_num: int = 150000  # server_version_num

    @property
    def failover_slots(self) -> bool:
        """Whether this server has failover slots (PostgreSQL 17+)."""
        return self.version_num >= 170000

    @property
    def major(self) -> int:
        return self.version_num // 10000


@dataclass(frozen=True)
class SlotState:
    """One row of ``pg_replication_slots`` plus the WAL it holds, in bytes from the
    current insert position."""

    slot_name: str
    plugin: str | None
    slot_type: str
    database: str | None
    active: bool
    active_pid: int | None
    wal_status: str | None  # reserved | extended | unreserved | lost
    safe_wal_size: int | None  # bytes writable before the slot is at risk; None: unbounded
    restart_lsn: str | None
    confirmed_flush_lsn: str | None
    current_lsn: str
    retained_bytes: int | None  # WAL kept for the slot (from restart_lsn)
    unconfirmed_bytes: int | None  # WAL not yet confirmed by the relay
    failover: bool | None = None  # kept in step on standbys (PostgreSQL 17+; None before)
    synced: bool | None = None  # synced from a primary (true on a promoted standby too)

    @property
    def being_created(self) -> bool:
        """A logical slot another session is creating: PostgreSQL shows it before it has
        written the output plugin's name (the creation waits for open transactions)."""
        return self.slot_type == "logical" and not self.plugin

    def mismatch(self, database: str) -> str | None:
        """Why this slot cannot serve the WAL source of ``database``, or None."""
        if self.being_created:
            return "is being created by another session (it has no output plugin yet)"
        if self.slot_type != "logical":
            return f"is a {self.slot_type} slot, not a logical one"
        if self.plugin != PLUGIN:
            return f"uses the output plugin {self.plugin}, not {PLUGIN}"
        if self.database != database:
            return f"belongs to database {self.database}, not {database}"
        return None


@dataclass(frozen=True)
class WalState:
    """What ``doctor`` and ``lag`` look at: server settings, the slot (None when it does
    not exist) and whether the publication exists in this database."""

    server: ServerWal
    slot: SlotState | None
    publication_exists: bool
    # The WAL relays' reading connections: the one holding the reader lock (normally one)
    # and those waiting to take over.
    readers: tuple[WalReader, ...] = ()
    emit_public: bool = False  # PUBLIC may write WAL events (outbox/ops/wal_grants.py)

    @property
    def reading(self) -> tuple[WalReader, ...]:
        return tuple(r for r in self.readers if r.reading)

    @property
    def standing_by(self) -> tuple[WalReader, ...]:
        return tuple(r for r in self.readers if not r.reading)


# What setup did about the slot's failover flag (SetupResult.failover).
FailoverStep = Literal["on", "turned on", "in use", "unsupported"]


@dataclass(frozen=True)
class SetupResult:
    publication_created: bool
    slot_created: bool
    slot_lsn: str | None  # the slot's consistent point when it was created now
    server: ServerWal
    # on: created or found with failover; turned on: for the slot found without it; in
    # use: could not be turned on (another session streams the slot); unsupported: < 17.
    failover: FailoverStep = "unsupported"
    failover_blocker: str | None = None  # the server's refusal when in use
    emit_public: bool = True  # PUBLIC may still write WAL events, after the set-up
    emit_restricted: bool = False  # this set-up revoked it (producer roles were given)
    lost_since: str | None = None  # a lost slot replaced now: the LSN it had confirmed


def read_server(conn: Connection) -> ServerWal:
    row = conn.execute(WAL_SETTINGS).mappings().one()
    return ServerWal(
        wal_level=row["wal_level"],
        max_slot_wal_keep_size=int(row["max_slot_wal_keep_size"]),
        database=row["database"],
        user=row["user"],
        may_replicate=bool(row["may_replicate"]),
        may_publish=bool(row["may_publish"]),
        version_num=int(row["version_num"]),
    )


def read_slot(conn: Connection, slot: str) -> SlotState | None:
    row = conn.execute(WAL_SLOT_QUERY, {"slot": slot}).mappings().one_or_none()
    return None if row is None else SlotState(**dict(row))


def read_state(conn: Connection, settings: OutboxSettings) -> WalState:
    relays = conn.execute(WAL_READERS, {"application": READER_APPLICATION}).all()
    readers = tuple(WalReader(int(pid), bool(reading), name) for pid, reading, name in relays)
    return WalState(
        server=read_server(conn),
        slot=read_slot(conn, settings.wal.slot),
        publication_exists=_publication_exists(conn, settings.wal.publication),
        readers=readers,
        emit_public=emit_public(conn),
    )


def emit_public(conn: Connection) -> bool:
    """Whether PUBLIC may still execute ``pg_logical_emit_message`` in this database."""
    return bool(conn.execute(WAL_EMIT_PUBLIC).scalar_one())


def _publication_exists(conn: Connection, name: str) -> bool:
    return bool(conn.execute(WAL_PUBLICATION, {"name": name}).scalar_one())


def setup_sql(
    settings: OutboxSettings,
    database: str | None = None,
    role: str | None = None,
    producers: Sequence[str] = (),
) -> str:
    """The set-up as a script for an administrator (a superuser, or a role with REPLICATION
    and CREATE on the database): idempotent, one statement per transaction (run it with
    ``psql -f``; ``pg_create_logical_replication_slot`` refuses to run in a transaction that
    has written anything). ``role``, when given, is granted REPLICATION: the relay's login
    role needs it to read and advance the slot (an attribute, not inherited from a group).
    ``producers``, when given, become the only roles (with the relay's, the job roles and
    the runner) that may write WAL events (:func:`emit_restriction`; needs a superuser)."""
    wal = settings.wal
    where = f" in database {database}" if database else ""
    lines = [
        f"-- outbox-inbox WAL source: publication {wal.publication} and logical slot "
        f"{wal.slot} ({PLUGIN}){where}.",
        "-- Run connected to that database (a slot belongs to one database), as a superuser",
        "-- or a role with REPLICATION and CREATE on the database: psql -f this-file.",
        "-- The publication first: pgoutput must find it for all WAL the slot decodes.",
        f"DO $$ BEGIN CREATE PUBLICATION {_ident(wal.publication)}; "
        "EXCEPTION WHEN duplicate_object OR unique_violation THEN "
        "RAISE NOTICE 'publication % exists', "
        f"{_literal(wal.publication)}; END $$;",
        "-- Waits for the transactions open now to end (the slot's consistent point).",
        "-- On PostgreSQL 17+ a failover slot: standbys with sync_replication_slots keep it",
        "-- in step and it survives a promotion; before 17 a promotion loses it",
        "-- (docs/operations/postgresql-failover.md).",
        "DO $$ BEGIN IF NOT EXISTS "
        f"(SELECT FROM pg_replication_slots WHERE slot_name = {_literal(wal.slot)}) THEN "
        "IF current_setting('server_version_num')::int >= 170000 THEN "
        f"PERFORM pg_create_logical_replication_slot({_literal(wal.slot)}, '{PLUGIN}', "
        "false, false, true); "
        f"ELSE PERFORM pg_create_logical_replication_slot({_literal(wal.slot)}, '{PLUGIN}'); "
        "END IF; END IF; END $$;",
        "-- The relay's login role reads and advances the slot: it needs REPLICATION.",
    ]
    if role:
        lines.append(f"ALTER ROLE {_ident(role)} WITH REPLICATION;")
    else:
        lines.append("-- ALTER ROLE <relay login role> WITH REPLICATION;")
    if producers:
        granted = [*producers, *([role] if role else [])]
        lines += [restrict_comment(granted), emit_restriction(settings, granted)]
    else:
        lines.append(
            "-- Any role may write WAL events until EXECUTE on pg_logical_emit_message is"
            " revoked from PUBLIC: `outbox wal setup --print-sql --producer-role <role>`."
        )
    return "\n".join(lines) + "\n"


def emit_restriction(settings: OutboxSettings, roles: Sequence[str]) -> str:
    """The SQL that leaves writing WAL events to ``roles``, the job roles of ``outbox db sql
    --roles`` (producer, relay) where they exist and the role running it."""
    jobs = role_names(settings.table_prefix)
    return restrict_sql(roles, job_roles=[jobs["producer"], jobs["relay"]])


def ensure_on(
    conn: Connection,
    settings: OutboxSettings,
    progress: Callable[[str], None] | None = None,
    producers: Sequence[str] = (),
    recreate_lost: bool = False,
) -> SetupResult:
    """Create the publication, then the slot, where missing (idempotent, safe to run
    concurrently). ``conn`` must be in autocommit mode: the slot cannot be created in a
    transaction that has written (the publication's catalog rows).

    Raises :class:`WalLevelNotLogical`, :class:`WalSlotMismatch` (a slot of that name that
    is not this database's pgoutput slot) or :class:`WalPrivilegeMissing` with the SQL an
    administrator runs instead (``exc.sql``). ``progress`` is told about each object
    created (and before the slot, whose creation may wait). With ``producers``, writing
    WAL events is then left to them (:func:`emit_restriction`); refused, that is
    :class:`WalPrivilegeMissing` too. A lost slot is :class:`WalSlotUnavailable` (saying
    since which LSN events may be lost) unless ``recreate_lost``: then it is dropped and
    created anew, and ``SetupResult.lost_since`` says from where."""
    tell = progress or (lambda _: None)
    server = read_server(conn)
    if server.wal_level != "logical":
        raise WalLevelNotLogical(
            f"wal_level is {server.wal_level}, the WAL source needs logical: "
            "ALTER SYSTEM SET wal_level = logical; then restart PostgreSQL",
            sql="ALTER SYSTEM SET wal_level = logical;  -- then restart PostgreSQL\n",
        )
    wal = settings.wal
    # The SQL an admin runs: ALTER ROLE only for a role that lacks REPLICATION itself.
    role = None if server.may_replicate else server.user
    admin = setup_sql(settings, server.database, role, producers)
    slot = _settled_slot(conn, wal.slot, tell)
    _check_slot(slot, wal.slot, server.database)
    lost_since = None
    if slot is not None and slot.wal_status == "lost":
        lost_since = _make_way(conn, slot, recreate_lost, tell)
        slot = None
    publication_created = False
    if not _publication_exists(conn, wal.publication):
        publication_created = _create_publication(conn, wal.publication, server, admin)
        if publication_created:
            tell(f"created publication {wal.publication}")
    slot_lsn = None
    while slot is None:
        tell(f"creating replication slot {wal.slot} (waits for the transactions open now)")
        slot_lsn = _create_slot(conn, wal.slot, server, admin)
        if slot_lsn is not None:
            kind = " (a failover slot)" if server.failover_slots else ""
            tell(f"created replication slot {wal.slot} at LSN {slot_lsn}{kind}")
            break
        # A concurrent set-up got there first: return once its slot is ready, or try
        # again if its creation failed (PostgreSQL then drops the half-made slot).
        slot = _settled_slot(conn, wal.slot, tell)
        _check_slot(slot, wal.slot, server.database)
    # Steps on a slot that exists.
    failover, blocker = _failover_on(settings, slot, server, tell)
    if producers:
        _restrict_emit(conn, emit_restriction(settings, producers), server, admin)
        tell(f"writing WAL events left to {', '.join(producers)} (revoked from PUBLIC)")
    return SetupResult(
        publication_created,
        slot_lsn is not None,
        slot_lsn,
        server,
        failover,
        blocker,
        emit_public=emit_public(conn),
        emit_restricted=bool(producers),
        lost_since=lost_since,
    )


def _make_way(
    conn: Connection, slot: SlotState, recreate: bool, tell: Callable[[str], None]
) -> str:
    """A lost slot (its WAL removed: no relay can stream it again): refused, or dropped so
    that a new one is created. Returns the last LSN it had confirmed ("unknown" if none)."""
    since = slot.confirmed_flush_lsn or "unknown"
    if not recreate:
        raise WalSlotUnavailable(
            f"replication slot {slot.slot_name!r} is lost (wal_status lost, confirmed up to "
            f"LSN {since}): events committed since then that the relay had not published may "
            "be gone, and no relay can read it again; `outbox wal setup --recreate-lost` "
            "drops it and creates a new one (events between the two are not recovered: "
            "compare the topics with your source of truth, docs/operations/wal-slot.md)"
        )
    conn.execute(WAL_DROP_SLOT, {"slot": slot.slot_name})
    tell(f"dropped lost replication slot {slot.slot_name} (it had confirmed up to LSN {since})")
    return since


def _failover_on(
    settings: OutboxSettings,
    slot: SlotState | None,
    server: ServerWal,
    tell: Callable[[str], None],
) -> tuple[FailoverStep, str | None]:
    """The slot's failover flag: set at creation (``slot`` None: created now), turned on
    for a slot found without it unless another session streams it (``ALTER_REPLICATION_SLOT``,
    a replication command, would wait for that session to let go), nothing before 17."""
    if not server.failover_slots:
        return "unsupported", None
    if slot is None or slot.failover:
        return "on", None
    if slot.active:
        return "in use", f"replication slot {slot.slot_name!r} is active for PID {slot.active_pid}"
    command = ALTER_FAILOVER_ON.format(slot=_ident(slot.slot_name)).encode()
    try:
        with psycopg.connect(
            settings.libpq_dsn, autocommit=True, replication="database", connect_timeout=10
        ) as rconn:
            refused = _replication_command(rconn, command)
    except psycopg.Error as exc:
        sqlstate, message, _ = describe(exc)
        refused = f"{message} [SQLSTATE {sqlstate}]"
    if refused is not None:
        return "in use", refused
    tell(f"turned failover on for replication slot {slot.slot_name}")
    return "turned on", None


# How long ALTER_REPLICATION_SLOT may wait: it waits for a session holding the slot to let
# go (one that took it after the check above), rather than failing.
_ALTER_WAIT_S = 10.0


def _replication_command(conn: psycopg.Connection[Any], command: bytes) -> str | None:
    """Run a replication command (the simple query protocol: a walsender answers no other);
    None when it succeeded, else why not. Cancelled after ``_ALTER_WAIT_S``."""
    pg = conn.pgconn
    pg.send_query(command)
    deadline = time.monotonic() + _ALTER_WAIT_S
    while True:
        pg.consume_input()
        if not pg.is_busy():
            break
        if time.monotonic() > deadline:
            conn.cancel_safe()
            return (
                f"still waiting after {_ALTER_WAIT_S:g} s for another session to release the slot"
            )
        select.select([pg.socket], [], [], 0.2)
    result = pg.get_result()
    while pg.get_result() is not None:  # drain, so the connection closes cleanly
        pass
    if result is not None and result.status == pq.ExecStatus.COMMAND_OK:
        return None
    if result is None:
        return "no answer"
    fields = pq.DiagnosticField
    sqlstate = (result.error_field(fields.SQLSTATE) or b"").decode()
    message = (result.error_field(fields.MESSAGE_PRIMARY) or b"").decode(errors="replace")
    return f"{message} [SQLSTATE {sqlstate}]"


def _check_slot(slot: SlotState | None, name: str, database: str) -> None:
    if slot is not None and (why := slot.mismatch(database)):
        raise WalSlotMismatch(
            f"replication slot {name!r} {why}; choose another name (OUTBOX_WAL__SLOT) "
            "or drop that slot"
        )


def _settled_slot(conn: Connection, name: str, tell: Callable[[str], None]) -> SlotState | None:
    """The slot, once no other session is creating it: a concurrent set-up's slot is
    waited for (its creation waits for the transactions open then), so that it is neither
    taken for a foreign slot nor reported ready before it is. None when the slot does not
    exist, or its creation failed and PostgreSQL dropped it."""
    slot = read_slot(conn, name)
    if slot is not None and slot.being_created:
        tell(f"replication slot {name} is being created by another session; waiting for it")
        while slot is not None and slot.being_created:
            time.sleep(_CREATION_POLL_S)
            slot = read_slot(conn, name)
    return slot


# How often a slot another session is creating is looked at again.
_CREATION_POLL_S = 0.1


def ensure(
    settings: OutboxSettings,
    progress: Callable[[str], None] | None = None,
    producers: Sequence[str] = (),
    recreate_lost: bool = False,
) -> SetupResult:
    """:func:`ensure_on` over a connection of its own to ``settings.database_url``."""
    engine = sync_engine(settings, pool_pre_ping=False, isolation_level="AUTOCOMMIT")
    try:
        with translated_errors(), engine.connect() as conn:
            return ensure_on(conn, settings, progress, producers, recreate_lost)
    finally:
        engine.dispose()


def _create(
    conn: Connection, statement: TextClause, params: dict[str, str], denied: str, admin: str
) -> CursorResult[Any] | None:
    """Run one CREATE; None when a concurrent set-up made the object first. A refusal
    (42501) is :class:`WalPrivilegeMissing` saying what ``denied`` the role, with the SQL."""
    try:
        return conn.execute(statement, params)
    except DBAPIError as exc:
        # A concurrent CREATE of the same name that commits first: duplicate_object, or the
        # catalog's unique index when both passed the existence check at once.
        if isinstance(exc.orig, psycopg.errors.DuplicateObject | psycopg.errors.UniqueViolation):
            return None
        if isinstance(exc.orig, psycopg.errors.InsufficientPrivilege):
            raise _refused(exc, denied, admin) from exc
        raise


def _restrict_emit(conn: Connection, sql: str, server: ServerWal, admin: str) -> None:
    """Run :func:`emit_restriction`'s block. Only a superuser may (the function's owner is
    the bootstrap superuser): a refusal is :class:`WalPrivilegeMissing` with the SQL."""
    try:
        conn.execute(text(sql))
    except DBAPIError as exc:
        if isinstance(exc.orig, psycopg.errors.InsufficientPrivilege):
            denied = (
                f"role {server.user} may not revoke EXECUTE on pg_logical_emit_message from "
                "PUBLIC (only a superuser may)"
            )
            raise _refused(exc, denied, admin) from exc
        if isinstance(exc.orig, psycopg.errors.UndefinedObject):  # a misspelt --producer-role
            sqlstate, message, _ = describe(exc)
            raise WalSetupError(
                f"{message} [SQLSTATE {sqlstate}]: name an existing role with --producer-role "
                "(nothing was revoked)",
                sqlstate=sqlstate,
            ) from exc
        raise


def _create_publication(conn: Connection, name: str, server: ServerWal, admin: str) -> bool:
    denied = (
        f"role {server.user} may not create publication {name!r} (it needs CREATE on "
        f"database {server.database})"
    )
    created = _create(conn, text(f"CREATE PUBLICATION {_ident(name)}"), {}, denied, admin)
    return created is not None


def _create_slot(conn: Connection, slot: str, server: ServerWal, admin: str) -> str | None:
    denied = (
        f"role {server.user} may not create replication slot {slot!r} (it needs REPLICATION "
        "or superuser)"
    )
    statement = WAL_CREATE_FAILOVER_SLOT if server.failover_slots else WAL_CREATE_SLOT
    created = _create(conn, statement, {"slot": slot}, denied, admin)
    return None if created is None else str(created.scalar_one())


def _refused(exc: BaseException, what: str, admin: str) -> WalPrivilegeMissing:
    sqlstate, message, _ = describe(exc)
    return WalPrivilegeMissing(
        f"{what}: {message} [SQLSTATE {sqlstate}]; ask an administrator to run the SQL of "
        "`outbox wal setup --print-sql`",
        sql=admin,
        sqlstate=sqlstate,
    )
