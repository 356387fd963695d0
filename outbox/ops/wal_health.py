"""The WAL source's health: ``doctor``'s findings and the slot's gauges, from a
:class:`~outbox.ops.wal_slot.WalState` (pure: no SQL here).

The risks these figures watch (docs/operations/wal-slot.md): a slot nobody reads keeps WAL
on the primary without bound (``max_slot_wal_keep_size = -1``, PostgreSQL's default) until
its disk is full; a bounded one is invalidated when it falls that far behind, and then
every event it had not confirmed is gone — there is no table to read them again from.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from outbox.ops.findings import Finding, Level
from outbox.ops.wal_slot import SlotState, WalState
from outbox.settings import OutboxSettings
from outbox.sources import source_of

# outbox_relay_wal_slot_status: wal_status as a number (alert rules compare it).
STATUS_CODES = {"reserved": 0, "extended": 1, "unreserved": 2, "lost": 3}
MISSING = -1
# Warn when the WAL a bounded slot may still fall behind is under this share of the bound.
SAFE_SHARE_WARN = 0.2


class _Add(Protocol):
    def __call__(
        self, check: str, level: Level, what: str, action: str | None = None, **details: object
    ) -> None: ...


def mib(n: int | None) -> str:
    """Bytes as MiB for a report line ("?" when unknown)."""
    return "?" if n is None else f"{n / 1_048_576:,.1f} MiB"


def lost_action(slot: str, confirmed_lsn: str | None) -> str:
    """What to do about an invalidated slot (doctor's advice)."""
    since = f"LSN {confirmed_lsn}" if confirmed_lsn else "its last confirmed position"
    return (
        f"events committed since {since} that the relay had not published may be lost: "
        "stop the producers' WAL mode or accept the gap, compare what producers committed "
        "since then with the topics (republish from the source of truth), then drop and "
        f"re-create the slot {slot}: `outbox wal setup --recreate-lost`; restart the relay "
        "(docs/operations/wal-slot.md)"
    )


def findings(state: WalState, settings: OutboxSettings) -> list[Finding]:
    """``doctor``'s checks of the WAL source: run in WAL mode, or in table mode when the
    slot exists (left over from a switch, it holds WAL for nobody)."""
    out: list[Finding] = []

    def add(
        check: str, level: Level, what: str, action: str | None = None, **details: object
    ) -> None:
        out.append(Finding(check, level, what, action, dict(details)))

    wal, server, slot = settings.wal, state.server, state.slot
    wal_mode = source_of(settings).reads_slot
    if server.wal_level != "logical":
        add(
            "wal_level",
            "error" if wal_mode else "warn",
            f"wal_level is {server.wal_level}: the WAL source cannot decode anything",
            "ALTER SYSTEM SET wal_level = logical; then restart PostgreSQL",
            wal_level=server.wal_level,
        )
    else:
        add("wal_level", "ok", "wal_level is logical")
    if slot is None:
        add(
            "wal_slot",
            "error",
            f"replication slot {wal.slot} does not exist: events producers write to the WAL "
            "are decoded by nobody",
            "create it (and the publication) with `outbox wal setup` before producers switch "
            "to OUTBOX_SOURCE=wal; if it existed before, the events it had not confirmed are "
            "gone (docs/operations/wal-slot.md)",
            slot=wal.slot,
        )
    else:
        _slot_findings(add, slot, state, settings)
    if wal_mode and slot is not None:
        _reader(add, state)
    if not state.publication_exists:
        add(
            "wal_publication",
            "error" if wal_mode else "warn",
            f"publication {wal.publication} does not exist in database {server.database}: "
            "the relay cannot read the slot (pgoutput refuses an unknown publication)",
            "`outbox wal setup` (or CREATE PUBLICATION as an administrator)",
            publication=wal.publication,
        )
    else:
        add("wal_publication", "ok", f"publication {wal.publication} exists")
    if wal_mode:
        _emit_privilege(add, state, settings)
    return out


def _emit_privilege(add: _Add, state: WalState, settings: OutboxSettings) -> None:
    """Any role that may connect may write WAL events while PUBLIC may execute
    ``pg_logical_emit_message`` (outbox/ops/wal_grants.py)."""
    if not state.emit_public:
        add("wal_emit", "ok", "only granted roles may write WAL events")
        return
    add(
        "wal_emit",
        "error",
        "any role that can connect may write WAL events (PUBLIC may execute "
        f"pg_logical_emit_message in database {state.server.database}): one that may not "
        f"INSERT anywhere can forge an event under prefix {settings.wal.prefix!r} and the "
        "relay publishes it",
        "as a superuser: `outbox wal setup --producer-role <each producer's role>` (or run "
        "the SQL of `outbox wal setup --print-sql --producer-role <role>`); docs/howto/roles.md",
    )


def _slot_findings(add: _Add, slot: SlotState, state: WalState, settings: OutboxSettings) -> None:
    server = state.server
    name = slot.slot_name
    details: dict[str, object] = {
        "slot": name,
        "wal_status": slot.wal_status,
        "active": slot.active,
        "retained_bytes": slot.retained_bytes,
        "unconfirmed_bytes": slot.unconfirmed_bytes,
        "safe_wal_size": slot.safe_wal_size,
        "confirmed_flush_lsn": slot.confirmed_flush_lsn,
        "max_slot_wal_keep_size": server.max_slot_wal_keep_size,
    }
    if slot.being_created:
        add(
            "wal_slot",
            "warn",
            f"replication slot {name} is being created by another session (it has no output "
            "plugin yet; the creation waits for the transactions open when it began)",
            "run doctor again once `outbox wal setup` has finished",
            **details,
        )
        return
    why = slot.mismatch(server.database)
    if why is not None:
        add(
            "wal_slot",
            "error",
            f"replication slot {name} {why}",
            "choose another name (OUTBOX_WAL__SLOT) or drop that slot",
            **details,
        )
        return
    reads = source_of(settings).reads_slot
    if not reads and (slot.active or state.reading):
        # This shell says table, the deployment streams the slot: never advise a drop.
        readers = ", ".join(r.describe() for r in state.reading) or (
            f"walsender pid {slot.active_pid}"
        )
        add(
            "wal_slot",
            "ok",
            f"replication slot {name} is being read by {readers}: a WAL relay "
            "streams it, although OUTBOX_SOURCE is table where doctor runs",
            "run doctor with the deployment's settings (OUTBOX_SOURCE=wal) to check the WAL "
            "source itself",
            **details,
        )
        return
    if not reads:
        add(
            "wal_slot",
            "warn",
            f"replication slot {name} exists but OUTBOX_SOURCE is table: nobody reads it, "
            f"and it holds {mib(slot.retained_bytes)} of WAL",
            "once a switch back to the table source is complete and the relay drained the "
            f"slot, drop it: SELECT pg_drop_replication_slot('{name}');",
            **details,
        )
    status = slot.wal_status
    if status == "lost":
        add(
            "wal_slot",
            "error",
            f"replication slot {name} is lost (wal_status lost): the WAL it needed was "
            "removed (max_slot_wal_keep_size)",
            lost_action(name, slot.confirmed_flush_lsn),
            **details,
        )
        return
    if status == "unreserved":
        add(
            "wal_slot",
            "warn",
            f"replication slot {name} has fallen {mib(slot.retained_bytes)} behind, past "
            "max_wal_size and beyond max_slot_wal_keep_size's guarantee (wal_status "
            "unreserved): the next checkpoint may invalidate it and lose every event it has "
            "not confirmed",
            "get the relay reading now (`outbox lag`, relay logs); raise "
            "max_slot_wal_keep_size (ALTER SYSTEM SET ...; SELECT pg_reload_conf();) to buy "
            "time",
            **details,
        )
    elif reads:  # in table mode, the warning above says it all
        add(
            "wal_slot",
            "ok",
            f"replication slot {name}: logical, pgoutput, wal_status {status}, retains "
            f"{mib(slot.retained_bytes)}, {mib(slot.unconfirmed_bytes)} unconfirmed",
            None,
            **details,
        )
    _retention(add, slot, server.max_slot_wal_keep_size)


def _reader(add: _Add, state: WalState) -> None:
    """Whether a WAL relay reads the slot (the one holding the reader lock) and how many
    stand by to take over."""
    reading, standby = state.reading, state.standing_by
    details = {
        "reading_pids": [r.backend_pid for r in reading],
        "standby_pids": [r.backend_pid for r in standby],
        "readers": [r.as_dict() for r in state.readers],
    }
    if not reading:
        # A warning like the table source's "no live relay" with nothing pending: whether
        # events wait is `outbox lag`'s figure (and the slot alerts'), not known here.
        add(
            "wal_reader",
            "warn",
            f"no relay reads the slot ({len(standby)} connected, none holds the reader lock): "
            "events committed meanwhile wait in the WAL, and the slot holds more of it",
            "start `outbox relay` with OUTBOX_SOURCE=wal; if relays run, their logs say why "
            "none reads",
            **details,
        )
        return
    add(
        "wal_reader",
        "ok",
        f"a relay reads the slot: {', '.join(r.describe() for r in reading)}; "
        f"{len(standby)} standing by",
        None,
        **details,
    )


def _retention(add: _Add, slot: SlotState, limit: int) -> None:
    if limit < 0:
        add(
            "wal_retention",
            "warn",
            "max_slot_wal_keep_size is -1 (unbounded): if the relay stops reading, slot "
            f"{slot.slot_name} keeps WAL on the primary until its disk is full "
            f"(now {mib(slot.retained_bytes)})",
            "alert on outbox_relay_wal_retained_bytes (deploy/prometheus/alerts.yml), and "
            "either keep it unbounded with disk to spare or bound it: ALTER SYSTEM SET "
            "max_slot_wal_keep_size = '<size>'; SELECT pg_reload_conf(); — past that size "
            "the slot is invalidated and unconfirmed events are lost "
            "(docs/operations/wal-slot.md)",
            max_slot_wal_keep_size=limit,
            retained_bytes=slot.retained_bytes,
        )
        return
    safe = slot.safe_wal_size
    if safe is not None and safe < SAFE_SHARE_WARN * limit:
        add(
            "wal_retention",
            "warn",
            f"slot {slot.slot_name} may fall only {mib(safe)} more behind before it is "
            f"invalidated (max_slot_wal_keep_size {mib(limit)})",
            "get the relay reading (`outbox lag`), or raise max_slot_wal_keep_size",
            safe_wal_size=safe,
            max_slot_wal_keep_size=limit,
        )
    else:
        add(
            "wal_retention",
            "ok",
            f"max_slot_wal_keep_size {mib(limit)}; slot {slot.slot_name} may fall "
            f"{mib(safe)} more behind",
            safe_wal_size=safe,
            max_slot_wal_keep_size=limit,
        )


@dataclass(frozen=True)
class WalGauges:
    """The slot's figures as the relay's gauges export them (-1: unknown / unbounded)."""

    retained_bytes: float
    unconfirmed_bytes: float
    lag_seconds: float
    slot_status: float  # STATUS_CODES, MISSING when there is no slot
    safe_bytes: float  # -1: unbounded (max_slot_wal_keep_size = -1) or unknown

    @classmethod
    def of(cls, slot: SlotState | None, lag_seconds: float | None) -> WalGauges:
        lag = -1.0 if lag_seconds is None else lag_seconds
        if slot is None:
            return cls(-1.0, -1.0, lag, float(MISSING), -1.0)

        def known(n: int | None) -> float:
            return -1.0 if n is None else float(n)

        return cls(
            retained_bytes=known(slot.retained_bytes),
            unconfirmed_bytes=known(slot.unconfirmed_bytes),
            lag_seconds=lag,
            slot_status=float(STATUS_CODES.get(slot.wal_status or "", MISSING)),
            safe_bytes=known(slot.safe_wal_size),
        )
