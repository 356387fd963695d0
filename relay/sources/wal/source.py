"""The relay's WAL source (``OUTBOX_SOURCE=wal``): events read from a logical replication
slot, in commit order, instead of rows of the outbox table.

Its rooms: which relay reads the slot (``slot.py``: the reader lock, a slot lost under the
reader), the reading itself (``reading.py``: the replication stream, batches cut per key
stream, positions confirmed once settled), settling what Kafka answered (``settling.py``:
the verdict carried out in place, the failed table), the events held for a partition Kafka
does not answer for (``held.py``), the table rows that go first while switching between the
sources (``gate.py``) and are published by the reader itself (``table_rows.py``), the
slot's gauges (``gauges.py``), its SQL (``store.py``) and the
replication protocol (``stream.py``).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
from collections.abc import Coroutine
from typing import Any

import psycopg

from outbox.ops.wal_slot import READER_APPLICATION, setup_sql
from outbox.settings import OutboxSettings, RelaySettings, WalSettings
from relay.database import Connection
from relay.fence import Fence
from relay.kafka.wording import Wording
from relay.outage import DATABASE_ERRORS, OutageGuard
from relay.sources.base import Shared
from relay.sources.table.store import ClaimStore
from relay.sources.wal.gate import TableGate
from relay.sources.wal.gauges import SlotGauges
from relay.sources.wal.reading import Reader
from relay.sources.wal.settling import Settler
from relay.sources.wal.slot import ReaderLock, SetupSql
from relay.sources.wal.store import WalStore
from relay.sources.wal.streams import Wake
from relay.sources.wal.table_rows import TableRows
from relay.store import RelayStore
from relay.waiting import sleep_unless

log = logging.getLogger("relay.wal")
WORDING = Wording("events", "in memory")


class WalSource:
    name = "wal"
    wording = WORDING

    def __init__(
        self,
        wal: WalSettings,
        relay: RelaySettings,
        lanes: int,
        shared: Shared,
        store: WalStore,
        relay_store: RelayStore,
        setup: SetupSql,
        guard: OutageGuard,
        claims: ClaimStore,
    ) -> None:
        self._relay = relay
        self._shared = shared
        self._database = shared.database
        self._metrics = shared.metrics
        self._guard = guard
        self._conn: Connection | None = None  # holds the reader lock
        self._side: Connection | None = None  # the table check and the failed table
        # Publishing stops when the lock's session may have been ended (relay/fence.py).
        fence = Fence(relay.takeover_seconds, self._prove, "the WAL slot")
        self.lock = ReaderLock(wal.slot, store, relay.poll_interval_seconds, setup, fence)
        self._wake = Wake()
        self._settler = Settler(
            relay,
            lanes,
            shared.publisher,
            shared.kafka,
            shared.metrics,
            shared.verdicts,
            store,
            relay_store,
            self._side_conn,
            self._wake,
            fence,
        )
        # Switching between the sources: table rows older than a transaction go first.
        gate = TableGate(
            store.table_oldest,
            store.table_holding,
            claims.any_takeable,
            self._side_conn,
            shared.metrics.wal_table_holding,
        )
        self.reader = Reader(
            wal,
            relay,
            self._database.replication,
            store,
            self.lock,
            self._settler,
            gate,
            guard,
            self._wake,
            self._reader_conn,
            # Rows of the outbox table go out from here too, at hold points (table_rows.py).
            TableRows(
                claims,
                self._side_conn,
                self._settler.settle_in_place,
                relay.batch_size,
                max(1, relay.max_inflight_bytes // (2 * max(1, relay.pipelines))),
                relay.ack_timeout_seconds,
            ),
        )
        self._gauges = SlotGauges(wal.slot, self._database, shared.metrics, self.reader.lag)

    @classmethod
    def from_settings(cls, settings: OutboxSettings, shared: Shared) -> WalSource:
        return cls(
            settings.wal,
            settings.relay,
            settings.lanes,
            shared,
            WalStore.of(settings),
            RelayStore.of(settings),
            functools.partial(setup_sql, settings),
            shared.guard(),
            ClaimStore.of(settings),
        )

    # -- Source ---------------------------------------------------------------------------
    def tasks(self, stopping: asyncio.Event) -> dict[str, Coroutine[Any, Any, None]]:
        return {"wal": self.run(stopping), "wal-gauges": self._gauges.run(stopping)}

    @property
    def connected(self) -> bool:
        return self._conn is not None and not self._conn.closed

    def owned_lanes(self) -> list[int]:
        return []

    def status(self, database_up: bool) -> dict[str, int | float | str]:
        m = self._metrics
        return {
            "wal_unconfirmed_bytes": m.measured("outbox_relay_wal_unconfirmed_bytes", database_up),
            "wal_lag_seconds": m.measured("outbox_relay_wal_lag_seconds", database_up, 3),
            "wal_slot_status": m.measured("outbox_relay_wal_slot_status", database_up),
            "wal_held_events": m.count("outbox_relay_wal_held_events"),
        }

    def retention_horizon(self) -> int | None:
        return None

    # -- the loop -------------------------------------------------------------------------
    async def run(self, stopping: asyncio.Event) -> None:
        self._settler.stopping = stopping
        self.reader.started()
        try:
            while not stopping.is_set():
                try:
                    if self._conn is None:
                        self._conn = await self._database.connect(READER_APPLICATION)
                    if not self.lock.reading:
                        await self.lock.take(self._conn, stopping)
                        continue
                    if not await self.reader.read(stopping):
                        await sleep_unless(stopping, self._relay.poll_interval_seconds)
                except DATABASE_ERRORS as exc:
                    if isinstance(exc, psycopg.Error):
                        self.lock.gone(exc)
                    # A lost connection took the reader lock with it: another relay may
                    # read now.
                    await self._guard.survive(exc, stopping, self.close)
        finally:
            await self.close()

    async def _prove(self) -> None:
        """One round trip on the reader lock's session: it fails once that session is gone."""
        conn = self._conn
        if conn is None or conn.closed:
            raise psycopg.OperationalError("the reader lock's connection is closed")
        await conn.execute("SELECT 1")

    def _reader_conn(self) -> Connection:
        assert self._conn is not None
        return self._conn

    async def _side_conn(self) -> Connection:
        """The autocommit connection of the table check and the failed table: a failed
        event is committed there before the slot may move past it."""
        if self._side is None or self._side.closed:
            self._side = await self._database.connect("outbox-relay-wal-side")
        return self._side

    async def close(self) -> None:
        conns = [self._conn, self._side]
        self._conn = self._side = None
        self.lock.released()
        for conn in conns:
            if conn is not None and not conn.closed:
                with contextlib.suppress(psycopg.Error):
                    await conn.close()
