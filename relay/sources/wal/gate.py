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
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from datetime import datetime
from typing import Any

import psycopg

log = logging.getLogger("relay.wal")

Connect = Callable[[], Awaitable[psycopg.AsyncConnection[tuple[Any, ...]]]]


class TableGate:
    def __init__(self, statement: Any, connect: Connect) -> None:
        self._statement = statement  # WalStore.table_oldest: (oldest created_at, read at)
        self._connect = connect
        self._oldest: datetime | None = None
        self._read_at: datetime | None = None
        self._holding = False

    async def allows(self, commit_time: datetime) -> bool:
        """Whether the transaction committed at ``commit_time`` may be published now."""
        # While holding, every question reads again: the table relays are publishing.
        if self._holding or self._read_at is None or commit_time >= self._read_at:
            conn = await self._connect()
            row = await (await conn.execute(self._statement)).fetchone()
            assert row is not None
            self._oldest, self._read_at = row
        holds = self._oldest is not None and self._oldest <= commit_time
        if holds != self._holding:
            self._holding = holds
            if holds:
                log.info(
                    "the outbox table holds unpublished rows older than the next WAL "
                    "transaction; they go first"
                )
            else:
                log.info("the outbox table holds no older row; publishing from the slot")
        return not holds
