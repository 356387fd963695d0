"""Whether the WAL source's slot survives a failover: ``doctor``'s checks and
``outbox wal setup --wait-synced`` (docs/operations/postgresql-failover.md).

A logical slot lives on one server. A promoted standby has it only when the primary made
it a failover slot (PostgreSQL 17+) and the standby kept it in step: ``sync_replication_slots``,
``hot_standby_feedback`` and a ``primary_slot_name`` on the standby, a ``dbname`` in its
``primary_conninfo``, and the slot *synced* there (a new failover slot is usable on a
standby only once the primary's slot has moved past where the standby first saw it).
``synchronized_standby_slots`` on the primary must name the standby's physical slot, or
the relay may confirm WAL the standby has not received, and the synced slot on the
promoted standby would be ahead of its own WAL. Before 17 there are no failover slots: a
promotion loses the slot, and with it the events since its confirmed LSN.

The primary's side is read on doctor's connection; each standby (``wal.standby_urls``)
on a connection of its own. :func:`findings` is pure.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from psycopg.conninfo import conninfo_to_dict
from pydantic import SecretStr
from sqlalchemy import Connection
from sqlalchemy.pool import NullPool

from outbox.db import describe, sync_engine, translated_errors
from outbox.errors import WalSetupError
from outbox.ops.findings import Finding, Level
from outbox.ops.store import WAL_PRIMARY_FAILOVER, WAL_STANDBY_FAILOVER
from outbox.ops.wal_slot import SlotState
from outbox.settings import OutboxSettings

DOC = "docs/operations/postgresql-failover.md"
INSTEAD = (
    "use the table source (OUTBOX_SOURCE=table: it survives a failover) or PostgreSQL 17+ "
    f"with a failover slot ({DOC})"
)


@dataclass(frozen=True)
class Standby:
    """A physical standby streaming from the primary (pg_stat_replication)."""

    application_name: str
    state: str | None  # streaming, catchup...; None: hidden (no pg_read_all_stats)
    sync_state: str | None
    slot: str | None  # the physical slot it streams through


@dataclass(frozen=True)
class PrimaryView:
    version_num: int
    in_recovery: bool
    synchronized_standby_slots: str | None  # None before 17
    standbys: tuple[Standby, ...]
    physical_slots: tuple[str, ...]

    @property
    def named_slots(self) -> list[str]:
        raw = self.synchronized_standby_slots or ""
        return [name.strip().strip('"') for name in raw.split(",") if name.strip()]


@dataclass(frozen=True)
class StandbyView:
    """A standby's settings and its copy of the slot; ``error`` when it could not be read."""

    url: str  # credentials masked
    error: str | None = None
    in_recovery: bool = True
    version_num: int = 0
    sync_replication_slots: str | None = None
    hot_standby_feedback: str | None = None
    primary_slot_name: str | None = None
    primary_conninfo: str | None = None  # None: not readable by this role
    slot: dict[str, Any] | None = None  # synced, temporary, invalidated, confirmed_flush_lsn

    @property
    def synced(self) -> bool:
        """The slot is there, synced, persistent (not being synced for the first time) and
        not invalidated: a promotion would keep it."""
        s = self.slot
        return bool(s and s.get("synced") and not s.get("temporary") and not s.get("invalidated"))

    @property
    def dbname(self) -> str | None:
        if not self.primary_conninfo:
            return None
        try:
            return conninfo_to_dict(self.primary_conninfo).get("dbname")  # type: ignore[return-value]
        except Exception:  # libpq's own parser refused it: the standby would too
            return None


def read_primary(conn: Connection) -> PrimaryView:
    row = conn.execute(WAL_PRIMARY_FAILOVER).mappings().one()
    return PrimaryView(
        version_num=int(row["version_num"]),
        in_recovery=bool(row["in_recovery"]),
        synchronized_standby_slots=row["synchronized_standby_slots"],
        standbys=tuple(Standby(**s) for s in row["standbys"]),
        physical_slots=tuple(row["physical_slots"]),
    )


def primary_view(settings: OutboxSettings) -> PrimaryView:
    """:func:`read_primary` over a connection of its own to ``settings.database_url``."""
    engine = sync_engine(settings, pool_pre_ping=False, poolclass=NullPool)
    try:
        with translated_errors(), engine.connect() as conn:
            return read_primary(conn)
    finally:
        engine.dispose()


