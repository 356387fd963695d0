"""The slot's gauges: retained and unconfirmed WAL, ``wal_status``, the safe size and the
lag, every ``GAUGE_SECONDS`` on a connection of their own (``outbox_relay_wal_*``). A failed
look is tried again at the next one; the reading loop reports the database's state."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable

import psycopg
from psycopg.rows import dict_row

from outbox.errors import OutboxError
from outbox.ops.store import WAL_SLOT
from outbox.ops.wal_health import WalGauges
from outbox.ops.wal_slot import SlotState
from relay.database import Connection, Database
from relay.metrics import RelayMetrics
from relay.waiting import sleep_unless

log = logging.getLogger("relay.wal")
GAUGE_SECONDS = 5.0


class SlotGauges:
    def __init__(
        self,
        slot: str,
        database: Database,
        metrics: RelayMetrics,
        lag: Callable[[], float | None],
    ) -> None:
        self._slot = slot
        self._database = database
        self._metrics = metrics
        self._lag = lag  # the reader's, None on a standby

    async def run(self, stopping: asyncio.Event) -> None:
        conn: Connection | None = None
        try:
            while not stopping.is_set():
                try:
                    if conn is None or conn.closed:
                        conn = await self._database.connect("outbox-relay-wal-gauges")
                    async with conn.cursor(row_factory=dict_row) as cur:
                        await cur.execute(WAL_SLOT, {"slot": self._slot})
                        row = await cur.fetchone()
                    slot = None if row is None else SlotState(**row)
                    self._metrics.set_wal(WalGauges.of(slot, self._lag()))
                except (psycopg.Error, OutboxError) as exc:  # the reader says what matters
                    log.debug("slot gauges not read: %r", exc)
                    if conn is not None:
                        with contextlib.suppress(psycopg.Error):
                            await conn.close()
                    conn = None
                await sleep_unless(stopping, GAUGE_SECONDS)
        finally:
            if conn is not None:
                with contextlib.suppress(psycopg.Error):
                    await conn.close()
