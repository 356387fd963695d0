"""The outbox table's rows, published by the relay reading the slot.

In WAL mode rows can still reach the outbox table: those written before a switch to the WAL,
a stray publish by a process still configured for the table (a cron job, an old deploy), a
row delayed at publish. The gate (gate.py) holds a WAL transaction while older table rows
are unpublished; rather than wait for a table relay that may never run, the reader
publishes them itself.

Order is the subtle part. A table row created before a WAL transaction's commit may have
committed first, so it goes first (the gate); one created after it goes after it. So the
reader publishes table rows only at a *hold point*: a WAL transaction ``T`` it has read but
not taken, with every event read before ``T`` acknowledged (or in the failed table) and
none held for an unavailable partition. Then every row created at or before ``T``'s commit
time goes — in id order per lane, as a table relay sends them — and ``T`` after them. Rows
created later wait for a later hold point, so they follow every WAL event committed before
they were created. The hold points are the transactions the gate holds and the relay's own
heartbeats (emitted at once when a row is due and the stream is idle: reading.py).

Beside table relays (during a switch) the reader takes the fence of each lane it publishes
as their claims do (relay/sources/table/store.py): a lane whose claim is in flight is
skipped this time, so a key's rows never go out from two relays at once; and a row never
passes an earlier row of its lane that a table relay put back for later (a partition Kafka
did not answer for). Rows delayed at publish hold nothing, as everywhere. The rows are
claimed in one transaction on the side connection, published and settled by the WAL
source's own settler (retried in place in order, or moved to the failed table in the same
transaction), then committed: a crash in between leaves them in the table, to be sent again
(duplicates, never loss). Retries in place last at most ``relay.ack_timeout_seconds``, then
the claim is rolled back (the fences it holds stop table relays' claims of those lanes) and
tried at the next hold point. The hold point sees to it that nothing else uses the side
connection meanwhile: the stream is stopped and its held partitions closed.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from datetime import datetime
from operator import itemgetter
from typing import cast

import psycopg

from relay.database import Connection
from relay.event import Event
from relay.sources.table.store import ClaimStore

log = logging.getLogger("relay.wal")

_by_id = itemgetter(0)


class TableRows:
    def __init__(
        self,
        store: ClaimStore,
        side: Callable[[], Awaitable[Connection]],
        settle: Callable[[list[Event], float], Awaitable[bool]],
        batch_size: int,
        batch_bytes: int,
        within: float,
    ) -> None:
        self._store = store
        self._side = side  # the WAL source's autocommit side connection
        self._settle = settle  # Settler.settle_in_place: False when stopping or out of time
        self._limit = batch_size
        self._max_bytes = batch_bytes
        # How long a claim may retry in place before it is rolled back (and tried at the
        # next hold point): its transaction holds its lanes' fences, which table relays
        # running beside it then skip.
        self._within = within

    async def publish(self, until: datetime, stopping: asyncio.Event) -> int:
        """Publish the due rows created at or before ``until`` (a hold point's commit time)
        of every lane whose fence is free; how many went."""
        sent = 0
        params = {"until": until, "limit": self._limit, "max_bytes": self._max_bytes}
        while not stopping.is_set():
            conn = await self._side()
            settled = True
            async with conn.transaction():
                cur = await conn.execute(self._store.lanes_takeable, params)
                lanes = [int(r[0]) for r in await cur.fetchall()]
                if not lanes:
                    break
                # The fences in a statement of their own, before the claim takes its
                # snapshot (relay/sources/table/store.py, the module docstring).
                await conn.execute(self._store.fence, {"lanes": lanes})
                cur = await conn.execute(self._store.take_created_until, params)
                rows = cast(list[Event], await cur.fetchall())
                rows.sort(key=_by_id)
                if rows and not await self._settle(rows, self._within):
                    settled = False
                    raise psycopg.Rollback()  # they stay in the table, for the next time
                if rows and self._store.keep:
                    await conn.execute(self._store.delete_moved, {"ids": [r[0] for r in rows]})
            if not settled or not rows:
                break
            sent += len(rows)
            # Acknowledged by Kafka, or refused and in the failed table (said there).
            log.info("rows of the outbox table settled", extra={"rows": len(rows)})
        return sent
