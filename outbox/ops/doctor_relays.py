"""``outbox doctor``'s checks of how relays run: what each database URL goes through (a
relay needs a session of its own), the source's own checks as the registry of sources says
(outbox/sources.py: the WAL source's slot, whether it survives a failover, replication
connection and table switch), and
the relays' heartbeats and lane coverage."""

from __future__ import annotations

import asyncio
from typing import Any

import psycopg
from sqlalchemy.ext.asyncio import AsyncConnection

from outbox.db import describe, replication_connection
from outbox.errors import OutboxError, ReplicationRefused
from outbox.ops.doctor_base import Checks
from outbox.ops.findings import Level
from outbox.ops.lag import default_stale_after
from outbox.ops.wal_failover import findings as failover_findings
from outbox.ops.wal_failover import read_primary, read_standbys
from outbox.ops.wal_health import findings as wal_findings
from outbox.ops.wal_slot import read_state
from outbox.poolers import SessionProbe, probe_session
from outbox.settings import OutboxSettings
from outbox.sources import SOURCES, deployed, source_of
from outbox.wording import counted


class RelayChecks(Checks):
    async def poolers(self) -> None:
        """What each configured database URL goes through, and who may use it: anything may
        use a session of its own; behind a transaction pooler producers need
        ``db_pooler=transaction`` (consumers switch by themselves) and the relay refuses."""
        s = self.settings
        probe = await probe_session(s)
        details = _pooler_details("database_url", probe)
        if probe.stable:
            what = f"database_url: {probe.describe()}; every component may use it"
            if s.db_pooler == "transaction":
                what += " (OUTBOX_DB_POOLER=transaction: prepared statements off anyway)"
            self.add("pooler", "ok", what, **details)
        else:
            own_relay_url = s.relay.database_url is not None
            todo = []
            if s.db_pooler != "transaction":
                todo.append(
                    "set OUTBOX_DB_POOLER=transaction wherever this URL is used: psycopg's "
                    "prepared statements fail behind it (consumers turn them off by themselves)"
                )
            if not own_relay_url:
                todo.append(
                    "set OUTBOX_RELAY__DATABASE_URL to a direct or session-pooled URL of the "
                    "same database: the relay refuses this one"
                )
            level: Level = "error" if not own_relay_url else "warn" if todo else "ok"
            relay = "the relay uses relay.database_url" if own_relay_url else "the relay may not"
            what = (
                f"database_url: {probe.describe()}; producers, consumers and operator tools "
                f"may use it, {relay}"
            )
            self.add("pooler", level, what, "; ".join(todo) or None, **details)
        for name, url in (
            ("relay.database_url", s.relay.database_url),
            ("consumer.database_url", s.consumer.database_url),
        ):
            if url is not None:
                await self._daemon_url(name, s.model_copy(update={"database_url": url}))

    async def _daemon_url(self, name: str, settings: OutboxSettings) -> None:
        try:
            probe = await probe_session(settings)
        except OutboxError as exc:
            self.add("pooler", "error", f"{name}: {exc}", f"check {name}", url=name)
            return
        details = _pooler_details(name, probe)
        if name.startswith("relay") and not probe.stable:
            what = f"{name}: {probe.describe()}; the relay refuses it"
            action = "point it at a direct or session-pooled URL of the same database"
            self.add("pooler", "error", what, action, **details)
        else:
            who = "the relay" if name.startswith("relay") else "consumers"
            self.add("pooler", "ok", f"{name}: {probe.describe()}; {who} may use it", **details)

    async def wal(self, conn: AsyncConnection) -> None:
        """The WAL source, in WAL mode or whenever its slot exists (one left over from a
        switch back to the table source holds WAL for nobody)."""
        state = await conn.run_sync(lambda sync: read_state(sync, self.settings))
        if source_of(self.settings).reports_slot(state.slot is not None):
            self.findings += wal_findings(state, self.settings)
        self.slot = state.slot

    async def wal_failover(self, conn: AsyncConnection) -> None:
        """For a source reading a slot, whether the slot would survive a failover: failover
        slots (17+), synchronized_standby_slots, a standby streaming, and each standby of
        ``wal.standby_urls`` ready to keep the slot (outbox/ops/wal_failover.py)."""
        if not source_of(self.settings).reads_slot:
            return
        primary = await conn.run_sync(read_primary)
        if primary.in_recovery:
            self.add(
                "wal_failover",
                "warn",
                "database_url reaches a standby, not the primary",
                "add target_session_attrs=read-write to the URL",
            )
            return
        standbys = await asyncio.to_thread(read_standbys, self.settings)
        self.findings += failover_findings(primary, self.slot, standbys, self.settings)

    async def wal_stream(self) -> None:
        """In WAL mode, whether the relay's URL admits the replication connection it
        streams the slot over (a pooler in front, or a role without REPLICATION, does not)."""
        if not source_of(self.settings).reads_slot:
            return
        relay = self.settings.for_relay()
        try:
            conn = await replication_connection(relay, "outbox-doctor")
        except ReplicationRefused as exc:
            action = (
                "point OUTBOX_RELAY__DATABASE_URL at PostgreSQL itself, and grant the relay's "
                "role REPLICATION (`outbox wal setup --print-sql --role ROLE`)"
            )
            self.add("wal_stream", "error", str(exc), action, url=relay.safe_database_url)
            return
        except psycopg.Error as exc:
            what = f"the relay's replication connection could not be opened: {describe(exc)[1]}"
            self.add("wal_stream", "warn", what, url=relay.safe_database_url)
            return
        await conn.close()
        what = "the relay's URL admits the replication connection it streams the slot over"
        self.add("wal_stream", "ok", what, url=relay.safe_database_url)

    def wal_switch(self, pending: int) -> None:
        """In WAL mode, rows left in the outbox table come first: the WAL relay publishes
        nothing from the slot until a table relay has drained them (switching, docs/howto)."""
        if source_of(self.settings).held_by_table_rows and pending:
            self.add(
                "wal_switch",
                "warn",
                f"{counted(pending, 'event')} still pending in the outbox table: the WAL relay "
                "publishes nothing from the slot until they are gone",
                "keep a relay with --source table running until `outbox lag` shows 0 pending",
                pending=pending,
            )

    async def relays(self, conn: AsyncConnection, pending: int) -> None:
        stale_after = self.options.stale_relay_seconds or default_stale_after(self.settings)
        rows = list(await conn.execute(self.store.relays))
        running = deployed(
            source_of(self.settings),
            (r.source for r in rows if float(r.heartbeat_age) <= stale_after),
        )
        if not running.needs_table_relays(pending):
            return  # lanes need no owner: check wal_reader says whether a relay reads
        owned: set[int] = set()
        live = 0
        for r in rows:
            age = float(r.heartbeat_age)
            if age <= stale_after:
                # A relay of a source without lanes (a WAL relay, while switching) owns none.
                kind = SOURCES.get(r.source)
                if kind is None or kind.owns_lanes:
                    live += 1
                owned.update(r.lanes or [])
                continue
            self.add(
                "relays",
                "warn",
                f"relay {r.relay_id} ({r.hostname} pid {r.pid}) has not sent a heartbeat for "
                f"{age:.0f}s; it claims lanes {sorted(r.lanes or [])}",
                "if that process is gone, its lanes are free once its database session "
                "ended; delete its row from the relays table (or restart it) to tidy up",
                relay_id=r.relay_id,
                heartbeat_age_seconds=age,
            )
        unowned = [lane for lane in range(self.settings.lanes) if lane not in owned]
        if live == 0:
            self.add(
                "relays",
                "error" if pending else "warn",
                f"no live relay ({counted(pending, 'event')} pending)",
                "start one: `outbox relay`",
            )
        elif unowned:
            self.add(
                "relays",
                "warn",
                f"{len(unowned)} of {counted(self.settings.lanes, 'lane')} without a live owner",
                "wait a few seconds for takeover; if it persists, check relay logs",
                unowned=unowned,
            )
        else:
            owners = f"{counted(live, 'live relay')} own{'s' if live == 1 else ''}"
            self.add("relays", "ok", f"{owners} all {counted(self.settings.lanes, 'lane')}")


def _pooler_details(url: str, probe: SessionProbe) -> dict[str, Any]:
    return {"url": url, "mode": probe.mode, "pooler": probe.pooler, "address": probe.address}