def read_standby(settings: OutboxSettings, url: SecretStr) -> StandbyView:
    """One standby's view over a connection of its own (a failure is in ``error``)."""
    own = settings.model_copy(update={"database_url": url, "db_pooler": "none"})
    safe = own.safe_database_url
    engine = sync_engine(own, pool_pre_ping=False, poolclass=NullPool)
    try:
        with engine.connect() as conn:
            row = conn.execute(WAL_STANDBY_FAILOVER, {"slot": settings.wal.slot}).mappings().one()
    except Exception as exc:
        return StandbyView(safe, error=describe(exc)[1])
    finally:
        engine.dispose()
    return StandbyView(safe, None, **dict(row))


def read_standbys(settings: OutboxSettings) -> list[StandbyView]:
    return [read_standby(settings, url) for url in settings.wal.standby_urls]


def findings(
    primary: PrimaryView,
    slot: SlotState | None,
    standbys: list[StandbyView],
    settings: OutboxSettings,
) -> list[Finding]:
    """One finding per check, each saying what a failover would do (WAL mode)."""
    out: list[Finding] = []

    def add(check: str, level: Level, what: str, action: str | None = None, **d: Any) -> None:
        out.append(Finding(check, level, what, action, d))

    name = settings.wal.slot
    if primary.version_num < 170000:
        since = slot.confirmed_flush_lsn if slot is not None else None
        add(
            "wal_failover",
            "warn",
            f"PostgreSQL {primary.version_num // 10000} has no failover slots: a promoted "
            f"standby has no slot {name}, the relay stops (exit 2), and the events committed "
            f"since its confirmed LSN ({since or 'unknown'}) are lost to the WAL source",
            INSTEAD,
            version=primary.version_num,
        )
        return out
    if slot is not None:
        if slot.failover:
            add("wal_failover_slot", "ok", f"slot {name} is a failover slot", slot=name)
        else:
            add(
                "wal_failover_slot",
                "warn",
                f"slot {name} is not a failover slot: a promoted standby will not have it, "
                f"and the events since its confirmed LSN ({slot.confirmed_flush_lsn}) would "
                "be lost to the WAL source",
                "`outbox wal setup` turns failover on (stop the relay first: not while the "
                "slot is streamed)",
                slot=name,
            )
    _primary_findings(add, primary)
    if not settings.wal.standby_urls:
        if primary.standbys:
            add(
                "wal_failover_standby",
                "ok",
                "wal.standby_urls is not set: the standbys' settings are not checked",
                "set OUTBOX_WAL__STANDBY_URLS to the standbys' URLs for doctor to check them",
            )
        return out
    for view in standbys:
        _standby_findings(add, view, primary, name)
    return out


def _primary_findings(add: Any, primary: PrimaryView) -> None:
    named = primary.named_slots
    if not named:
        add(
            "synchronized_standby_slots",
            "warn",
            "synchronized_standby_slots is empty on the primary: the relay may confirm WAL a "
            "standby has not received, and the slot synced there can be ahead of the "
            "promoted standby's own WAL (events lost)",
            "ALTER SYSTEM SET synchronized_standby_slots = '<the standby's physical slot>'; "
            "SELECT pg_reload_conf();",
        )
    else:
        missing = [n for n in named if n not in primary.physical_slots]
        if missing:
            add(
                "synchronized_standby_slots",
                "warn",
                f"synchronized_standby_slots names {', '.join(missing)}, which is no physical "
                "slot here: logical decoding waits for it",
                "name the physical slots the standbys stream through (primary_slot_name)",
                names=named,
            )
        else:
            add(
                "synchronized_standby_slots",
                "ok",
                f"synchronized_standby_slots = {', '.join(named)}: decoding waits for them",
                names=named,
            )
    streaming = [s for s in primary.standbys if s.state == "streaming"]
    if streaming:
        shown = ", ".join(
            f"{s.application_name} ({s.sync_state}, slot {s.slot})" for s in streaming
        )
        add("standby_streaming", "ok", f"physical standby streaming: {shown}")
    elif primary.standbys and all(s.state is None for s in primary.standbys):
        add(
            "standby_streaming",
            "warn",
            f"{len(primary.standbys)} standby session(s) seen, but not their state",
            "grant pg_read_all_stats to this role to see whether they stream",
        )
    else:
        add(
            "standby_streaming",
            "warn",
            "no physical standby streams from this server: a failover would have no copy of "
            "the slot (or of recent commits) to go on from",
            "attach a standby (streaming replication, a physical slot of its own)",
        )


