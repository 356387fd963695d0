"""The watches of what holds back VACUUM, as maintenance services: the outbox table's dead
rows, and the oldest snapshot (a transaction, prepared transaction or slot) holding them,
every ``relay.stats_interval_seconds``, for the ``outbox_relay_outbox_dead_rows`` and
``outbox_relay_oldest_snapshot_age_seconds`` gauges (the ``OutboxSnapshotHeld`` alert, the
dashboard). One relay of a deployment runs them: the alert and the dashboard take the
``max`` over relays; the others export 0. ``outbox doctor``, ``status`` and ``lag`` name the
holder (outbox/ops/vacuum.py).
"""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass
from typing import Any

import psycopg
from prometheus_client import Gauge

from outbox.db import unavailable
from relay.database import Connection, Database
from relay.maintenance.service import Periodic
from relay.outage import schema_missing
from relay.store import RelayStore


@dataclass(frozen=True)
class WatchSettings:
    interval_seconds: float  # relay.stats_interval_seconds


class _Watch(Periodic):
    """A watch of one gauge, and its connection: opened on its first round, kept, closed on
    stop or failure (the gauge goes to 0 then: the relay running maintenance now says)."""

    def __init__(
        self, settings: WatchSettings, database: Database, store: RelayStore, gauge: Gauge
    ) -> None:
        super().__init__(settings.interval_seconds)
        self._database = database
        self._store = store
        self._gauge = gauge
        self._conn: Connection | None = None

    async def _fetch(self, statement: Any) -> tuple[Any, ...] | None:
        try:
            if self._conn is None or self._conn.closed:
                self._conn = await self._database.connect(f"outbox-relay-{self.name}")
            cur = await self._conn.execute(statement)
            return await cur.fetchone()
        except psycopg.Error as exc:
            raise (schema_missing(exc) or unavailable(exc)) from None

    async def stop(self) -> None:
        await super().stop()
        self._gauge.set(0)

    async def close(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None and not conn.closed:
            with contextlib.suppress(psycopg.Error):
                await conn.close()


class DeadTupleWatch(_Watch):
    """Dead row versions of the outbox table (``pg_stat_user_tables.n_dead_tup``)."""

    name = "dead-tuple-watch"

    async def round(self) -> None:
        row = await self._fetch(self._store.dead_rows)
        self._gauge.set(float(row[0] or 0) if row is not None else 0.0)


class SnapshotWatch(_Watch):
    """The age of the oldest snapshot holding back VACUUM (0: none). When PostgreSQL hides
    its start from this role, its age counts from when this watch first saw it."""

    name = "snapshot-watch"
    # (pid, xid) of the oldest snapshot -> when this watch first saw it.
    _first_seen: tuple[tuple[object, ...], float] | None = None

    async def round(self) -> None:
        row = await self._fetch(self._store.oldest_snapshot)
        if row is None:
            self._first_seen = None
            self._gauge.set(0)
            return
        pid, xid, seconds = row
        now = asyncio.get_running_loop().time()
        key = (pid, xid)
        if self._first_seen is None or self._first_seen[0] != key:
            self._first_seen = (key, now)
        self._gauge.set(float(seconds) if seconds is not None else now - self._first_seen[1])

    async def stop(self) -> None:
        await super().stop()
        self._first_seen = None
