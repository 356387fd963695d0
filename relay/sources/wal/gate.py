"""Whether the WAL source may publish a transaction while the outbox table holds unpublished
rows: the two sources side by side while a deployment switches between them.

Commit order decides. A table row that committed before a WAL transaction is older and
must reach Kafka first (switching to the WAL: the table relays drain the rows written
before the switch); one that committed after it is newer and must not hold it (switching
back to the table: the table relays start only once the slot is drained, see
``outbox wal wait-drained``, so holding the slot for them would wait for ever).

A row's commit position is not known, but its ``created_at`` is its transaction's start
(``now()``), and a transaction commits after it starts: a row created after a WAL
transaction's commit time committed after it, so it may not hold it. The rule is
therefore "hold transaction T while some unpublished row was created before T's commit
time" — exact for whole switches, conservative for a row whose transaction straddles T's
commit (it is held for, although it may be newer). Both times come from the database
server's clock.

The oldest unpublished row's time is read once and reused for every transaction that
committed before that read (``statement_timestamp()``): a row committed before such a
transaction was committed before the read too, so the read saw it (unless it was
published since, which only makes the answer more careful). A transaction committed after
the read asks again: one statement per received run of transactions, about one per
transaction at a trickle.

Rows delayed at publish (``delay_seconds``) hold nothing: a delayed event holds back no
later event, not even of its key, in either source. While rows hold the stream it is a
WARNING, repeated every minute with their count and topics, and the gauge
``outbox_relay_wal_table_rows_holding``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime
from typing import Any

import psycopg
from prometheus_client import Gauge

log = logging.getLogger("relay.wal")

Connect = Callable[[], Awaitable[psycopg.AsyncConnection[tuple[Any, ...]]]]
# While the table holds the stream, the WARNING comes again this often (with fresh counts).
REPEAT_SECONDS = 60.0
TOPICS_NAMED = 5


class TableGate:
    def __init__(
        self,
        oldest: Any,
        holding: Any,
        due: Any,
        connect: Connect,
        rows_holding: Gauge,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._clock = clock
        self._due = due  # ClaimStore.any_takeable: a row due, created at or before %(until)s
        self._statement = oldest  # WalStore.table_oldest: (oldest created_at, read at)
        self._holding_rows = holding  # WalStore.table_holding: (topic, count) per topic
        self._connect = connect
        self._gauge = rows_holding
        self._oldest: datetime | None = None
        self._read_at: datetime | None = None
        self._holding = False
        self._said_at = 0.0  # monotonic time of the last WARNING while holding

    async def allows(self, commit_time: datetime) -> bool:
        """Whether the transaction committed at ``commit_time`` may be published now."""
        # While holding, every question reads again: the table relays are publishing.
        if self._holding or self._read_at is None or commit_time >= self._read_at:
            conn = await self._connect()
            row = await (await conn.execute(self._statement)).fetchone()
            assert row is not None
            self._oldest, self._read_at = row
        holds = self._oldest is not None and self._oldest <= commit_time
        if holds and (not self._holding or self._clock() >= self._said_at + REPEAT_SECONDS):
            await self._warn(commit_time)
        elif not holds and self._holding:
            self._gauge.set(0)
            log.info("the outbox table holds no older row; publishing from the slot")
        self._holding = holds
        return not holds

    async def rows_due(self, until: datetime | None = None) -> bool:
        """Whether the table has a row due now, created at or before ``until`` (None: ever):
        the reader then publishes them (table_rows.py)."""
        conn = await self._connect()
        cur = await conn.execute(self._due, {"until": until or datetime.max.replace(tzinfo=UTC)})
        row = await cur.fetchone()
        return bool(row and row[0])

    async def _warn(self, commit_time: datetime) -> None:
        """Said when the stream starts waiting and again every REPEAT_SECONDS while it does:
        what it waits for, and what clears it (a stalled stream must never go quiet)."""
        conn = await self._connect()
        cur = await conn.execute(self._holding_rows, {"until": commit_time})
        counts = [(str(topic), int(n)) for topic, n in await cur.fetchall()]
        total = sum(n for _, n in counts)
        self._gauge.set(total)
        self._said_at = self._clock()
        named = ", ".join(f"{topic} {n}" for topic, n in counts[:TOPICS_NAMED])
        more = (
            f" and {len(counts) - TOPICS_NAMED} more topics" if len(counts) > TOPICS_NAMED else ""
        )
        log.warning(
            "the WAL stream waits: the outbox table holds %d unpublished row(s) older than "
            "the next WAL transaction (%s%s); they go first: this relay publishes them "
            "(what Kafka refuses goes to `outbox failed`; `outbox lag` shows what is left)",
            total,
            named or "none left",
            more,
            extra={"rows": total, "topics": dict(counts)},
        )