def _standby_findings(add: Any, view: StandbyView, primary: PrimaryView, name: str) -> None:
    where = {"standby": view.url}
    if view.error is not None:
        add("standby", "warn", f"standby {view.url} could not be read: {view.error}", **where)
        return
    if not view.in_recovery:
        add(
            "standby",
            "warn",
            f"{view.url} is not a standby (not in recovery)",
            "list standbys only in wal.standby_urls",
            **where,
        )
        return
    if view.version_num < 170000:
        add("standby", "warn", f"standby {view.url} runs PostgreSQL < 17: no slot sync", **where)
        return

    def setting(check: str, ok: bool, good: str, bad: str, fix: str) -> None:
        if ok:
            add(check, "ok", f"standby {view.url}: {good}", **where)
        else:
            add(check, "warn", f"standby {view.url}: {bad}", fix, **where)

    setting(
        "standby_sync_replication_slots",
        view.sync_replication_slots == "on",
        "sync_replication_slots is on",
        f"sync_replication_slots is {view.sync_replication_slots or 'off'}: it keeps no copy "
        f"of slot {name}, a promotion loses it",
        "ALTER SYSTEM SET sync_replication_slots = on; SELECT pg_reload_conf(); (on the standby)",
    )
    setting(
        "standby_hot_standby_feedback",
        view.hot_standby_feedback == "on",
        "hot_standby_feedback is on",
        "hot_standby_feedback is off: the primary may remove catalog rows the synced slot "
        "needs, and the slot is invalidated on the standby",
        "ALTER SYSTEM SET hot_standby_feedback = on; SELECT pg_reload_conf(); (on the standby)",
    )
    slot_name = view.primary_slot_name or ""
    setting(
        "standby_primary_slot_name",
        bool(slot_name) and (not primary.named_slots or slot_name in primary.named_slots),
        f"primary_slot_name is {slot_name}",
        (
            f"primary_slot_name {slot_name} is not in the primary's synchronized_standby_slots"
            if slot_name
            else "primary_slot_name is not set: slot sync needs a physical slot on the primary"
        ),
        "set primary_slot_name to a physical slot on the primary, and name it in "
        "synchronized_standby_slots there",
    )
    if view.primary_conninfo is None:
        add(
            "standby_dbname",
            "warn",
            f"standby {view.url}: primary_conninfo is not readable by this role (dbname "
            "not checked)",
            "grant pg_read_all_settings to the role of wal.standby_urls",
            **where,
        )
    else:
        setting(
            "standby_dbname",
            bool(view.dbname),
            f"primary_conninfo has dbname={view.dbname}",
            "primary_conninfo has no dbname: slot sync cannot connect to the primary's database",
            "add dbname=<the database> to primary_conninfo on the standby",
        )
    s = view.slot
    if view.synced and s is not None:
        confirmed = s.get("confirmed_flush_lsn")
        add(
            "standby_slot_synced",
            "ok",
            f"standby {view.url}: slot {name} synced (confirmed {confirmed})",
            **where,
        )
    else:
        why = (
            "is not there"
            if s is None
            else "is invalidated"
            if s.get("invalidated")
            else "is not synced yet (it is, once the relay has confirmed past where the "
            "standby first saw it)"
        )
        add(
            "standby_slot_synced",
            "warn",
            f"standby {view.url}: slot {name} {why}; a promotion now loses the slot",
            "`outbox wal setup --wait-synced` waits for it (with a relay reading the slot)",
            **where,
        )


@dataclass(frozen=True)
class SyncWait:
    synced: bool
    waited_seconds: float
    standbys: list[StandbyView]


def waited_for(standbys: list[StandbyView], primary: PrimaryView) -> list[StandbyView]:
    """The standbys to wait for: those whose physical slot synchronized_standby_slots
    names (all of them when it names none)."""
    named = primary.named_slots
    if not named:
        return standbys
    return [v for v in standbys if v.error is not None or v.primary_slot_name in named]


def wait_synced(
    settings: OutboxSettings,
    primary: PrimaryView,
    timeout: float,
    progress: Callable[[SyncWait], None],
    poll_seconds: float = 1.0,
) -> SyncWait:
    """Until the slot is synced on every standby to wait for (:func:`waited_for`), or
    ``timeout`` seconds passed; ``progress`` is told each round."""
    if primary.version_num < 170000:
        raise WalSetupError(
            f"PostgreSQL {primary.version_num // 10000} has no failover slots: nothing to wait "
            f"for; a failover loses slot {settings.wal.slot}: {INSTEAD}"
        )
    if not settings.wal.standby_urls:
        raise WalSetupError(
            "--wait-synced needs the standbys' URLs: set OUTBOX_WAL__STANDBY_URLS (the "
            "primary cannot see whether a standby has synced the slot)"
        )
    started = time.monotonic()
    while True:
        views = waited_for(read_standbys(settings), primary)
        state = SyncWait(
            bool(views) and all(v.synced for v in views), time.monotonic() - started, views
        )
        progress(state)
        if state.synced or state.waited_seconds >= timeout:
            return state
        time.sleep(poll_seconds)
